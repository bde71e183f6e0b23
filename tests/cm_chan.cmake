# Hidden-state transport, part 2: ZeroMQ sessions (cm_chan: well-behaved peers in test_cm_chan,
# misbehaving ones in test_cm_chan_faults; cm_chan_server_call in a test of its own) and the
# decoding endpoint (cm_dec) over real loopback sockets (its refusals of a misbehaving server and
# CURVE in test_cm_dec_faults), the
# `target-server serve` process against a client (kill -9 and restart, SIGTERM), and
# bench_cm_chan, a standalone benchmark (not a test) whose figures go to bench/results/chan-<date>.md.
add_unit_test(test_cm_chan test_cm_chan.c LABELS unit TIMEOUT 180)
add_unit_test(test_cm_chan_faults test_cm_chan_faults.c LABELS unit TIMEOUT 180)
add_unit_test(test_cm_chan_call test_cm_chan_call.c LABELS unit TIMEOUT 120)
add_unit_test(test_cm_dec test_cm_dec.c LABELS unit TIMEOUT 120)
add_unit_test(test_cm_dec_faults test_cm_dec_faults.c LABELS unit TIMEOUT 120)
add_unit_test(test_ts_serve test_ts_serve.c LABELS unit TIMEOUT 240)
add_dependencies(test_ts_serve target-server)
add_test(NAME test_ts_serve_fp8 COMMAND test_ts_serve fp8)
set_tests_properties(test_ts_serve_fp8 PROPERTIES LABELS unit TIMEOUT 240)
# The benchmark: built with the tests, never run by ctest.
add_executable(bench_cm_chan bench_cm_chan.c)
target_compile_options(bench_cm_chan PRIVATE ${TANDEM_C_WARNINGS})
target_link_libraries(bench_cm_chan PRIVATE cm m)
