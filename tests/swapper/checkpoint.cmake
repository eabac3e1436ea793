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

# Hostile checkpoint files (sizes near 2^40, deep JSON, unallocated chunks, wrong types, bad
# steps, links and storage outside the file, escapes, q8 scales and trainer states beyond what a
# writer produces) made by swapper_craft_checkpoints; every zinf-ckpt command on them, and a
# zinf-train resume from a few, ends in exit 0 or 1 with the defect named: no signal, no hang, no
# raw escape byte; and a resume from every one (swapper_resume_crafted) agrees with verify.
add_executable(swapper_craft_checkpoints craft_checkpoints.cc)
target_link_libraries(swapper_craft_checkpoints PRIVATE zinf_build_flags zinf::swapper
                                                        zinf::storage zinf::partition zinf::core
                                                        HDF5::HDF5 MPI::MPI_C)
# The resume that verify must agree with on every crafted file: ZeroEngine::Create with the
# file to load, one step (resume_crafted.cc).
if(TARGET zinf_engine)
  add_executable(swapper_resume_crafted resume_crafted.cc)
  target_link_libraries(swapper_resume_crafted PRIVATE zinf_build_flags zinf::engine zinf::swapper
                                                       zinf::comm zinf::core)
endif()
if(TARGET zinf-train AND TARGET zinf-ckpt AND TARGET swapper_resume_crafted)
  add_test(NAME swapper_crafted_checkpoints
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/crafted_checkpoints.sh
                   $<TARGET_FILE:zinf-train> $<TARGET_FILE:zinf-ckpt> ${MPIEXEC_EXECUTABLE}
                   $<TARGET_FILE:swapper_craft_checkpoints>
                   $<TARGET_FILE:swapper_resume_crafted>)
  # Two workers check the files side by side; about 30-60 s on the 2-core CI machine.
  set_tests_properties(swapper_crafted_checkpoints PROPERTIES TIMEOUT 180 LABELS "e2e"
                       PROCESSORS 2)
endif()

# A fault injected into each file-system call of a save (storage::Env), one at a time, on rank 0:
# the save fails on every rank alike or commits, and `latest` always names a complete checkpoint.
zinf_add_mpi_test(swapper_checkpoint_faults_mpi_test SOURCES checkpoint_faults_mpi_test.cc
                  LIBS zinf::swapper zinf::partition zinf::storage NP 1 3 TIMEOUT 180)
