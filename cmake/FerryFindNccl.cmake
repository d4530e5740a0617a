# Finds NCCL for the NCCL trainer sample (samples/cpp/nccl_trainer); the engine itself never uses it.
# Sets FERRY_HAVE_NCCL, and when ON the imported target ferry_nccl (nccl.h and libnccl.so*) and
# FERRY_NCCL_LIBRARY_DIR (for the sample's build RPATH). Looks, in order, in:
#   1. -DFERRY_NCCL_ROOT=PREFIX, then $NCCL_ROOT, $NCCL_HOME, $NCCL_DIR   (PREFIX/include/nccl.h, PREFIX/lib*/libnccl.so*)
#   2. the CUDA toolkit's include and library directories (CUDAToolkit_*)
#   3. the `nvidia-nccl-cu12/13` wheel torch depends on (site-packages/nvidia/nccl/{include,lib}): asked of
#      FERRY_PYTHON, the python3 beside `torchrun` on PATH, $VIRTUAL_ENV's and python3 on PATH
#      (`import nvidia.nccl`), then globbed under /opt, /root, /home, /usr/local, /usr/lib, ~/.local and
#      the project's parent directory
#   4. the system's default paths (Debian/Ubuntu: libnccl-dev)
# The wheel ships only libnccl.so.2 (no unversioned libnccl.so); it is linked by its full path.
# Not found: a status line lists every place looked.
set(FERRY_HAVE_NCCL OFF)
set(FERRY_NCCL_ROOT "" CACHE PATH "A prefix holding include/nccl.h and lib/libnccl.so* (empty: search)")

set(_nccl_prefixes)
foreach(_p IN ITEMS "${FERRY_NCCL_ROOT}" "$ENV{NCCL_ROOT}" "$ENV{NCCL_HOME}" "$ENV{NCCL_DIR}")
  if(_p)
    list(APPEND _nccl_prefixes "${_p}")
  endif()
endforeach()
# The toolkit: include/ and lib64/ (or targets/<arch>/{include,lib}) of its root.
if(CUDAToolkit_LIBRARY_ROOT)
  list(APPEND _nccl_prefixes "${CUDAToolkit_LIBRARY_ROOT}")
endif()
foreach(_d IN LISTS CUDAToolkit_INCLUDE_DIRS)
  get_filename_component(_p "${_d}" DIRECTORY)
  list(APPEND _nccl_prefixes "${_p}")
endforeach()

# The wheel, through the interpreters that may have it.
set(_nccl_pythons)
if(FERRY_PYTHON)
  list(APPEND _nccl_pythons "${FERRY_PYTHON}")
endif()
find_program(_nccl_torchrun torchrun NO_CACHE)
if(_nccl_torchrun)
  get_filename_component(_d "${_nccl_torchrun}" DIRECTORY)  # the venv's bin/ (torchrun is a script)
  list(APPEND _nccl_pythons "${_d}/python3" "${_d}/python")
endif()
if(DEFINED ENV{VIRTUAL_ENV})
  list(APPEND _nccl_pythons "$ENV{VIRTUAL_ENV}/bin/python3")
endif()
find_program(_nccl_path_python python3 NO_CACHE)
if(_nccl_path_python)
  list(APPEND _nccl_pythons "${_nccl_path_python}")
endif()
list(REMOVE_DUPLICATES _nccl_pythons)
foreach(_py IN LISTS _nccl_pythons)
  if(EXISTS "${_py}")
    # A namespace package may have no __file__: take its __path__.
    execute_process(COMMAND "${_py}" -c "import nvidia.nccl as m; print(list(m.__path__)[0])"
                    OUTPUT_VARIABLE _d OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _rc)
    if(_rc EQUAL 0 AND _d)
      list(APPEND _nccl_prefixes "${_d}")
    endif()
  endif()
