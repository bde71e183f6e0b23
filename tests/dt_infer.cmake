# The drafter's own inference (dt_infer): drafts of tiny random DFlash and DFlash2 drafters against
# the training forward over the same context (cpu: unit; cuda: gpu).
if(TARGET dt)
  add_unit_test(test_dt_infer test_dt_infer.c LIBS dt TIMEOUT 300)
  add_test(NAME test_dt_infer_cuda COMMAND test_dt_infer cuda)
  set_tests_properties(test_dt_infer_cuda PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77 LABELS gpu)
endif()
