# bench/run.py io-sweep with 1 MiB per configuration (84 configurations, well under a second of
# I/O): io-sweep.csv's rows as JSON lines, the best configuration per op and for both, and the
# pictures io-sweep.png (read) and io-sweep-write.png.
if(TARGET zinf-bench)
  add_test(NAME bench_io_sweep_smoke
           COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/smoke.sh io-sweep
                   --size 1M --bin $<TARGET_FILE:zinf-bench>)
  set_tests_properties(bench_io_sweep_smoke PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77)
endif()
