# The cuda drafter-training ops (backward passes, fused DFlash attention, chunked LM head +
# CE, sumsq, AdamW) against the cpu reference, forward and backward (label gpu; exits 77
# without a cuda device), and bench_kn_drafter, a standalone benchmark (not a test) of the
# attention and LM-head kernels at training sizes.
if(TANDEM_HAVE_CUDA)
  add_unit_test(test_kn_cuda_drafter test_kn_cuda_drafter.c LABELS gpu LIBS kn TIMEOUT 300)
  add_executable(bench_kn_drafter bench_kn_drafter.c)
  target_compile_options(bench_kn_drafter PRIVATE ${TANDEM_C_WARNINGS})
  target_link_libraries(bench_kn_drafter PRIVATE kn cm m)
endif()
# The DFlash attention on BF16 storage (io_dt) on the cpu and every cuda form: the bits of the F32 op
# on the widened inputs, K and V joint or separate (label gpu).
if(TANDEM_HAVE_CUDA)
  add_unit_test(test_kn_cuda_attn_io test_kn_cuda_attn_io.c LABELS gpu LIBS kn TIMEOUT 300)
endif()
# The CUDA grouped dynamic causal convolution of DFlash2 against the cpu reference (label gpu).
if(TANDEM_HAVE_CUDA)
  add_unit_test(test_kn_cuda_dynconv test_kn_cuda_dynconv.c LABELS gpu LIBS kn TIMEOUT 120)
endif()
# lm_ce_topk in CUDA against the cpu reference in both GEMM modes (several row tiles and
# vocabulary chunks, ties, the worst-case order), and the time of lm_ce vs lm_ce_topk at the
# training shape, printed (label gpu; exits 77 without a cuda device).
if(TANDEM_HAVE_CUDA)
  add_unit_test(test_kn_cuda_lm_topk test_kn_cuda_lm_topk.c LABELS gpu LIBS kn TIMEOUT 300)
endif()
