# drafter-trainer grad: the drafter step against the float64 PyTorch oracle fixtures
# (tests/fixtures/drafter; cpu: unit, cuda: gpu) and bad input through the real command line.
if(TARGET dt)
  add_unit_test(test_dt_grad test_dt_grad.c LIBS dt ARGS cpu TIMEOUT 600)
  add_dependencies(test_dt_grad drafter-trainer)
  add_test(NAME test_dt_grad_cuda COMMAND test_dt_grad cuda)
  set_tests_properties(test_dt_grad_cuda PROPERTIES TIMEOUT 600 SKIP_RETURN_CODE 77 LABELS gpu)
  add_unit_test(test_dt_cuda_random test_dt_cuda_random.c LABELS gpu LIBS dt TIMEOUT 300)
  add_unit_test(test_dt_badinput test_dt_badinput.c LIBS kn TIMEOUT 300)
  add_dependencies(test_dt_badinput drafter-trainer)
endif()
# τ_chain: the decoder's chain walk (drafter-trainer/model/dt_tau_chain.h) on hand-made acceptances and
# against z-lab's decode loop, and grad's accepted / tau_chain outputs on the oracle fixtures.
if(TARGET dt)
  add_unit_test(test_dt_tau_chain test_dt_tau_chain.c LIBS dt TIMEOUT 300)
  add_dependencies(test_dt_tau_chain drafter-trainer)
endif()
