# I/O backend part of the storage module: files, aligned buffers, backends, fault injection.
# Label `io` so that CI can run exactly these under ThreadSanitizer (`ctest -L io`).
zinf_add_unit_test(storage_file_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/file_test.cc
  LIBS zinf::storage
  LABELS io)
zinf_add_unit_test(storage_aligned_buffer_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/aligned_buffer_test.cc
  LIBS zinf::storage
  LABELS io)
# The io_uring cases run as storage_io_backend_test.uring: Skipped where io_uring is blocked.
zinf_add_unit_test(storage_io_backend_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/io_backend_test.cc
  LIBS zinf::storage
  LABELS io
  CAPABILITY uring "*/uring*:CreateIoBackendTest.ProbeFailureIsReported")
zinf_add_unit_test(storage_fault_injection_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/fault_injection_test.cc
  LIBS zinf::storage
  LABELS io)
