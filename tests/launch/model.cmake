# Models and data of zinf-train: charlm (gradient check, training, sampling), synthetic, TextDataset.
zinf_add_unit_test(launch_model_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/model_test.cc LIBS zinf_train
                   TIMEOUT 120)
