# Incremental decoding (kn_backend.h, "incremental decoding"): the cpu reference fed in pieces
# against the uncached ops, uncommitted steps and commits, refusals (unit); the CUDA kernels
# (kn_cache.cu) against the cpu reference on odd and 27B-like shapes, bad device tables and
# refusals (label gpu; exits 77 without a cuda device).
add_unit_test(test_kn_cache test_kn_cache.c LABELS unit LIBS kn)
if(TANDEM_HAVE_CUDA)
  add_unit_test(test_kn_cuda_cache test_kn_cuda_cache.c LABELS gpu LIBS kn TIMEOUT 300)
endif()
