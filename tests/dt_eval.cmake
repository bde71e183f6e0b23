# drafter-trainer eval without a target-server: prompts, EOS ids, figures, the JSON report, the
# decoding loop against an in-process verifier (a scripted drafter and a tiny dt_infer one), and the
# command's usage and input errors through the real binary.
if(TARGET dt)
  add_unit_test(test_dt_eval test_dt_eval.c LIBS dt TIMEOUT 120)
  add_dependencies(test_dt_eval drafter-trainer)
endif()
