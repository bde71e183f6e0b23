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
