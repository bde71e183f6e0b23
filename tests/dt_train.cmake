# drafter-trainer training-loop tests: the generator (cm), anchors and the optimizer schedule
# (pure modules), then the checkpoint format and the end-to-end training run (need the dt library).
add_unit_test(test_cm_rng test_cm_rng.c LABELS unit)
# The pure modules compile straight into their tests until the dt library exists.
if(TARGET dt)
  add_unit_test(test_dt_anchor test_dt_anchor.c LIBS dt)
else()
  add_unit_test(test_dt_anchor "test_dt_anchor.c;${PROJECT_SOURCE_DIR}/drafter-trainer/model/dt_anchor.c")
  target_include_directories(test_dt_anchor PRIVATE ${PROJECT_SOURCE_DIR}/drafter-trainer/model)
endif()
if(TARGET dt)
  add_unit_test(test_dt_optim test_dt_optim.c LIBS dt)
else()
  add_unit_test(test_dt_optim "test_dt_optim.c;${PROJECT_SOURCE_DIR}/drafter-trainer/model/dt_optim.c" LIBS kn)
  target_include_directories(test_dt_optim PRIVATE ${PROJECT_SOURCE_DIR}/drafter-trainer/model)
endif()
if(TARGET dt)
  add_unit_test(test_dt_train test_dt_train.c LIBS dt TIMEOUT 300)
  add_dependencies(test_dt_train drafter-trainer target-server)
endif()
if(TARGET dt)
  add_unit_test(test_dt_ckpt test_dt_ckpt.c LIBS dt TIMEOUT 300)
  add_dependencies(test_dt_ckpt drafter-trainer target-server)
endif()
# Integrity of a resumed checkpoint (checksums.json: flipped bits, NaN, truncation, edited
# config, a checkpoint without checksums) and of the run directory (one trainer at a time, a
# rank per --out, what a failed save or trim left behind).
if(TARGET dt)
  add_unit_test(test_dt_ckpt_sum test_dt_ckpt_sum.c LIBS dt TIMEOUT 300)
  add_dependencies(test_dt_ckpt_sum drafter-trainer target-server)
  add_unit_test(test_dt_rundir test_dt_rundir.c LIBS dt TIMEOUT 300)
  add_dependencies(test_dt_rundir drafter-trainer target-server)
endif()
# train --eval-every: evaluations by speculative decoding during training, in process against a verifier
# (lossless, tau rising, the training bit-identical with and without them), the command's refusals, and
# end to end against a real target-server's decoding endpoint.
if(TARGET dt)
  add_unit_test(test_dt_train_eval test_dt_train_eval.c LIBS dt TIMEOUT 300)
  add_dependencies(test_dt_train_eval drafter-trainer target-server)
endif()
