# The file-system layer (storage/src/fs.cc): symlinks, FIFOs, bounded reads, atomic outputs.
zinf_add_unit_test(storage_fs_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/fs_test.cc
  LIBS zinf::storage
  LABELS storage)
