# deploy/: the launcher run for real on the CPU with the tiny target (one server, one trainer,
# signals, failures, swap runs, the dry-run plan) and every example config under
# deploy/configs parsed by the real config code.
if(TARGET dt)
  add_unit_test(test_deploy_launch test_deploy_launch.c TIMEOUT 120)
  add_dependencies(test_deploy_launch drafter-trainer target-server)
endif()
if(TARGET dt)
  add_unit_test(test_deploy_configs test_deploy_configs.c TIMEOUT 60)
  add_dependencies(test_deploy_configs drafter-trainer)
endif()
# The systemd units' ExecStart lines, run as systemd would (a script: the units are shell).
if(TARGET dt)
  add_test(NAME test_deploy_units COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/test_deploy_units.sh
           ${PROJECT_SOURCE_DIR} ${CMAKE_BINARY_DIR})
  set_tests_properties(test_deploy_units PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77 LABELS unit)
endif()
# The Slurm job's per-task script without Slurm (the variables Slurm gives each task are set
# by the test): keys, loopback and CURVE servers, trainer ranks, requeue resume.
if(TARGET dt)
  add_test(NAME test_deploy_slurm COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/test_deploy_slurm.sh
           ${PROJECT_SOURCE_DIR} ${CMAKE_BINARY_DIR})
  set_tests_properties(test_deploy_slurm PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77 LABELS unit)
endif()
# The Slurm job itself: tandem.sbatch submitted with sbatch --wait to a private Slurm (munged,
# slurmctld and two slurmd on this host) that the script starts and stops; skips (77) when not
# root or the daemons are not installed (.ci/deps.sh installs them). About 30 s.
if(TARGET dt)
  add_test(NAME test_deploy_slurm_real COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/test_deploy_slurm_real.sh
           ${PROJECT_SOURCE_DIR} ${CMAKE_BINARY_DIR})
  set_tests_properties(test_deploy_slurm_real PROPERTIES TIMEOUT 420 SKIP_RETURN_CODE 77 LABELS unit)
endif()
