# BLAS/LAPACK for the CPU backend (README.md in this folder): CMake's FindLAPACK, which finds BLAS too. Another copy:
# -DBLA_VENDOR=OpenBLAS (or Intel10_64lp, FlexiBLAS, ...), or -DLAPACK_LIBRARIES=<libraries>.
# Defines SHADOWKV_BLAS_NAME, the file name of the first library found (build_info()["blas"]).
find_package(LAPACK REQUIRED)
list(GET LAPACK_LIBRARIES 0 _shadowkv_first_lapack)
get_filename_component(SHADOWKV_BLAS_NAME "${_shadowkv_first_lapack}" NAME)
