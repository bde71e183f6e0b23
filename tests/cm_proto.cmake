# Hidden-state transport, part 1: the wire format (cm_proto, cm_hash; the DECODE message in a test
# of its own) and the tensor encodings (cm_compress), plus bench_cm_compress, a standalone benchmark (not a test) whose figures go
# to bench/results/compress-<date>.md.
add_unit_test(test_cm_proto test_cm_proto.c LABELS unit)
add_unit_test(test_cm_proto_decode test_cm_proto_decode.c LABELS unit)
add_unit_test(test_cm_compress test_cm_compress.c LABELS unit)
# The benchmark: built with the tests, never run by ctest.
add_executable(bench_cm_compress bench_cm_compress.c)
target_compile_options(bench_cm_compress PRIVATE ${TANDEM_C_WARNINGS})
target_link_libraries(bench_cm_compress PRIVATE cm m)
