# DeepSpeed checkpoints read (interop/src/deepspeed_read.cc, built with zinf::checkpoint): the
# Python test writes DeepSpeed-layout directories from the documented structure (stage 1/2 with
# W = 1..4, padding, ranks entirely in padding, 2 groups, fp16 dynamic loss scaler, elastic and
# BF16_Optimizer files; stage 3 with W = 1..4; universal folders from stage 1/2 and 3, read
# directly and through `latest_universal`; client state) and checks `deepspeed_read_tool dump`
# bitwise; hostile directories (truncated, not a dict, os.system, missing/extra rank,
# partition_count, step != G - K, NaN, mp_rank_01, `latest`/`latest_universal` escaping, a
# symlinked file or param folder, missing/extra param folders, tensor-parallel universal keys)
# each give a clear error.
if(TARGET zinf_checkpoint)
  add_executable(deepspeed_read_tool ${CMAKE_CURRENT_LIST_DIR}/deepspeed_read_tool.cc)
  target_link_libraries(deepspeed_read_tool PRIVATE zinf_build_flags zinf::interop)
  add_test(NAME deepspeed_read_test
           COMMAND /usr/bin/python3 ${CMAKE_CURRENT_LIST_DIR}/deepspeed_read_test.py
                   $<TARGET_FILE:deepspeed_read_tool>)
  # Skipped (77) when /usr/bin/python3 cannot import torch.
  set_tests_properties(deepspeed_read_test PROPERTIES TIMEOUT 120 LABELS "unit;python"
                       SKIP_RETURN_CODE 77 ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
  add_dependencies(zinf_unit_tests deepspeed_read_tool)
endif()
