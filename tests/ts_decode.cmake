# Decoding on the target (ts_decode, ts_cache, the cached forward) on the embedded tiny target:
# exactness against the uncached forward, verification, sampling, refusals; cpu, and cuda (gpu).
add_unit_test(test_ts_decode test_ts_decode.c LIBS ts kn ARGS cpu TIMEOUT 600)
add_test(NAME test_ts_decode_fp8 COMMAND test_ts_decode cpu fp8)
set_tests_properties(test_ts_decode_fp8 PROPERTIES TIMEOUT 600 LABELS unit)
add_test(NAME test_ts_decode_cuda COMMAND test_ts_decode cuda)
set_tests_properties(test_ts_decode_cuda PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77 LABELS gpu)
# bench_ts_decode: decoding latency at real scale (not a test; bench/decode_bench.sh runs it).
add_executable(bench_ts_decode bench_ts_decode.c)
target_compile_options(bench_ts_decode PRIVATE ${TANDEM_C_WARNINGS})
target_link_libraries(bench_ts_decode PRIVATE ts kn cm m)
# target-server generate as a process: regenerated responses, kill and resume, refusals.
add_unit_test(test_ts_generate test_ts_generate.c TIMEOUT 600)
add_dependencies(test_ts_generate target-server)
# drafter-trainer eval against z-lab's decoder (tests/fixtures/decode), through a real target-server.
add_test(NAME test_decode_oracle COMMAND python3 ${CMAKE_CURRENT_SOURCE_DIR}/test_decode_oracle.py ${CMAKE_BINARY_DIR})
set_tests_properties(test_decode_oracle PROPERTIES TIMEOUT 300 LABELS unit)
# What goes wrong around decoding (prompts, capacity, identity, a vanished client): one message each.
add_test(NAME test_decode_badinput COMMAND python3 ${CMAKE_CURRENT_SOURCE_DIR}/test_decode_badinput.py ${CMAKE_BINARY_DIR})
set_tests_properties(test_decode_badinput PROPERTIES TIMEOUT 300 LABELS unit)
