# Decoding on the target (ts_decode, ts_cache, the cached forward) on the embedded tiny target:
# exactness against the uncached forward, verification, sampling, refusals; cpu, and cuda (gpu).
add_unit_test(test_ts_decode test_ts_decode.c LIBS ts kn ARGS cpu TIMEOUT 300)
add_test(NAME test_ts_decode_cuda COMMAND test_ts_decode cuda)
set_tests_properties(test_ts_decode_cuda PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77 LABELS gpu)
