# fill_uniform (target-server --init random): cpu properties, and cuda bit-identical to cpu
# where a device is present (unit: the cuda part is skipped without one).
add_unit_test(test_kn_fill test_kn_fill.c LABELS unit LIBS kn)
# target-server dump --init random: determinism and sane scales on cpu (unit), cuda vs cpu on
# a 12-layer model of real head sizes (gpu).
add_unit_test(test_ts_random test_ts_random.c LIBS kn ARGS cpu TIMEOUT 300)
add_dependencies(test_ts_random target-server)
add_test(NAME test_ts_random_cuda_bf16 COMMAND test_ts_random cuda bf16)
add_test(NAME test_ts_random_cuda_fp32 COMMAND test_ts_random cuda fp32)
add_test(NAME test_ts_random_cuda_moe_fp8 COMMAND test_ts_random cuda moe-fp8)
set_tests_properties(test_ts_random_cuda_bf16 test_ts_random_cuda_fp32 test_ts_random_cuda_moe_fp8 PROPERTIES
                     TIMEOUT 300 SKIP_RETURN_CODE 77 LABELS gpu)
# bench_ts_target: the 27B-shaped forward on one GPU (not a test; bench/target_bench.sh runs it).
if(TANDEM_HAVE_CUDA)
  add_executable(bench_ts_target bench_ts_target.c)
  target_compile_options(bench_ts_target PRIVATE ${TANDEM_C_WARNINGS})
  target_link_libraries(bench_ts_target PRIVATE ts kn cm m)
endif()
