# The trainer in process (tools/train/trainer.{h,cc}): config overrides, loss, bitwise resume,
# agreed errors. The binary end to end is in e2e.cmake.
zinf_add_mpi_test(launch_trainer_mpi_test SOURCES trainer_mpi_test.cc LIBS zinf_train
                  NP 1 2 3 TIMEOUT 120)
