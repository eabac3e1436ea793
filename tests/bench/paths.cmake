# bench/run.py paths with both paths in the build tree (O_DIRECT; a tmpfs takes it only since
# Linux 6.6), a 24 MiB state in 1M-element sub-groups and 4 MiB alone: calibration, then one
# rotated round of both paths alone and the equal, given and probed steps; results.jsonl holds
# their lines and three summaries, paths.png is drawn. The target is one no run misses: the
# smoke times nothing.
if(TARGET zinf-bench)
  add_test(NAME bench_paths_smoke
           COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/smoke.sh paths
                   --fast ${CMAKE_CURRENT_BINARY_DIR} --slow ${CMAKE_CURRENT_BINARY_DIR}
                   --state 24M --sub-group-size 1M --size 4M --rounds 1 --target 0.000000001
                   --bin $<TARGET_FILE:zinf-bench>)
  set_tests_properties(bench_paths_smoke PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77)
endif()
