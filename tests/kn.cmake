# Kernel tests: the cpu reference through the backend table (unit). GPU tests append here.
add_unit_test(test_kn_ref test_kn_ref.c LABELS unit LIBS kn)
