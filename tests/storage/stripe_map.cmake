# Stripe map of the swap store (storage/src/stripe_map.cc): pure arithmetic, no files.
zinf_add_unit_test(storage_stripe_map_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/stripe_map_test.cc
  LIBS zinf::storage
  LABELS storage)
