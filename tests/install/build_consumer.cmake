# Configures and builds a consumer project in a fresh binary directory, as its user would:
#   cmake -DSOURCE=DIR -DBINARY=DIR "-DARGS=-DA=1|-DB=2" [-DINIT=FILE] [-DCUDA_ARCHS=80-real,90-real]
#         -P build_consumer.cmake
# ARGS: configure arguments separated by '|'. INIT: an initial cache (the configure environment of
# the Ferry build: prefix path, compilers; see CMakeLists.txt). CUDA_ARCHS: CMAKE_CUDA_ARCHITECTURES,
# comma-separated. Both go into one initial cache in BINARY, since a list does not survive a command
# line here.
# Builds with as many jobs as the machine has cores.
file(REMOVE_RECURSE ${BINARY})
file(MAKE_DIRECTORY ${BINARY})
string(REPLACE "|" ";" args "${ARGS}")
set(init "")
if(INIT)
  file(READ ${INIT} init)
endif()
if(CUDA_ARCHS)
  string(REPLACE "," ";" archs "${CUDA_ARCHS}")
  string(APPEND init "set(CMAKE_CUDA_ARCHITECTURES \"${archs}\" CACHE STRING \"\")\n")
endif()
if(NOT init STREQUAL "")
  file(WRITE ${BINARY}/consumer-init.cmake "${init}")
  list(PREPEND args -C ${BINARY}/consumer-init.cmake)
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
