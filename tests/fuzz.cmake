# Fuzzing (tests/fuzz, docs/architecture.md: every parser of outside bytes): one libFuzzer target per parser,
# fuzz_<target>.c defining LLVMFuzzerTestOneInput. In every build each target is also linked with
# fuzz/fuzz_replay.c into test_fuzz_<target>, which replays the seed corpus and the inputs that
# once crashed (fuzz/regress/<target>/) under gcc and ASan (label unit). With -DTANDEM_FUZZ=ON
# (clang) fuzz_<target> links libFuzzer and ctest -L fuzz runs each for TANDEM_FUZZ_SECONDS
# over a scratch corpus in the build folder seeded from fuzz/corpus/<target>/ (never written to).
set(TANDEM_FUZZ_TARGETS safetensors st_index cfg proto decode compress shard dataset runcfg)
set(TANDEM_FUZZ_SECONDS 15 CACHE STRING "seconds each fuzz target runs under ctest -L fuzz")
set(FUZZ_SRC ${CMAKE_CURRENT_SOURCE_DIR}/fuzz)
if(TANDEM_FUZZ)
  set(FUZZ_REPLAY_LABEL fuzz) # a fuzz build folder builds only the fuzz targets
else()
  set(FUZZ_REPLAY_LABEL unit)
endif()

# The dataset reader and the run-config loader live in drafter-trainer but need only libcm:
# compile them in, rather than build libdt (and the kernels) with the fuzzer's instrumentation.
function(fuzz_extra_sources exe t)
  if(t STREQUAL "dataset" OR t STREQUAL "runcfg")
    set(dir cmd)
    if(t STREQUAL "dataset")
      set(dir feed)
    endif()
    target_sources(${exe} PRIVATE ${PROJECT_SOURCE_DIR}/drafter-trainer/${dir}/dt_${t}.c)
    target_include_directories(${exe} PRIVATE ${PROJECT_SOURCE_DIR}/drafter-trainer/${dir})
  endif()
endfunction()

foreach(t ${TANDEM_FUZZ_TARGETS})
  set(replay ${FUZZ_SRC}/corpus/${t})
  if(EXISTS ${FUZZ_SRC}/regress/${t})
    list(APPEND replay ${FUZZ_SRC}/regress/${t})
  endif()
  add_unit_test(test_fuzz_${t} fuzz/fuzz_${t}.c LABELS ${FUZZ_REPLAY_LABEL} ARGS ${replay})
  target_sources(test_fuzz_${t} PRIVATE fuzz/fuzz_replay.c)
  target_include_directories(test_fuzz_${t} PRIVATE ${FUZZ_SRC})
  fuzz_extra_sources(test_fuzz_${t} ${t})
  if(TANDEM_FUZZ)
    add_executable(fuzz_${t} fuzz/fuzz_${t}.c)
    target_include_directories(fuzz_${t} PRIVATE ${FUZZ_SRC})
    fuzz_extra_sources(fuzz_${t} ${t})
    target_compile_options(fuzz_${t} PRIVATE ${TANDEM_C_WARNINGS})
    target_link_libraries(fuzz_${t} PRIVATE cm m)
    target_link_options(fuzz_${t} PRIVATE -fsanitize=fuzzer)
    set(work ${CMAKE_BINARY_DIR}/fuzz-work/${t})
    file(MAKE_DIRECTORY ${work}/corpus)
    set(dict)
    if(EXISTS ${FUZZ_SRC}/dict/${t}.dict)
      set(dict -dict=${FUZZ_SRC}/dict/${t}.dict)
    endif()
    add_test(NAME fuzz_${t}
             COMMAND fuzz_${t} -max_total_time=${TANDEM_FUZZ_SECONDS} -rss_limit_mb=2048 -timeout=10
                     -print_final_stats=1 -artifact_prefix=${work}/ ${dict} ${work}/corpus ${FUZZ_SRC}/corpus/${t})
    math(EXPR fuzz_timeout "${TANDEM_FUZZ_SECONDS} + 120")
    set_tests_properties(fuzz_${t} PROPERTIES LABELS fuzz TIMEOUT ${fuzz_timeout})
    list(APPEND FUZZ_EXECUTABLES fuzz_${t} test_fuzz_${t})
  endif()
endforeach()
if(TANDEM_FUZZ)
  add_custom_target(fuzz_all DEPENDS ${FUZZ_EXECUTABLES})
endif()

# The seed corpora are made from the fixtures by tests/fuzz/make_corpus.sh (not built by default).
add_executable(fuzz_make_corpus EXCLUDE_FROM_ALL fuzz/make_corpus.c)
target_include_directories(fuzz_make_corpus PRIVATE ${FUZZ_SRC})
target_compile_options(fuzz_make_corpus PRIVATE ${TANDEM_C_WARNINGS})
target_link_libraries(fuzz_make_corpus PRIVATE cm m)
fuzz_extra_sources(fuzz_make_corpus dataset)
fuzz_extra_sources(fuzz_make_corpus runcfg)
