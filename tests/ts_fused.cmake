# The fused bf16 forward of ts_model, forced on the cpu backend (TANDEM_TARGET_FUSED=1).
add_unit_test(test_ts_fused test_ts_fused.c LIBS ts kn TIMEOUT 120)
