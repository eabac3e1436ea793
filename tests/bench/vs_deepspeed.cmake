# bench/run.py vs-deepspeed. The smoke run (64 MiB of I/O, a step of 8M elements, one round) needs
# DeepSpeed's ops built as ../shared/bench/deepspeed/README.md says (/tmp/ds/build, /tmp/ds/src):
# where they are not (CI), the subcommand exits 2 with "not built" and the test is skipped
# (harness_args_test.py checks that refusal on every machine).
if(TARGET zinf-bench)
  add_test(NAME bench_vs_deepspeed_smoke
           COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/smoke.sh vs-deepspeed
                   --size 64M --elements 8M --sub-group 4M --rounds 1 --steps 1
                   --bin $<TARGET_FILE:zinf-bench>)
  set_tests_properties(bench_vs_deepspeed_smoke PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77)
endif()
