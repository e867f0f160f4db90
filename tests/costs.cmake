# The discovered tests that run longest, with their seconds, so that ctest starts them first: a clean checkout has
# no timings from an earlier run, and ctest would otherwise start them in the order they were discovered, the
# resnet18 estimate near the end, where it ran on alone while the other core idled.
#
# The seconds are one test's on one core, on a processor without native bf16 (emulated here with
# ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2), the machine where the order matters: there the bf16
# candidates of the rescue checklist cost ten times what they cost with AVX-512 bf16 (bench/RESULTS-ctest-order.md).
#
# Included twice: by ctest after the discovered tests are added (it sets their COST), and by
# check_costs.cmake, a test that fails when a name here no longer names a test (set_tests_properties of ctest
# ignores an unknown name, so a renamed test would quietly lose its place).
set(memsave_test_costs
    "Estimate/EstimateOfTheZoo.PredictsEveryCandidateOfTheChecklist/resnet18" 335
    "Estimate/EstimateOfTheZoo.PredictsEveryCandidateOfTheChecklist/gpt_tiny" 69
    "Estimate/EstimateOfTheZoo.PredictsEveryCandidateOfTheChecklist/mlp" 32
    "Rescue.RecommendsACandidateThatFitsABudgetHalfTheBaseline" 27
    "Estimate.PredictsAConvolutionStackWhoseWeightsOutweighItsActivations" 17
    "Estimate.PredictsTheFp16ChecklistWithItsGradScaler" 11)
set(memsave_cli_test_costs
    "Cli.RescueWithAWideTieRecommendsTheFirstRecipeThatFits" 54
    "Cli.RescueRecommendsARecipeUnderTheBudget" 53
    "Cli.RescueTableEndsWithThePasteableRecipe" 13
    "Cli.RescueAndEstimateTakeTheMixedPrecisionDtype" 13)

# MEMSAVE_TEST_COSTS=off in ctest's environment leaves them in discovery order (bench/run_ctest_order.sh).
if(NOT MEMSAVE_CHECK_COSTS AND NOT "$ENV{MEMSAVE_TEST_COSTS}" STREQUAL "off")
  set(pairs ${memsave_test_costs} ${memsave_cli_test_costs})
  while(pairs)
    list(POP_FRONT pairs name seconds)
    set_tests_properties("${name}" PROPERTIES COST ${seconds})
  endwhile()
endif()
