# The attention's fused q/k prep (qk_prep) on the cpu against the chain it replaces (unit).
add_unit_test(test_kn_qk_prep test_kn_qk_prep.c LABELS unit LIBS kn)
