# The cpu reference of the drafter training ops (backward passes, DFlash attention, fused LM
# head + CE, sumsq, AdamW) against finite differences and naive formulas (unit).
add_unit_test(test_kn_ref_bwd test_kn_ref_bwd.c LABELS unit LIBS kn)
# DFlash2's grouped dynamic causal convolution (cpu reference): a padded second implementation,
# the identity initialisation, finite differences, bad arguments (unit).
add_unit_test(test_kn_dynconv test_kn_dynconv.c LABELS unit LIBS kn)
# lm_ce_topk (cpu reference): a brute-force second implementation on odd shapes, planted ties,
# lm_ce's bits for ce, argmax and dh, bad K (unit).
add_unit_test(test_kn_lm_topk test_kn_lm_topk.c LABELS unit LIBS kn)
