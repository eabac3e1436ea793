# zinf checkpoints exported to DeepSpeed's ZeRO 1/2 and universal layouts
# (interop/deepspeed_export.h).
if(TARGET zinf_checkpoint)
  # ExportDeepSpeed on checkpoints saved on 1-3 ranks, both layouts, read back with TorchFile;
  # the user state's keys in the model file; every error (refused names and user keys too)
  # leaves nothing.
  zinf_add_mpi_test(deepspeed_export_test
                    SOURCES ${CMAKE_CURRENT_LIST_DIR}/deepspeed_export_test.cc
                    LIBS zinf::interop zinf::checkpoint zinf::h5 zinf::swapper zinf::partition
                         zinf::comm
                    NP 1 2 3 TIMEOUT 120)
  target_include_directories(deepspeed_export_test PRIVATE ${CMAKE_SOURCE_DIR}/tests/checkpoint)

  # The two-group fp16 checkpoint zinf-train cannot make, for the script tests.
  add_executable(deepspeed_export_make_ckpt ${CMAKE_CURRENT_LIST_DIR}/deepspeed_export_make_ckpt.cc)
  target_link_libraries(deepspeed_export_make_ckpt PRIVATE zinf_build_flags zinf::checkpoint
                                                           zinf::swapper zinf::partition zinf::comm)
  target_include_directories(deepspeed_export_make_ckpt
                             PRIVATE ${CMAKE_SOURCE_DIR}/tests/checkpoint)
endif()

# zinf-ckpt export --format deepspeed on checkpoints of real zinf-train runs and of the
# generator (fp32 and q8), W = 1..4, stages 1 and 2, and --format deepspeed-universal for W = 1
# and 3 (deepspeed_export_test.sh):
#   interop_deepspeed_export_torch   torch.load + the documented structure + weights and moments
#                                    bitwise against --format safetensors --moments; the user
#                                    keys; CLI errors.
#                                    Skipped (77) without torch in /usr/bin/python3.
#   interop_deepspeed_export_tools   DeepSpeed's own zero_to_fp32 and ds_to_universal (whose
#                                    output must equal zinf's universal export file by file), from
#                                    $ZINF_DEEPSPEED_SRC or ../shared/bench/deepspeed's tarball;
#                                    skipped (77) without either.
if(TARGET zinf-train AND TARGET zinf-ckpt AND TARGET deepspeed_export_make_ckpt)
  foreach(mode torch tools)
    set(script_mode ${mode})
    if(mode STREQUAL "torch")
      set(script_mode structure)
    endif()
    add_test(NAME interop_deepspeed_export_${mode}
             COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/deepspeed_export_test.sh ${script_mode}
                     $<TARGET_FILE:zinf-train> $<TARGET_FILE:zinf-ckpt> ${MPIEXEC_EXECUTABLE}
                     $<TARGET_FILE:deepspeed_export_make_ckpt>)
    set_tests_properties(interop_deepspeed_export_${mode} PROPERTIES TIMEOUT 300
                         LABELS "e2e;mpi;python" PROCESSORS 2 SKIP_RETURN_CODE 77)
  endforeach()
endif()
