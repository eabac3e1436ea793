# I/O engine part of the storage module: files, aligned buffers, engines, fault injection.
# Label `engine` so that CI can run exactly these under ThreadSanitizer (`ctest -L engine`).
zinf_add_unit_test(storage_file_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/file_test.cc
  LIBS zinf::storage
  LABELS engine)
zinf_add_unit_test(storage_aligned_buffer_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/aligned_buffer_test.cc
  LIBS zinf::storage
  LABELS engine)
# The io_uring cases run as storage_io_engine_test.uring: Skipped where io_uring is blocked.
zinf_add_unit_test(storage_io_engine_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/io_engine_test.cc
  LIBS zinf::storage
  LABELS engine
  CAPABILITY uring "*/uring*:CreateIoEngineTest.ProbeFailureIsReported")
zinf_add_unit_test(storage_fault_injection_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/fault_injection_test.cc
  LIBS zinf::storage
  LABELS engine)
