# bench/run.py overlap on a tiny stack (2 x Linear(64, 64), batch 8, 1 timed step, 1 round) on 1,
# 2 and 3 ranks (3: with the stage2 mode too): every mode trains under mpirun with its state
# swapped, results.jsonl holds a line per mode and the summary with its machine, overlap.png is
# drawn. Without torch for /usr/bin/python3 the subcommand exits 2 and the test skips.
if(TARGET zinf_python)
  foreach(np 1 2 3)
    set(modes plain,overlap,speculative)
    if(np EQUAL 3)
      set(modes plain,overlap,speculative,stage2)
    endif()
    add_test(NAME bench_overlap_smoke_np${np}
             COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/smoke.sh overlap --np ${np} --layers 2
                     --width 64 --batch 8 --steps 1 --rounds 1 --modes ${modes})
    set_tests_properties(bench_overlap_smoke_np${np} PROPERTIES
                         TIMEOUT 120 SKIP_RETURN_CODE 77 PROCESSORS ${np}
                         ENVIRONMENT "PYTHONPATH=${ZINF_PYTHON_DIR};PYTHONDONTWRITEBYTECODE=1")
  endforeach()
endif()
