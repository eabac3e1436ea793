# bench/run.py's command lines: every count and size flag of every subcommand refused (exit 2,
# the flag named, nothing made) when missing, 0, negative, a word or past its bound; the
# subcommands' checks of flags together; sizes, medians, rotation and claimed directories.
add_test(NAME bench_harness_args_test
         COMMAND ${ZINF_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/harness_args_test.py
                 ${PROJECT_SOURCE_DIR})
set_tests_properties(bench_harness_args_test PROPERTIES TIMEOUT 120)
