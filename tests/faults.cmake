# Fault injection against real processes on loopback (issue 8): kill -9 of trainers (mid-step,
# mid-checkpoint), of the server and of precompute, a full disk in a checkpoint, a frozen
# trainer, a flood of sessions and a corrupt shard, each judged by the ledger of trained
# batches against an uninterrupted run. `test_faults N` repeats the kills N times by hand.
if(TARGET dt)
  add_unit_test(test_faults test_faults.c LIBS dt TIMEOUT 300)
  add_dependencies(test_faults drafter-trainer target-server)
endif()
# Capture guards at the trainer: a fake server's NaN, Inf, all-zero and wrong-layer answers
# and another target id, and batch files holding NaN or Inf, are refused and never trained on.
if(TARGET dt)
  add_unit_test(test_dt_guards test_dt_guards.c LIBS dt TIMEOUT 120)
  add_dependencies(test_dt_guards drafter-trainer target-server)
  # the bad answers: label slow while the trainer that gives up on them sometimes ends with a
  # LeakSanitizer report of a libzmq decoder buffer (18160 bytes) under -DTANDEM_SANITIZE=ON
  add_test(NAME test_dt_guards_answers COMMAND test_dt_guards answers)
  set_tests_properties(test_dt_guards_answers PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77 LABELS slow)
endif()
# No secret in any log: a CURVE server, trainer and precompute at log level debug, a refused
# stranger and status through CURVE; every log and output file searched for both secret keys.
if(TARGET dt)
  add_unit_test(test_dt_secrets test_dt_secrets.c LIBS dt TIMEOUT 120)
  add_dependencies(test_dt_secrets drafter-trainer target-server)
endif()
# The CPU end-to-end run (serve, live training, precompute, training from shards, a resume)
# with every process under valgrind --leak-check=full (about 75 s; needs valgrind).
if(TARGET dt)
  add_test(NAME test_faults_valgrind COMMAND test_faults valgrind)
  set_tests_properties(test_faults_valgrind PROPERTIES TIMEOUT 900 SKIP_RETURN_CODE 77 LABELS slow)
endif()
# A target is its weights: a copy of the tiny target with one bit flipped, served under the
# original's name, is refused by a live run at reconnect, by a fresh run, and from shards.
if(TARGET dt)
  add_unit_test(test_identity test_identity.c LIBS dt TIMEOUT 180)
  add_dependencies(test_identity drafter-trainer target-server)
endif()
