# CUTLASS/CuTe headers (README.md in this folder). Included by cuda/CMakeLists.txt; defines SHADOWKV_CUTLASS_INCLUDE,
# the folder holding cute/ and cutlass/. The headers (the key rebuild's gather-GEMM) come from the nvidia-cutlass Python package, which ships them
# under cutlass_library/source/include. SHADOWKV_CUTLASS_INCLUDE_DIR (the folder holding cute/ and cutlass/) overrides
# the search. The package is looked up on every configure and not cached: pip's isolated build environments live in
# temporary folders. find_spec locates it without importing it (its import pulls in cuda-python).
set(SHADOWKV_CUTLASS_INCLUDE_DIR "" CACHE PATH
  "CUTLASS include folder (holding cute/ and cutlass/); empty: from the nvidia-cutlass Python package")
set(SHADOWKV_CUTLASS_INCLUDE "${SHADOWKV_CUTLASS_INCLUDE_DIR}")
if(NOT SHADOWKV_CUTLASS_INCLUDE)
  if(Python_EXECUTABLE)
    set(_shadowkv_python "${Python_EXECUTABLE}")
  elseif(Python3_EXECUTABLE)
    set(_shadowkv_python "${Python3_EXECUTABLE}")
  else()
    find_package(Python3 COMPONENTS Interpreter QUIET)
    set(_shadowkv_python "${Python3_EXECUTABLE}")
  endif()
  if(_shadowkv_python)
    string(CONCAT _shadowkv_cutlass_query
      "import importlib.util, os; s = importlib.util.find_spec('cutlass_library'); "
      "print(os.path.join(list(s.submodule_search_locations)[0], 'source', 'include') if s else '')")
    execute_process(
      COMMAND "${_shadowkv_python}" -c "${_shadowkv_cutlass_query}"
      OUTPUT_VARIABLE _shadowkv_cutlass_found OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET
      RESULT_VARIABLE _shadowkv_cutlass_status)
    if(_shadowkv_cutlass_status EQUAL 0 AND _shadowkv_cutlass_found)
      set(SHADOWKV_CUTLASS_INCLUDE "${_shadowkv_cutlass_found}")
    endif()
  endif()
endif()
if(NOT SHADOWKV_CUTLASS_INCLUDE OR NOT EXISTS "${SHADOWKV_CUTLASS_INCLUDE}/cute/tensor.hpp")
  message(FATAL_ERROR
    "shadowkv: the CUDA backend needs the CUTLASS/CuTe headers and none were found"
    " (SHADOWKV_CUTLASS_INCLUDE_DIR='${SHADOWKV_CUTLASS_INCLUDE_DIR}', looked with python '${_shadowkv_python}').\n"
    "Install them with `pip install nvidia-cutlass` (into the python that CMake finds), or pass"
    " -DSHADOWKV_CUTLASS_INCLUDE_DIR=<folder holding cute/ and cutlass/>, or build without CUDA: -DSHADOWKV_CUDA=OFF.")
endif()
message(STATUS "shadowkv: CUTLASS headers in ${SHADOWKV_CUTLASS_INCLUDE}")
