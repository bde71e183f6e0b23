# DFlash2's candidate selector: the cpu reference against a plain forward and finite differences,
# bad arguments (unit); the CUDA kernels against the cpu reference, ids outside [0, V), and a
# timing line at the training shape (label gpu; exits 77 without a cuda device).
add_unit_test(test_kn_selector test_kn_selector.c LABELS unit LIBS kn)
if(TANDEM_HAVE_CUDA)
  add_unit_test(test_kn_cuda_selector test_kn_cuda_selector.c LABELS gpu LIBS kn TIMEOUT 300)
endif()
