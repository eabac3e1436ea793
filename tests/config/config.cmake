# The config as zinf-train uses it (config/config.h, tools/train/train_config.{h,cc}): parsing, defaults, batch arithmetic, schedules,
# the corpus of bad configs (bad_configs/NN-name.json + NN-name.expect, also used end to end), and
# the collective same-config check.
zinf_add_unit_test(config_test SOURCES config_test.cc LIBS zinf_train TIMEOUT 60)
target_compile_definitions(config_test PRIVATE
    ZINF_BAD_CONFIG_DIR="${CMAKE_CURRENT_SOURCE_DIR}/bad_configs"
    ZINF_GOOD_CONFIG_DIR="${CMAKE_CURRENT_SOURCE_DIR}/good_configs")

zinf_add_mpi_test(config_mpi_test SOURCES config_mpi_test.cc LIBS zinf_train
                  NP 1 2 3 TIMEOUT 60)

# Every key of the DeepSpeed key table behaves as its kind says, docs/deepspeed-keys.md is the
# generated table, DeepSpeed's own configs (deepspeed_configs/) load or say what zinf does
# instead, and every config in configs/ loads.
zinf_add_unit_test(config_deepspeed_keys_test SOURCES deepspeed_keys_test.cc LIBS zinf::config
                   TIMEOUT 60)
target_compile_definitions(config_deepspeed_keys_test PRIVATE
    ZINF_DOCS_DIR="${PROJECT_SOURCE_DIR}/docs"
    ZINF_DEEPSPEED_CONFIG_DIR="${CMAKE_CURRENT_SOURCE_DIR}/deepspeed_configs"
    ZINF_CONFIGS_DIR="${PROJECT_SOURCE_DIR}/configs")
