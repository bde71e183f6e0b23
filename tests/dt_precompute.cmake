# drafter-trainer precompute (a real target-server serve process over loopback, kill -9 and
# resume, bit-exact against dump) and training from the shards it writes.
if(TARGET dt)
  add_unit_test(test_dt_precompute test_dt_precompute.c LIBS dt TIMEOUT 300)
  add_dependencies(test_dt_precompute drafter-trainer target-server)
endif()
