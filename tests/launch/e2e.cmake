# End-to-end tests of zinf-train (tests/launch/e2e/*.sh): self-checking bash scripts that run the
# built binaries, under mpirun where they use several ranks (label `mpi`). Each takes
#   <script> ZINF_TRAIN ZINF_CKPT MPIEXEC
# and works in its own scratch directory under ZINF_TEST_TMPDIR (else TMPDIR, else /tmp).
#   loss_falls          the charlm loss falls over 50 steps on 2 ranks (a real drop)
#   resume_bitwise      checkpoint + resume on the same ranks: losses and weights bitwise equal
#   resume_other_ranks  a 2-rank checkpoint resumes on 3 ranks; the loss stays within tolerance
#   bad_configs         each bad_configs/NN-name.json (>= 30) exits 2 with its .expect; bad flags
#                       (1 rank, an MPI singleton), a few of them again on 2 ranks
#   fault_injection     ZINF_FAULT_INJECT on rank 1 fails all ranks alike in < 60 s; latest intact
#   killed_rank         SIGKILL of rank 1: mpirun ends; the next runs (other flags, another job id)
#                       reclaim the stale swap stores, nothing is left in the swap path (18-21 s)
#   full_disk           a 4 MiB tmpfs checkpoint directory on 1-3 ranks and a full metrics disk:
#                       every rank fails alike in < 60 s, latest intact (root; skips otherwise)
#   tiered_resume       the host memory tier and device "cpu" train bitwise as the swapped run;
#                       their checkpoints restore untiered, on 3 ranks, and back
#   deepspeed_fp16      a DeepSpeed config as it is (GPU hints, tensorboard, offload_param cpu)
#                       with fp16 from 2^24: one INFO line of ignored keys, overflowing steps
#                       skipped, the loss falls, a resume repeats the scales and losses
#   stage3_resume       stage 3 with offload_param nvme trains on 2 ranks (the loss falls); its
#                       checkpoint resumes at stage 2 on 3 ranks and the other way round, the
#                       first resumed loss equal to the uninterrupted run's (1e-5 relative)
#   larger_than_memory  stage 3, DeepSpeed's default sizes: a model 4.25x a memory cgroup's limit
#                       trains on 2 ranks inside it within its printed plan + 32 MiB per rank;
#                       a pinned pool above the limit is refused before allocation (root; 77
#                       skips otherwise; about 60 s)
# Seconds on the 2-core CI machine, one at a time: about 3-8, 10-13, 5-8, 62 and 35-42 (all five
# at once: 18, 22, 19, 63 and 29-45).
# The *_q8 variants run the same script with every run at --optimizer-state q8
# (ZINF_E2E_OPTIMIZER_STATE): loss, bitwise resume (weights and moments), resume on other ranks,
# injected faults.
if(TARGET zinf-train AND TARGET zinf-ckpt)
  foreach(spec "loss_falls 2 120" "resume_bitwise 2 120" "resume_other_ranks 3 150"
               "bad_configs 2 180" "fault_injection 3 180" "killed_rank 2 150"
               "full_disk 3 240" "deepspeed_fp16 2 240" "loss_falls 2 120 q8" "resume_bitwise 2 120 q8"
               "resume_other_ranks 3 150 q8" "fault_injection 3 180 q8"
               "tiered_resume 3 240" "tiered_resume 3 240 q8" "stage3_resume 3 180"
               "larger_than_memory 2 300")
    separate_arguments(spec UNIX_COMMAND "${spec}")
    list(GET spec 0 name)
    list(GET spec 1 ranks)
    list(GET spec 2 timeout)
    set(test_name launch_e2e_${name})
    set(state "")
    list(LENGTH spec fields)
    if(fields GREATER 3)
      list(GET spec 3 state)
      set(test_name launch_e2e_${name}_${state})
    endif()
    add_test(NAME ${test_name}
             COMMAND ${CMAKE_COMMAND} -E env ZINF_E2E_OPTIMIZER_STATE=${state}
                     bash ${CMAKE_CURRENT_LIST_DIR}/e2e/${name}.sh $<TARGET_FILE:zinf-train>
                     $<TARGET_FILE:zinf-ckpt> ${MPIEXEC_EXECUTABLE})
    set(labels "e2e")
    if(ranks GREATER 1)
      set(labels "e2e;mpi")
    endif()
    # COST: the long ones first in a fresh clone (no CTest history), not last.
    set_tests_properties(${test_name} PROPERTIES TIMEOUT ${timeout} LABELS "${labels}"
                         PROCESSORS ${ranks} SKIP_RETURN_CODE 77 COST ${timeout})
  endforeach()
endif()
