# FP8 block-scaled GEMMs (kn_backend.h, "FP8 block-scaled GEMMs"): the cpu reference against
# the header's definitions computed another way, refusals and the CUDA support rule (unit); the
# CUDA kernels and cuBLASLt's block-scaled product against the cpu (label gpu; exits 77 without
# a cuda device or without sm_90).
add_unit_test(test_kn_fp8 test_kn_fp8.c LABELS unit LIBS kn ARGS cpu)
# the model of an FP8 tensor core's accumulation that the reference can run for diagnosis
# (TANDEM_FP8_REF_TC, kernels/ref/kn_fp8_tc_ref.c): parsing, hand-made groups, random groups, the product
add_unit_test(test_kn_fp8_tc test_kn_fp8_tc.c LABELS unit LIBS kn)
# the CUDA quantizers' quotient without a division per value (kn_fp8_quot.h), every bf16 case
# (optimised and uncontracted in every build: 6e8 quotients, each op rounded on its own)
add_unit_test(test_kn_fp8_quot test_kn_fp8_quot.c LABELS unit LIBS kn)
target_compile_options(test_kn_fp8_quot PRIVATE -O2 -ffp-contract=off)
if(TANDEM_HAVE_CUDA)
  add_test(NAME test_kn_fp8_cuda COMMAND test_kn_fp8 cuda)
  set_tests_properties(test_kn_fp8_cuda PROPERTIES LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 300)
endif()
# bench_kn_fp8: the 27B target's GEMM shapes in bf16 and block-scaled FP8 (not a test).
if(TANDEM_HAVE_CUDA)
  add_executable(bench_kn_fp8 bench_kn_fp8.c)
  target_compile_options(bench_kn_fp8 PRIVATE ${TANDEM_C_WARNINGS})
  target_link_libraries(bench_kn_fp8 PRIVATE kn cm m)
endif()
