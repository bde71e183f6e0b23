# The drafter's norms on typed storage (rmsnorm_typed, rmsnorm_bwd_typed, head_norm_rope and its
# backward): the cpu references against the chains they stand for (unit), cuda against them (gpu).
add_unit_test(test_kn_norm_typed test_kn_norm_typed.c LIBS kn ARGS cpu)
if(TANDEM_HAVE_CUDA)
  add_test(NAME test_kn_norm_typed_cuda COMMAND test_kn_norm_typed cuda)
  set_tests_properties(test_kn_norm_typed_cuda PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77 LABELS gpu)
endif()
