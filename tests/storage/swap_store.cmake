# Swap store (storage/src/swap_store.cc). Some cases need root (chown to another uid, mounting a
# tiny tmpfs); without it they are skipped with the reason.
zinf_add_unit_test(storage_swap_store_test
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/swap_store_test.cc
  LIBS zinf::storage
  TIMEOUT 180
  LABELS storage
  CAPABILITY uring "*/uring*")

# The swap store over paths of unequal weight (path_weights, the manifest's weights, the probe).
zinf_add_unit_test(storage_swap_store_weights_test
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/swap_store_weights_test.cc
  LIBS zinf::storage
  TIMEOUT 60
  LABELS storage)
