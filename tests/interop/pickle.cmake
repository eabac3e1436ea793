# Pickles (interop/src/pickle.cc): WritePickle -> ReadPickle round trips, the bytes torch writes
# for a tensor, hand-made pickles of protocols 0-4, hostile pickles (code-running globals by
# GLOBAL, STACK_GLOBAL and INST, truncation at every byte, nesting, huge lengths, memo, stack and
# REDUCE/BUILD misuse, sharing that would multiply the tree) and random mutations (also under
# ASan). PythonPickles.* (entry pickle_test.torch, skipped without Debian's python3-torch):
# pickles Python and torch.save write (make_pickles.py gen) read here, and what WritePickle
# writes read by Python's unpickler and torch.load (make_pickles.py check).
zinf_add_unit_test(pickle_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/pickle_test.cc
                   LIBS zinf::interop TIMEOUT 60 CAPABILITY torch "PythonPickles.*")
target_compile_definitions(pickle_test PRIVATE ZINF_PYTHON="/usr/bin/python3"
                           ZINF_MAKE_PICKLES_PY="${CMAKE_CURRENT_LIST_DIR}/make_pickles.py")
