# Kernel tests: the cpu reference through the backend table (unit). GPU tests append here.
add_unit_test(test_kn_ref test_kn_ref.c LABELS unit LIBS kn)
# The cuda backend against the cpu reference, op by op (label gpu; exits 77 without a device).
if(TANDEM_HAVE_CUDA)
  add_unit_test(test_kn_cuda test_kn_cuda.c LABELS gpu LIBS kn TIMEOUT 300)
  add_unit_test(test_kn_cuda_seq test_kn_cuda_seq.c LABELS gpu LIBS kn TIMEOUT 300)
  add_unit_test(test_kn_gdn16 test_kn_gdn16.c LABELS gpu LIBS kn)
endif()
