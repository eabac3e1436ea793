# bench/run.py adam-vs-torch on 1M elements (a 16 MiB triad): zinf-bench adam and torch.optim.Adam
# both run, results.jsonl holds their lines and the summary, adam-vs-torch.png is drawn. Skipped
# (exit 77) where /usr/bin/python3 cannot import torch. Bad flags: harness_args_test.py.
if(TARGET zinf-bench)
  add_test(NAME bench_adam_vs_torch_smoke
           COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/smoke.sh adam-vs-torch
                   --numel 1M --threads 2 --steps 2 --triad-mib 16
                   --bin $<TARGET_FILE:zinf-bench>)
  set_tests_properties(bench_adam_vs_torch_smoke PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77)
endif()
