# zinf-train --check-config against the run on bad configs (issue 41): both exit 2 with the same
# one-line error, nothing written; a good config exits 0.
if(TARGET zinf-train)
  add_test(NAME launch_check_config_test
           COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/check_config_test.sh $<TARGET_FILE:zinf-train>
                   ${PROJECT_SOURCE_DIR}/tests/config/bad_configs)
  set_tests_properties(launch_check_config_test PROPERTIES TIMEOUT 180 LABELS "e2e")
endif()
