# The HDF5 wrapper needs zinf::comm (it is compiled into zinf::storage only when comm exists).
find_program(ZINF_H5DUMP_EXECUTABLE h5dump)
if(TARGET zinf_comm)
  # Serial files, the handle wrappers and error stacks. The handle test includes storage's
  # private hdf5_handles.h, hence the extra include directory and the direct HDF5 link.
  zinf_add_unit_test(storage_hdf5_test
    SOURCES ${CMAKE_CURRENT_LIST_DIR}/hdf5_test.cc
    LIBS zinf::storage HDF5::HDF5)
  target_include_directories(storage_hdf5_test PRIVATE ${PROJECT_SOURCE_DIR}/storage/src)
  target_compile_definitions(storage_hdf5_test PRIVATE ZINF_H5DUMP="${ZINF_H5DUMP_EXECUTABLE}")

  # Collective files on 1-4 ranks.
  zinf_add_mpi_test(storage_hdf5_mpi_test
    SOURCES ${CMAKE_CURRENT_LIST_DIR}/hdf5_mpi_test.cc
    LIBS zinf::storage
    NP 1 2 3 4
    TIMEOUT 120)
  target_compile_definitions(storage_hdf5_mpi_test PRIVATE ZINF_H5DUMP="${ZINF_H5DUMP_EXECUTABLE}")
endif()
