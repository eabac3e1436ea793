# DeepSpeed checkpoints imported as zinf checkpoints (interop/deepspeed_import.h, `zinf-ckpt
# import-deepspeed`):
#   interop_deepspeed_import_layouts    directories in DeepSpeed's layout written by
#                                       deepspeed_read_test.py's generators (ZeRO 1/2 with padding
#                                       and params split across ranks, fp16 dynamic scaler, elastic,
#                                       BF16_Optimizer; ZeRO 3) imported bitwise with their trainer
#                                       state; hostile inputs and refused outputs exit 1 leaving
#                                       nothing (deepspeed_import_test.py). 77 without torch.
#   interop_deepspeed_import_roundtrip  zinf-train / generator checkpoints on 1-4 ranks, fp32 and
#                                       q8 -> export --format deepspeed (W 1-4) -> import: weights
#                                       and moments bitwise, the trainer state kept.
#   interop_deepspeed_import_resume     zinf-train (fp16, skipped steps, WarmupLR) saved on 2
#                                       ranks, exported for 3, imported, resumed on 3: bitwise the
#                                       resume from the original.
#   interop_deepspeed_import_torch      zinf.torch resumes from an import as from the original.
#                                       77 without torch.
if(TARGET zinf-ckpt)
  add_test(NAME interop_deepspeed_import_layouts
           COMMAND /usr/bin/python3 ${CMAKE_CURRENT_LIST_DIR}/deepspeed_import_test.py
                   $<TARGET_FILE:zinf-ckpt>)
  set_tests_properties(interop_deepspeed_import_layouts PROPERTIES TIMEOUT 120
                       LABELS "unit;python" SKIP_RETURN_CODE 77
                       ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
  add_dependencies(zinf_unit_tests zinf-ckpt)
endif()
if(TARGET zinf-train AND TARGET zinf-ckpt AND TARGET deepspeed_export_make_ckpt)
  add_test(NAME interop_deepspeed_import_roundtrip
           COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/deepspeed_import_test.sh roundtrip
                   $<TARGET_FILE:zinf-train> $<TARGET_FILE:zinf-ckpt> ${MPIEXEC_EXECUTABLE}
                   $<TARGET_FILE:deepspeed_export_make_ckpt>)
  add_test(NAME interop_deepspeed_import_resume
           COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/deepspeed_import_test.sh resume
                   $<TARGET_FILE:zinf-train> $<TARGET_FILE:zinf-ckpt> ${MPIEXEC_EXECUTABLE})
  set_tests_properties(interop_deepspeed_import_roundtrip interop_deepspeed_import_resume
                       PROPERTIES TIMEOUT 300 LABELS "e2e;mpi" PROCESSORS 2)
endif()
if(TARGET zinf-ckpt AND ZINF_PYTHON_ENABLED)
  add_test(NAME interop_deepspeed_import_torch
           COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/deepspeed_import_test.sh torch
                   $<TARGET_FILE:zinf-ckpt> ${ZINF_PYTHON_EXECUTABLE})
  set_tests_properties(interop_deepspeed_import_torch PROPERTIES TIMEOUT 180
                       LABELS "e2e;python" SKIP_RETURN_CODE 77
                       ENVIRONMENT "PYTHONPATH=${ZINF_PYTHON_DIR};PYTHONDONTWRITEBYTECODE=1")
endif()
