# DeepSpeed checkpoints whose folders are replaced by links while they are read
# (interop/src/deepspeed_read.cc, deepspeed_universal.cc): a universal param folder replaced by a
# link after Open is refused by ReadParam; the checkpoint folder or its zero/ replaced after Open,
# or the checkpoint folder replaced during Open (an Env that swaps it before the first file is
# opened), leave every read on the original files.
zinf_add_unit_test(deepspeed_reopen_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/deepspeed_reopen_test.cc
                   LIBS zinf::interop TIMEOUT 60)
