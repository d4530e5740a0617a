# Configures and builds a consumer project in a fresh binary directory, as its user would:
#   cmake -DSOURCE=DIR -DBINARY=DIR "-DARGS=-DA=1|-DB=2" [-DCUDA_ARCHS=80-real,90-real] -P build_consumer.cmake
# ARGS: configure arguments separated by '|'. CUDA_ARCHS: CMAKE_CUDA_ARCHITECTURES, comma-separated
# (written to an initial cache, since a list does not survive a command line here).
# Builds with as many jobs as the machine has cores.
file(REMOVE_RECURSE ${BINARY})
file(MAKE_DIRECTORY ${BINARY})
string(REPLACE "|" ";" args "${ARGS}")
if(CUDA_ARCHS)
  string(REPLACE "," ";" archs "${CUDA_ARCHS}")
  file(WRITE ${BINARY}/cuda-init.cmake "set(CMAKE_CUDA_ARCHITECTURES \"${archs}\" CACHE STRING \"\")\n")
  list(PREPEND args -C ${BINARY}/cuda-init.cmake)
endif()
execute_process(COMMAND ${CMAKE_COMMAND} ${args} -S ${SOURCE} -B ${BINARY} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring ${SOURCE} in ${BINARY} failed (${rc})")
endif()
cmake_host_system_information(RESULT jobs QUERY NUMBER_OF_LOGICAL_CORES)
execute_process(COMMAND ${CMAKE_COMMAND} --build ${BINARY} -j ${jobs} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building ${BINARY} failed (${rc})")
endif()
