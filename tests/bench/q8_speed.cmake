# bench/run.py q8-speed on 1M elements and a 24 MiB state, one round, small triad arrays: the
# kernel pair and the step round per SIMD path of this CPU, their summaries, q8-speed.png. Skipped
# on a CPU with neither AVX-512 nor AVX2.
if(TARGET zinf-bench)
  add_test(NAME bench_q8_speed_smoke
           COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/smoke.sh q8-speed
                   --numel 1M --state 24M --rounds 1 --threads 1 --triad-mib 16
                   --bin $<TARGET_FILE:zinf-bench>)
  set_tests_properties(bench_q8_speed_smoke PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77)
endif()
