# Offline shard store (cm_shard): write, read back, resume after a partial record, unindexed
# data, a torn index and kill -9 of a real writer (the test re-runs itself as the writer);
# test_cm_shard_damage: corruption, repair, identity and placement checks, random damage.
# test_dt_shards runs the real `drafter-trainer shards inspect|export` on a store of real
# ANSWER frames.
add_unit_test(test_cm_shard test_cm_shard.c LABELS unit TIMEOUT 300)
add_unit_test(test_cm_shard_damage test_cm_shard_damage.c LABELS unit TIMEOUT 300)
if(TARGET dt)
  add_unit_test(test_dt_shards test_dt_shards.c LABELS unit TIMEOUT 300)
  add_dependencies(test_dt_shards drafter-trainer)
endif()
