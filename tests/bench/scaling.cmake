# bench/run.py scaling on 1, 2 and 3 ranks (an odd count included), 12 MiB of optimizer state per
# rank (weak) and 12 MiB in all (strong), 2 steps: every run gives its figures, results.jsonl
# holds the runs, the summaries and the verdict, scaling.png is drawn. Times nothing.
if(TARGET zinf-train)
  add_test(NAME bench_scaling_smoke
           COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/smoke.sh scaling --ranks "1 2 3"
                   --state-per-rank 12M --strong-total 12M --steps 2
                   --bin $<TARGET_FILE:zinf-train>)
  set_tests_properties(bench_scaling_smoke PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77
                       PROCESSORS 2)
endif()
