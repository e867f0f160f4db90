# GoogleTest: the installed one, or sources given by MEMSAVE_GTEST_SOURCE_DIR (a machine without the package,
# such as the GPU machine, gets a copy of Debian's /usr/src/googletest that travels with the tree).
if(NOT TARGET GTest::gtest_main)
  if(MEMSAVE_GTEST_SOURCE_DIR)
    set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
    set(BUILD_GMOCK OFF CACHE BOOL "" FORCE)
    add_subdirectory(${MEMSAVE_GTEST_SOURCE_DIR} ${PROJECT_BINARY_DIR}/googletest EXCLUDE_FROM_ALL)
    if(NOT TARGET GTest::gtest_main)  # GoogleTest 1.11+ defines the alias itself
      add_library(GTest::gtest_main ALIAS gtest_main)
    endif()
  else()
    find_package(GTest REQUIRED)
  endif()
endif()
# NOTE: in every directory that includes this file, not only the first: gtest_discover_tests reads a variable
# that include(GoogleTest) sets in the including directory's scope, while GoogleTest's own targets are global
# when built from sources (without it there, ctest found no tests but "..._NOT_BUILT").
include(GoogleTest)
