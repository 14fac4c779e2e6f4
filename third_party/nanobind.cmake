# nanobind for the Python extension (README.md in this folder): the copy the Python interpreter CMake finds has
# installed (`python -m nanobind --cmake_dir`), unless nanobind_ROOT or nanobind_DIR points at another.
find_package(Python 3.9 REQUIRED COMPONENTS Interpreter Development.Module)
if(NOT nanobind_ROOT)
  execute_process(COMMAND "${Python_EXECUTABLE}" -m nanobind --cmake_dir
    OUTPUT_VARIABLE nanobind_ROOT OUTPUT_STRIP_TRAILING_WHITESPACE COMMAND_ERROR_IS_FATAL ANY)
endif()
find_package(nanobind CONFIG REQUIRED)
