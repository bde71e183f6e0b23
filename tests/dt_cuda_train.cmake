# drafter-trainer train --device cuda end to end (label gpu; exits 77 without a cuda device):
# cuda vs cpu losses (fp32 and bf16), exact resume on cuda, and with two GPUs the NCCL
# data-parallel run against one GPU over the same global batch.
if(TARGET dt AND TANDEM_HAVE_CUDA)
  add_unit_test(test_dt_cuda_train test_dt_cuda_train.c LABELS gpu LIBS dt TIMEOUT 400)
  add_dependencies(test_dt_cuda_train drafter-trainer target-server)
endif()
# bench_dt_step: one whole training step at a real drafter shape on cuda (not a test;
# bench/drafter_bench.sh runs it beside the PyTorch reference).
if(TARGET dt AND TANDEM_HAVE_CUDA)
  add_executable(bench_dt_step bench_dt_step.c)
  target_compile_options(bench_dt_step PRIVATE ${TANDEM_C_WARNINGS})
  target_link_libraries(bench_dt_step PRIVATE dt kn cm m)
endif()
# The step with taps already in backend memory (dt_batch.dev_taps) against host taps: on the
# cpu backend (unit) and on cuda (gpu).
if(TARGET dt)
  add_unit_test(test_dt_devtaps test_dt_devtaps.c LIBS dt ARGS cpu)
  if(TANDEM_HAVE_CUDA)
    add_test(NAME test_dt_devtaps_cuda COMMAND test_dt_devtaps cuda)
    set_tests_properties(test_dt_devtaps_cuda PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77 LABELS gpu)
  endif()
endif()