endforeach()
get_filename_component(_nccl_parent "${PROJECT_SOURCE_DIR}" DIRECTORY)
file(GLOB _nccl_wheels LIST_DIRECTORIES true
     "/opt/*/lib/python3*/site-packages/nvidia/nccl" "/opt/*/*/lib/python3*/site-packages/nvidia/nccl"
     "/root/*/lib/python3*/site-packages/nvidia/nccl" "/root/.local/lib/python3*/site-packages/nvidia/nccl"
     "/home/*/*/lib/python3*/site-packages/nvidia/nccl" "/home/*/.local/lib/python3*/site-packages/nvidia/nccl"
     "/usr/local/lib/python3*/dist-packages/nvidia/nccl" "/usr/local/lib/python3*/site-packages/nvidia/nccl"
     "/usr/lib/python3/dist-packages/nvidia/nccl" "/*/lib/python3*/site-packages/nvidia/nccl"
     "/*/*/lib/python3*/site-packages/nvidia/nccl" "${_nccl_parent}/*/lib/python3*/site-packages/nvidia/nccl"
     "${PROJECT_SOURCE_DIR}/*/lib/python3*/site-packages/nvidia/nccl")
list(APPEND _nccl_prefixes ${_nccl_wheels})
list(REMOVE_DUPLICATES _nccl_prefixes)

# The first prefix with both the header and the library, so that they match.
set(_nccl_include "")
set(_nccl_library "")
foreach(_p IN LISTS _nccl_prefixes)
  foreach(_inc IN ITEMS include targets/x86_64-linux/include targets/sbsa-linux/include)
    if(NOT _nccl_include AND EXISTS "${_p}/${_inc}/nccl.h")
      foreach(_lib IN ITEMS lib lib64 lib/x86_64-linux-gnu lib/aarch64-linux-gnu targets/x86_64-linux/lib
                            targets/sbsa-linux/lib)
        foreach(_name IN ITEMS libnccl.so libnccl.so.2)
          if(NOT _nccl_library AND EXISTS "${_p}/${_lib}/${_name}")
            set(_nccl_include "${_p}/${_inc}")
            set(_nccl_library "${_p}/${_lib}/${_name}")
          endif()
        endforeach()
      endforeach()
    endif()
  endforeach()
endforeach()
if(NOT _nccl_library)  # the system's default paths (libnccl-dev)
  find_path(_nccl_sys_include nccl.h NO_CACHE)
  find_library(_nccl_sys_library NAMES nccl libnccl.so.2 NO_CACHE)
  if(_nccl_sys_include AND _nccl_sys_library)
    set(_nccl_include "${_nccl_sys_include}")
    set(_nccl_library "${_nccl_sys_library}")
  endif()
endif()

if(_nccl_library)
  get_filename_component(_nccl_library "${_nccl_library}" REALPATH)
  file(STRINGS "${_nccl_include}/nccl.h" _v REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) +[0-9]+")
  string(REGEX REPLACE ".*NCCL_MAJOR +([0-9]+).*NCCL_MINOR +([0-9]+).*NCCL_PATCH +([0-9]+).*" "\\1.\\2.\\3"
         FERRY_NCCL_VERSION "${_v}")
  if(NOT FERRY_NCCL_VERSION MATCHES "^[0-9]+\\.[0-9]+\\.[0-9]+$")
    set(FERRY_NCCL_VERSION "version unknown")
  endif()
  get_filename_component(FERRY_NCCL_LIBRARY_DIR "${_nccl_library}" DIRECTORY)
  add_library(ferry_nccl SHARED IMPORTED)
  set_target_properties(ferry_nccl PROPERTIES IMPORTED_LOCATION "${_nccl_library}"
                                              INTERFACE_INCLUDE_DIRECTORIES "${_nccl_include}")
  set(FERRY_HAVE_NCCL ON)
  message(STATUS "ferry: NCCL ON (${FERRY_NCCL_VERSION}: ${_nccl_include}/nccl.h, ${_nccl_library})")
else()
  string(REPLACE ";" ", " _looked "${_nccl_prefixes}")
  if(NOT _looked)
    set(_looked "(no prefix)")
  endif()
  string(REPLACE ";" ", " _asked "${_nccl_pythons}")
  message(STATUS "ferry: NCCL OFF: no include/nccl.h with lib*/libnccl.so* under ${_looked} (the prefixes named, the "
                 "CUDA toolkit's, and the nvidia/nccl wheels that the interpreters [${_asked}] import or that the "
                 "globs of site-packages under /opt, /root, /home, /usr/local, /usr/lib, /*, /*/* and "
                 "${_nccl_parent} match), nor in the system's paths; -DFERRY_NCCL_ROOT=PREFIX names it")
endif()
