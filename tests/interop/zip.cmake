# Zip archives (interop/zip.h): round trips, Python's zipfile reading what we write and writing
# what we read, hostile archives.
zinf_add_unit_test(zip_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/zip_test.cc LIBS zinf::interop
                   TIMEOUT 60)
