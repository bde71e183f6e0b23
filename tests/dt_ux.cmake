# Run UX (issue 5): TensorBoard event files (cm), progress display, run config files and the
# --dry-run plan (dt). test_cm_tb_tensorboard has TensorBoard itself read a file test_cm_tb
# writes; it exits 77 (skipped) where the tensorboard Python package is not importable.
add_unit_test(test_cm_tb test_cm_tb.c LABELS unit)
find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_Interpreter_FOUND)
  add_test(NAME test_cm_tb_tensorboard
           COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/test_cm_tb_tensorboard.py
                   $<TARGET_FILE:test_cm_tb>)
  set_tests_properties(test_cm_tb_tensorboard PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77 LABELS unit)
endif()
# The dt modules here depend on libcm only, so their tests compile them directly and do not
# wait for (or break with) the rest of libdt.
foreach(m progress runcfg)
  if(EXISTS ${PROJECT_SOURCE_DIR}/drafter-trainer/cmd/dt_${m}.c)
    add_unit_test(test_dt_${m} "test_dt_${m}.c;${PROJECT_SOURCE_DIR}/drafter-trainer/cmd/dt_${m}.c" LABELS unit)
    target_include_directories(test_dt_${m} PRIVATE ${PROJECT_SOURCE_DIR}/drafter-trainer/cmd)
  endif()
endforeach()
# test_dt_runcfg also checks every flag of `drafter-trainer train --help` is a known key.
if(TARGET test_dt_runcfg AND TARGET drafter-trainer)
  add_dependencies(test_dt_runcfg drafter-trainer)
endif()
# test_dt_plan also counts the parameters dt_model allocates, so it links libdt.
if(TARGET dt)
  add_unit_test(test_dt_plan test_dt_plan.c LIBS dt LABELS unit)
endif()
# The wired command line: run config + override, progress lines, TensorBoard = metrics.jsonl, --dry-run.
if(TARGET dt)
  add_unit_test(test_dt_train_ux test_dt_train_ux.c LIBS dt TIMEOUT 300)
  add_dependencies(test_dt_train_ux drafter-trainer target-server)
endif()
