# Incremental decoding (kn_backend.h, "incremental decoding"): the cpu reference fed in pieces
# against the uncached ops, uncommitted steps and commits, refusals (unit).
add_unit_test(test_kn_cache test_kn_cache.c LABELS unit LIBS kn)
