# Mixture of experts (kn_backend.h, "mixture of experts"): the cpu reference against the header's
# definitions computed another way (a double softmax and a sort, exact ties, grouping by a sort of
# the pairs, plain gather and combine loops) and its refusals (unit); the CUDA kernels against the
# cpu on odd shapes (label gpu; exits 77 without a cuda device).
add_unit_test(test_kn_moe test_kn_moe.c LABELS unit LIBS kn ARGS cpu)
if(TANDEM_HAVE_CUDA)
  add_test(NAME test_kn_moe_cuda COMMAND test_kn_moe cuda)
  set_tests_properties(test_kn_moe_cuda PROPERTIES LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 300)
endif()
# moe_gemm, the experts' GEMMs in one call: the cpu reference and the CUDA kernel against a double
# computation of its definition, within the fp32 rounding bound of each output.
add_unit_test(test_kn_moe_gemm test_kn_moe_gemm.c LABELS unit LIBS kn ARGS cpu)
if(TANDEM_HAVE_CUDA)
  add_test(NAME test_kn_moe_gemm_cuda COMMAND test_kn_moe_gemm cuda)
  set_tests_properties(test_kn_moe_gemm_cuda PROPERTIES LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 300)
endif()
