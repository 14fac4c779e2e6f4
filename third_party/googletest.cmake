# GoogleTest for the C++ tests (README.md in this folder): the installed package (CMake's FindGTest/GTestConfig;
# another copy: -DGTest_ROOT=<prefix>), else the sources some distributions ship in /usr/src/googletest (Debian's
# libgtest-dev), built here. Defines the targets GTest::gtest and GTest::gtest_main.
find_package(GTest QUIET)
if(NOT GTest_FOUND AND EXISTS /usr/src/googletest/CMakeLists.txt)
  add_subdirectory(/usr/src/googletest ${CMAKE_BINARY_DIR}/googletest EXCLUDE_FROM_ALL)
  add_library(GTest::gtest_main ALIAS gtest_main)
  add_library(GTest::gtest ALIAS gtest)
endif()
if(NOT TARGET GTest::gtest_main)
  message(FATAL_ERROR "shadowkv: the C++ tests need GoogleTest: install libgtest-dev (or pass -DGTest_ROOT=<prefix>), "
    "or configure with -DSHADOWKV_BUILD_TESTS=OFF")
endif()
