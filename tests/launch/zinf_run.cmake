# launch/zinf-run, the mpirun wrapper: the command it builds (dry runs), its usage errors (exit 2),
# and real runs on up to 3 ranks: exit status, stdin, SIGTERM/SIGINT reaching every rank.
add_test(NAME launch_zinf_run_test
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/zinf_run_test.sh
                 ${PROJECT_SOURCE_DIR}/launch/zinf-run)
set_tests_properties(launch_zinf_run_test PROPERTIES TIMEOUT 120 LABELS "mpi" PROCESSORS 2)
