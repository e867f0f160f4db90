# Configures, builds and runs one consumer project: cmake -DSOURCE=... -DBINARY=... -DPREFIX_PATH=a:b -P this
# (-DOPTION=-DNAME=VALUE: one more option for the consumer's configure)
foreach(var SOURCE BINARY PREFIX_PATH MEMSAVE_SOURCE_DIR GENERATOR CXX)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "build_and_run.cmake: ${var} is not set")
  endif()
endforeach()

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "failed (${result}): ${ARGN}")
  endif()
endfunction()

file(REMOVE_RECURSE ${BINARY})
set(ENV{CMAKE_PREFIX_PATH} "${PREFIX_PATH}")  # a ':'-separated list, as in the environment
run(${CMAKE_COMMAND} -S ${SOURCE} -B ${BINARY} -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX}
    -DCMAKE_BUILD_TYPE=Release -DMEMSAVE_SOURCE_DIR=${MEMSAVE_SOURCE_DIR} ${OPTION})
run(${CMAKE_COMMAND} --build ${BINARY})
run(${BINARY}/consumer)
