# Tokenized datasets: JSONL and binary forms, dataset convert|inspect, packing into a token
# budget, epoch orders and data-parallel shares, bad inputs, and train --dataset from shards
# and live against a real target-server serve (same losses, resume, dp-size refusal).
if(TARGET dt)
  add_unit_test(test_dt_dataset test_dt_dataset.c LIBS dt TIMEOUT 300)
  add_dependencies(test_dt_dataset drafter-trainer target-server)
endif()
# tools/prepare_data.py with the offline tokenizer of tests/data/dataset/tokenizer; exits 77
# (skipped) where transformers, tokenizers, numpy or safetensors are not importable.
find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_Interpreter_FOUND AND TARGET drafter-trainer)
  add_test(NAME test_prepare_data
           COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/test_prepare_data.py
                   $<TARGET_FILE:drafter-trainer>)
  set_tests_properties(test_prepare_data PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77 LABELS unit)
endif()
# tools/regenerate.py against a stub OpenAI-compatible server on 127.0.0.1 (standard library only; the
# text path is checked too where transformers is importable); drafter-trainer must read its output.
if(Python3_Interpreter_FOUND AND TARGET drafter-trainer)
  add_test(NAME test_regenerate
           COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/test_regenerate.py
                   $<TARGET_FILE:drafter-trainer>)
  set_tests_properties(test_regenerate PROPERTIES TIMEOUT 120 LABELS unit)
endif()
