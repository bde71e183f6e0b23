# The NCCL data path (built only with CUDA and NCCL): the serve → trainer path across two GPUs
# (label gpu; skipped with fewer than two) and the GB/s benchmark between them.
if(TANDEM_HAVE_NCCL)
  add_unit_test(test_ts_nccl test_ts_nccl.c LABELS gpu LIBS cm_nccl TIMEOUT 400
                ARGS $<TARGET_FILE:target-server> ${CMAKE_SOURCE_DIR}/models/tiny-qwen35)
  add_dependencies(test_ts_nccl target-server)
  add_executable(bench_cm_nccl bench_cm_nccl.c)
  target_compile_options(bench_cm_nccl PRIVATE ${TANDEM_C_WARNINGS})
  target_link_libraries(bench_cm_nccl PRIVATE cm_nccl)
endif()
