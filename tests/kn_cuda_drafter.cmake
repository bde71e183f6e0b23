# The cuda drafter-training ops (backward passes, fused DFlash attention, chunked LM head +
# CE, sumsq, AdamW) against the cpu reference, forward and backward (label gpu; exits 77
# without a cuda device).
if(TANDEM_HAVE_CUDA)
  add_unit_test(test_kn_cuda_drafter test_kn_cuda_drafter.c LABELS gpu LIBS kn TIMEOUT 300)
endif()
