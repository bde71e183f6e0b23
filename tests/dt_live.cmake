# drafter-trainer train --server: live hidden states from a real target-server serve process
# over loopback (same losses as offline, a second trainer, kill -9 of the server, resume,
# refusals).
if(TARGET dt)
  add_unit_test(test_dt_live test_dt_live.c LIBS dt TIMEOUT 300)
  add_dependencies(test_dt_live drafter-trainer target-server)
endif()
