# common/ (libcm) unit tests: dtype conversions, safetensors reader/writer, config parsing (and quantization_config, and the MoE fields), locks, the worker pool.
add_unit_test(test_cm_dtype       test_cm_dtype.c       LABELS unit)
add_unit_test(test_cm_safetensors test_cm_safetensors.c LABELS unit)
add_unit_test(test_cm_cfg         test_cm_cfg.c         LABELS unit)
add_unit_test(test_cm_cfg_moe     test_cm_cfg_moe.c     LABELS unit)
add_unit_test(test_cm_quant       test_cm_quant.c       LABELS unit)
add_unit_test(test_cm_weights_id  test_cm_weights_id.c  LABELS unit)
add_unit_test(test_cm_lock        test_cm_lock.c        LABELS unit)
add_unit_test(test_cm_args        test_cm_args.c        LABELS unit)
add_unit_test(test_cm_pool        test_cm_pool.c        LABELS unit)
# The floor check (scripts/check_floors.py) on the tree and on copies with planted upward includes.
add_test(NAME test_check_floors COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/test_check_floors.sh ${PROJECT_SOURCE_DIR})
set_tests_properties(test_check_floors PROPERTIES TIMEOUT 60 LABELS unit)
