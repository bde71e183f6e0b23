# The cuda GEMM plans (kernels/kn_cuda.h): planned == per call bit for bit, one plan per key
# (alignment, leading dimension), a full table still computes, accumulating calls right on
# the planning call, timed plans (label gpu; exits 77 without a cuda device), and
# bench_kn_gemm_plan, a standalone benchmark (not a test) at the 27B target's shapes.
if(TANDEM_HAVE_CUDA)
  add_unit_test(test_kn_gemm_plan test_kn_gemm_plan.c LABELS gpu LIBS kn TIMEOUT 300)
  add_executable(bench_kn_gemm_plan bench_kn_gemm_plan.c)
  target_compile_options(bench_kn_gemm_plan PRIVATE ${TANDEM_C_WARNINGS})
  target_link_libraries(bench_kn_gemm_plan PRIVATE kn cm m)
endif()
