# The ops of drafter training with BF16 saved activations (cast2d, matmul, the typed SwiGLU
# pair): the cpu reference against gemm/gemm_dx/gemm_dw/swiglu (unit), cuda against it (gpu).
add_unit_test(test_kn_mixed test_kn_mixed.c LIBS kn ARGS cpu)
if(TANDEM_HAVE_CUDA)
  add_test(NAME test_kn_mixed_cuda COMMAND test_kn_mixed cuda)
  set_tests_properties(test_kn_mixed_cuda PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77 LABELS gpu)
endif()
