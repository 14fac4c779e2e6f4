# ctest find_package_example: install the build tree's "dev" component to a scratch prefix, then configure, build
# and run examples/find_package against it. Any failing step fails the test.
#
# Inputs (-D): SHADOWKV_BINARY_DIR, EXAMPLE_SOURCE_DIR, WORK_DIR, GENERATOR, MAKE_PROGRAM, CXX_COMPILER, CONFIG,
#              WITH_CUDA, CUDA_COMPILER, CUDA_ROOT.
cmake_minimum_required(VERSION 3.24)

foreach(required SHADOWKV_BINARY_DIR EXAMPLE_SOURCE_DIR WORK_DIR GENERATOR)
  if(NOT DEFINED ${required} OR "${${required}}" STREQUAL "")
    message(FATAL_ERROR "run_find_package_example.cmake: -D${required}=... is required")
  endif()
endforeach()

set(prefix "${WORK_DIR}/prefix")
set(example_build "${WORK_DIR}/build")
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

function(run_step name)
  message(STATUS "find_package_example: ${name}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
  message("${output}")
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "find_package_example: ${name} failed (exit ${result})")
  endif()
endfunction()

set(config_args)
if(CONFIG)
  set(config_args --config "${CONFIG}")
endif()

# 1. Install only the C++ package.
run_step("install the dev component"
  "${CMAKE_COMMAND}" --install "${SHADOWKV_BINARY_DIR}" --prefix "${prefix}" --component dev ${config_args})
if(NOT EXISTS "${prefix}/include/shadowkv/store.hpp")
  message(FATAL_ERROR "find_package_example: the install has no include/shadowkv/store.hpp")
endif()
file(GLOB_RECURSE package_config "${prefix}/*/shadowkvConfig.cmake")
if(NOT package_config)
  message(FATAL_ERROR "find_package_example: the install has no shadowkvConfig.cmake")
endif()

# 2. Configure the example against it, with the same generator and compiler. A CUDA build's package config
#    does find_dependency(CUDAToolkit): point it at the toolkit this build used.
set(configure_args -S "${EXAMPLE_SOURCE_DIR}" -B "${example_build}" -G "${GENERATOR}"
  "-DCMAKE_PREFIX_PATH=${prefix}" "-DCMAKE_FIND_PACKAGE_PREFER_CONFIG=ON")
if(MAKE_PROGRAM)
  list(APPEND configure_args "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
endif()
if(CXX_COMPILER)
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
endif()
if(CONFIG AND NOT GENERATOR MATCHES "Multi-Config|Visual Studio|Xcode")
  list(APPEND configure_args "-DCMAKE_BUILD_TYPE=${CONFIG}")
endif()
if(WITH_CUDA AND CUDA_ROOT)
  list(APPEND configure_args "-DCUDAToolkit_ROOT=${CUDA_ROOT}")
endif()
run_step("configure the example" "${CMAKE_COMMAND}" ${configure_args})

# 3. Build and run it.
run_step("build the example" "${CMAKE_COMMAND}" --build "${example_build}" ${config_args})
set(candidates "${example_build}/shadowkv_example" "${example_build}/${CONFIG}/shadowkv_example"
  "${example_build}/shadowkv_example.exe" "${example_build}/${CONFIG}/shadowkv_example.exe")
set(program "")
foreach(candidate IN LISTS candidates)
  if(NOT program AND EXISTS "${candidate}" AND NOT IS_DIRECTORY "${candidate}")
    set(program "${candidate}")
  endif()
endforeach()
if(NOT program)
  message(FATAL_ERROR "find_package_example: no shadowkv_example executable under ${example_build}")
endif()
run_step("run the example" "${program}")
