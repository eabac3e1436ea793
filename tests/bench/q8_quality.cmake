# bench/run.py q8-quality: charlm trained 30 steps with fp32 and with q8 state on 3 ranks (an odd
# count, oversubscribed on 2 cores): both runs leave their held-out losses, results.jsonl holds
# the run lines and the summary, q8-quality.png is drawn.
if(TARGET zinf-train)
  add_test(NAME bench_q8_quality_smoke
           COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/smoke.sh q8-quality
                   --steps 30 --ranks 3 --bin $<TARGET_FILE:zinf-train>)
  set_tests_properties(bench_q8_quality_smoke PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77)
endif()
