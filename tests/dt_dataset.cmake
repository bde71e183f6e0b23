# Tokenized datasets: JSONL and binary forms, dataset convert|inspect, packing into a token
# budget, epoch orders and data-parallel shares, bad inputs, and train --dataset from shards
# and live against a real target-server serve (same losses, resume, dp-size refusal).
if(TARGET dt)
  add_unit_test(test_dt_dataset test_dt_dataset.c LIBS dt TIMEOUT 300)
  add_dependencies(test_dt_dataset drafter-trainer target-server)
endif()
