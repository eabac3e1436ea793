# torch files (interop/src/torch_file.cc): TorchWriter -> TorchFile::Read round trips, the
# tensor checks on hand-built trees, fp16/bf16 widening; and, with Debian's torch, files
# torch.save wrote read bitwise, files zinf wrote loaded by torch.load, DeepSpeed-like trees and
# hostile files (truncated, bad CRC, os.system, legacy format, short or missing storages).
zinf_add_unit_test(torch_file_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/torch_file_test.cc
                   LIBS zinf::interop TIMEOUT 60)

add_executable(torch_file_tool ${CMAKE_CURRENT_LIST_DIR}/torch_file_tool.cc)
target_link_libraries(torch_file_tool PRIVATE zinf_build_flags zinf::interop)
add_test(NAME torch_compat_test
         COMMAND /usr/bin/python3 ${CMAKE_CURRENT_LIST_DIR}/torch_compat_test.py
                 $<TARGET_FILE:torch_file_tool>)
# Skipped (77) when /usr/bin/python3 cannot import torch.
set_tests_properties(torch_compat_test PROPERTIES TIMEOUT 120 LABELS "unit;python"
                     SKIP_RETURN_CODE 77 ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
add_dependencies(zinf_unit_tests torch_file_tool)
