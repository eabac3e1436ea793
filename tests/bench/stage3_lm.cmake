# bench/run.py stage3-lm on a tiny transformer LM (d_model 160, 1 layer, 8 tokens, batch 6, 1
# timed step) on 1, 2 and 3 ranks: the side by side (offload, memory, io; 2 rounds on 1 rank, so
# that the modes also run rotated) and the bytes per parameter of one setting (stage 1 on 2
# ranks, stage 3 all on NVMe on 3) at 1 and 2 layers with its fit; results.jsonl holds their
# lines, the summaries with their machine, stage3-lm.png is drawn. Without torch for
# /usr/bin/python3 the subcommand exits 2 and the test skips.
if(TARGET zinf_python AND TARGET zinf-bench)
  set(tiny --d-model 160 --layers 1 --seq 8 --batch 6 --steps 1 --bin $<TARGET_FILE:zinf-bench>)
  set(parts_np1 --rounds 2 --no-table)
  set(parts_np2 --rounds 1 --settings s1-cpu)
  set(parts_np3 --no-side-by-side --settings s3-nvme-nvme)
  foreach(np 1 2 3)
    add_test(NAME bench_stage3_lm_smoke_np${np}
             COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/smoke.sh stage3-lm --np ${np} ${tiny}
                     ${parts_np${np}})
    set_tests_properties(bench_stage3_lm_smoke_np${np} PROPERTIES
                         TIMEOUT 120 SKIP_RETURN_CODE 77 PROCESSORS ${np}
                         ENVIRONMENT "PYTHONPATH=${ZINF_PYTHON_DIR};PYTHONDONTWRITEBYTECODE=1")
  endforeach()
endif()
