# Serving compatibility: real `drafter-trainer train` checkpoints against what vLLM 0.33.0's and
# SGLang 0.5.23's DFlash/DFlash2 loaders read (tests/serving/loader_fields.json, with file:line
# sources in those packages). Standard-library Python only, so it runs wherever python3 exists.
find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_Interpreter_FOUND AND TARGET drafter-trainer)
  add_test(NAME test_serving_fields
           COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/test_serving_fields.py
                   $<TARGET_FILE:drafter-trainer>)
  set_tests_properties(test_serving_fields PROPERTIES TIMEOUT 120 LABELS unit)
endif()
