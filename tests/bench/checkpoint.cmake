# bench/run.py checkpoint on a 10 MiB state (whole MiB per fio job only after rounding): zinf-bench
# ckpt under mpirun and fio both run, the trials' lines and the three summaries land in
# results.jsonl, checkpoint.png is drawn. 1, 2 and 3 ranks (3: an uneven split); two trials on 3
# ranks, so that both orders of the tools run. The page cache is kept (dropping it is
# machine-wide) and the target is one no run misses: the smoke times nothing.
if(TARGET zinf-bench)
  foreach(ranks 1 2 3)
    if(ranks EQUAL 3)
      set(name bench_checkpoint_smoke)
      set(trials 2)
    else()
      set(name bench_checkpoint_smoke_np${ranks})
      set(trials 1)
    endif()
    add_test(NAME ${name}
             COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/smoke.sh checkpoint
                     --state 10M --ranks ${ranks} --trials ${trials} --target 999999
                     --no-drop-caches --bin $<TARGET_FILE:zinf-bench>)
    set_tests_properties(${name} PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77)
  endforeach()
endif()
