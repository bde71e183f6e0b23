# DFlash2's candidate selector: the cpu reference against a plain forward and finite differences,
# bad arguments (unit).
add_unit_test(test_kn_selector test_kn_selector.c LABELS unit LIBS kn)
