zinf_add_unit_test(storage_checksum_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/checksum_test.cc
  LIBS zinf::storage)
