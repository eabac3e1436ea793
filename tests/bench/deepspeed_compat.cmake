# bench/run.py deepspeed-compat at tiny sizes: zinf-train on 3 ranks (an odd count) makes an fp32
# and a q8 checkpoint of 10007 parameters in 5 tensors; each is exported to DeepSpeed's layout for
# W = 1..4, DeepSpeed's own zero_to_fp32 and ds_to_universal run on the exports (weights and
# moments bitwise), zinf-ckpt imports them back where it can; then two timed rounds on 1M
# parameters (export, import, plain copy; the page cache kept: dropping it is machine-wide).
# Any check that fails fails the test. DeepSpeed's source comes from the subcommand's default,
# ../shared/bench/deepspeed/deepspeed-src.tar.xz beside the repository: where it is not (a fresh
# clone) or /usr/bin/python3 has no torch, the subcommand exits 2 ("not found", "not installed")
# and smoke.sh reports the test skipped (77).
if(TARGET zinf-train AND TARGET zinf-ckpt)
  add_test(NAME bench_deepspeed_compat_smoke
           COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/smoke.sh deepspeed-compat
                   --np 3 --world-sizes 1,2,3,4 --states fp32,q8 --params 10007 --tensors 5
                   --size 1M --rounds 2 --no-drop-caches
                   --train $<TARGET_FILE:zinf-train> --ckpt $<TARGET_FILE:zinf-ckpt>)
  set_tests_properties(bench_deepspeed_compat_smoke PROPERTIES TIMEOUT 180 SKIP_RETURN_CODE 77
                       PROCESSORS 2)
endif()
