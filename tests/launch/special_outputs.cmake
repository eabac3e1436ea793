# No tool writes over a file it did not create nor touches a non-regular output (issue 23):
# zinf-ckpt export, zinf-train --metrics, zinf-bench io and ckpt, bench/run.py plot and the bench
# harness's claim_dir against device nodes made in a scratch directory, a FIFO, a socket, a
# directory, links and an existing file (special_outputs_test.sh; about 10-15 s).
if(TARGET zinf-train AND TARGET zinf-ckpt AND TARGET zinf-bench)
  add_test(NAME launch_special_outputs
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/special_outputs_test.sh
                   $<TARGET_FILE:zinf-train> $<TARGET_FILE:zinf-ckpt> ${MPIEXEC_EXECUTABLE}
                   $<TARGET_FILE:zinf-bench>)
  set_tests_properties(launch_special_outputs PROPERTIES TIMEOUT 120 LABELS "e2e")
endif()
