# bench/run.py step on a 96 MiB state: both modes run, results.jsonl holds their lines, step.png
# is drawn.
if(TARGET zinf-bench)
  add_test(NAME bench_step_smoke
           COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/smoke.sh step
                   --state 96M --sub-group-size 4M --bin $<TARGET_FILE:zinf-bench>)
  set_tests_properties(bench_step_smoke PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77)
endif()
