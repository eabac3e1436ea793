# The launch/*.sh scripts' (the demos') command-line checks (launch/lib/args.sh, issue 41): a flag without its
# value, a zero, negative or non-numeric count and sizes beyond bash's arithmetic exit 2 naming
# the flag, before anything is made or run.
add_test(NAME launch_scripts_args_test
         COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/scripts_args_test.sh ${PROJECT_SOURCE_DIR}/launch)
set_tests_properties(launch_scripts_args_test PROPERTIES TIMEOUT 120)
