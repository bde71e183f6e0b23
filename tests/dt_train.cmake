# drafter-trainer training-loop tests: the generator (cm), anchors and the optimizer schedule
# (pure modules), then the checkpoint format and the end-to-end training run (need the dt library).
add_unit_test(test_cm_rng test_cm_rng.c LABELS unit)
