# Finds every third-party dependency once, for all modules. launch/install-deps.sh installs them.
find_package(Threads REQUIRED)
find_package(MPI REQUIRED COMPONENTS C)
find_package(fmt CONFIG REQUIRED)
find_package(nlohmann_json CONFIG REQUIRED)
find_package(CLI11 CONFIG REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(URING REQUIRED IMPORTED_TARGET liburing>=2.0)

set(HDF5_PREFER_PARALLEL ON)
find_package(HDF5 REQUIRED COMPONENTS C)
if(NOT HDF5_IS_PARALLEL)
  message(FATAL_ERROR "zinf needs parallel HDF5 (Debian: libhdf5-openmpi-dev); found a serial build")
endif()

find_path(XXHASH_INCLUDE_DIR xxhash.h)
find_library(XXHASH_LIBRARY xxhash)
if(NOT XXHASH_INCLUDE_DIR OR NOT XXHASH_LIBRARY)
  message(FATAL_ERROR "xxHash not found (Debian: libxxhash-dev)")
endif()
add_library(zinf_xxhash UNKNOWN IMPORTED)
set_target_properties(zinf_xxhash PROPERTIES IMPORTED_LOCATION "${XXHASH_LIBRARY}"
                                             INTERFACE_INCLUDE_DIRECTORIES "${XXHASH_INCLUDE_DIR}")

find_package(BLAS)

# CUDA + NCCL. AUTO turns them on when both are found; ON requires them.
set(ZINF_CUDA_ENABLED OFF)
if(NOT ZINF_WITH_CUDA STREQUAL "OFF")
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
  endif()
  if(CUDAToolkit_FOUND AND NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    set(ZINF_CUDA_ENABLED ON)
    add_library(zinf_nccl UNKNOWN IMPORTED)
    set_target_properties(zinf_nccl PROPERTIES IMPORTED_LOCATION "${NCCL_LIBRARY}"
                                               INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
  elseif(ZINF_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "ZINF_WITH_CUDA=ON but CUDAToolkit (${CUDAToolkit_FOUND}) or NCCL "
                        "(${NCCL_LIBRARY}) was not found")
  endif()
endif()
message(STATUS "zinf: CUDA/NCCL paths ${ZINF_CUDA_ENABLED}")
