# target-server tests: the dump against the Transformers oracle (cpu: unit; cuda: gpu), and
# bad input through the real command line.
add_unit_test(test_ts_dump test_ts_dump.c LIBS kn ARGS cpu TIMEOUT 300)
add_dependencies(test_ts_dump target-server)
add_test(NAME test_ts_dump_cuda_bf16 COMMAND test_ts_dump cuda bf16)
add_test(NAME test_ts_dump_cuda_fp32 COMMAND test_ts_dump cuda fp32)
set_tests_properties(test_ts_dump_cuda_bf16 test_ts_dump_cuda_fp32 PROPERTIES
                     TIMEOUT 300 SKIP_RETURN_CODE 77 LABELS gpu)
# the FP8 copies of the fixtures (tests/fixtures/target_fp8, tests/oracle/make_fp8_fixtures.py)
add_test(NAME test_ts_dump_fp8 COMMAND test_ts_dump cpu fp8)
set_tests_properties(test_ts_dump_fp8 PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77 LABELS unit)
add_test(NAME test_ts_dump_cuda_fp8 COMMAND test_ts_dump cuda fp8)
set_tests_properties(test_ts_dump_cuda_fp8 PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77 LABELS gpu)
add_unit_test(test_ts_badinput test_ts_badinput.c LIBS kn TIMEOUT 300)
add_dependencies(test_ts_badinput target-server)
# FP8 checkpoints (docs/fp8.md): made from the fixtures in C; loading, dequantizing, quantizing
# on load, the default precision and every refusal through the real command line.
add_unit_test(test_ts_fp8_load test_ts_fp8_load.c LIBS ts kn TIMEOUT 300)
add_dependencies(test_ts_fp8_load target-server)
# MoE and Qwen3-Next checkpoints (docs/moe.md): every broken copy of an oracle fixture gets one
# message naming the tensor, through the real command line.
add_test(NAME test_ts_moe_load COMMAND python3 ${CMAKE_CURRENT_SOURCE_DIR}/test_ts_moe_load.py ${CMAKE_BINARY_DIR})
set_tests_properties(test_ts_moe_load PROPERTIES TIMEOUT 300 LABELS unit)
# a target split over pipeline stages (ts_split.h): bit-identical to one context (cpu: unit;
# cuda, two stages on GPU 0 and, with a second GPU, on both: gpu)
add_unit_test(test_ts_split test_ts_split.c LIBS ts kn ARGS cpu TIMEOUT 300)
if(TANDEM_HAVE_CUDA)
  add_test(NAME test_ts_split_cuda COMMAND test_ts_split cuda)
  set_tests_properties(test_ts_split_cuda PROPERTIES LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 300)
endif()
# the experts' GEMMs grouped (moe_gemm) against one GEMM per expert, through the real command line
add_test(NAME test_ts_moe_grouped COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/test_ts_moe_grouped.sh
         ${PROJECT_SOURCE_DIR} ${CMAKE_BINARY_DIR})
set_tests_properties(test_ts_moe_grouped PROPERTIES TIMEOUT 300 LABELS unit)
# a drafter trained live from a Qwen3.5-MoE target served by a real target-server (cpu): losses fall, the real
# tau rises, the decodes stay the target's own
add_test(NAME test_moe_live COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/test_moe_live.sh ${PROJECT_SOURCE_DIR}
         ${CMAKE_BINARY_DIR})
set_tests_properties(test_moe_live PROPERTIES TIMEOUT 900 LABELS unit)
