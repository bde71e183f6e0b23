# fill_uniform (target-server --init random): cpu properties, and cuda bit-identical to cpu
# where a device is present (unit: the cuda part is skipped without one).
add_unit_test(test_kn_fill test_kn_fill.c LABELS unit LIBS kn)
