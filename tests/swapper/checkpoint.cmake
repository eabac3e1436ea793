# Checkpoint save/restore (swapper/src/checkpoint*.cc): round trips, N -> M, commit protocol,
# corruption and mismatch errors, export.
zinf_add_mpi_test(swapper_checkpoint_mpi_test SOURCES checkpoint_mpi_test.cc
                  LIBS zinf::swapper zinf::partition zinf::storage NP 1 2 3 4 TIMEOUT 180)

# kill -9 of one rank at random points during saves: the previous checkpoint always restores.
add_executable(swapper_checkpoint_kill_helper checkpoint_kill_helper.cc)
target_link_libraries(swapper_checkpoint_kill_helper PRIVATE zinf_build_flags zinf::swapper
                                                             zinf::comm)
add_test(NAME swapper_checkpoint_kill_test
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/checkpoint_kill_test.sh
                 $<TARGET_FILE:swapper_checkpoint_kill_helper> ${MPIEXEC_EXECUTABLE} 20)
set_tests_properties(swapper_checkpoint_kill_test PROPERTIES TIMEOUT 300 LABELS "mpi;e2e"
                     PROCESSORS 2)
