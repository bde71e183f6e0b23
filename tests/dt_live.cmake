# drafter-trainer train --server: live hidden states from a real target-server serve process
# over loopback (same losses as offline, a second trainer, kill -9 of the server, resume,
# refusals).
if(TARGET dt)
  add_unit_test(test_dt_live test_dt_live.c LIBS dt TIMEOUT 300)
  add_dependencies(test_dt_live drafter-trainer target-server)
endif()
# bench_dt_feed: the trainer's host work per live answer, before and after dt_live_get_taps
# (not a test; its figures go to bench/results/feed-<date>.md).
add_executable(bench_dt_feed bench_dt_feed.c)
target_compile_options(bench_dt_feed PRIVATE ${TANDEM_C_WARNINGS})
target_link_libraries(bench_dt_feed PRIVATE kn cm m)
