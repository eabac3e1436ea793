# zinf-bench's numeric flags (issue 41): zero, negative, malformed or huge values are usage errors
# (exit 2) before any work, never a crash (step --sub-group-size 0 was SIGFPE).
if(TARGET zinf-bench)
  add_test(NAME launch_bench_args_test
           COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/bench_args_test.sh $<TARGET_FILE:zinf-bench>)
  set_tests_properties(launch_bench_args_test PROPERTIES TIMEOUT 120)
endif()
