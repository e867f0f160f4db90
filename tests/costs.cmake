# The discovered tests that run longest, with their seconds, so that ctest starts them first: a clean checkout has
# no timings from an earlier run, and ctest would otherwise start them in the order they were discovered, the
# resnet18 estimate near the end, where it ran on alone while the other core idled.
#
# The seconds are one test's, run two at a time as scripts/test.sh runs them, on a processor without AVX-512
# (AMD EPYC, AVX2 only, 2 cores; 2026-12-08), the kind of machine where the order matters: there the bf16
# candidates of the rescue checklist cost ten times what they cost with AVX-512 bf16
# (bench/RESULTS-ctest-order.md). A test of 60 s or more there is also labelled `long`: CI's second run of the
# suite, on the GPU machine's LibTorch (scripts/check-torch-compat.sh --run), leaves those out.
set(memsave_test_costs
    "Estimate/EstimateOfTheZoo.PredictsEveryCandidateOfTheChecklist/resnet18" 878
    "Estimate/EstimateOfTheZoo.PredictsEveryCandidateOfTheChecklist/gpt_tiny" 194
    "Rescue.RecommendsACandidateThatFitsABudgetHalfTheBaseline" 66
    "Estimate/EstimateOfTheZoo.PredictsEveryCandidateOfTheChecklist/mlp" 63
    "Estimate.PredictsAConvolutionStackWhoseWeightsOutweighItsActivations" 41
    "Estimate.PredictsTheFp16ChecklistWithItsGradScaler" 24)
set(memsave_cli_test_costs
    "Cli.RescueWithAWideTieRecommendsTheFirstRecipeThatFits" 129
    "Cli.RescueRecommendsARecipeUnderTheBudget" 125
    "Cli.RescueAndEstimateTakeTheMixedPrecisionDtype" 27
    "Cli.RescueTableEndsWithThePasteableRecipe" 18)

# MEMSAVE_TEST_COSTS=off in ctest's environment leaves them in discovery order (bench/run_ctest_order.sh); the
# labels stay.
if(NOT MEMSAVE_CHECK_COSTS)
  set(pairs ${memsave_test_costs} ${memsave_cli_test_costs})
  while(pairs)
    list(POP_FRONT pairs name seconds)
    if(NOT "$ENV{MEMSAVE_TEST_COSTS}" STREQUAL "off")
      set_tests_properties("${name}" PROPERTIES COST ${seconds})
    endif()
    if(seconds GREATER_EQUAL 60)
      set_tests_properties("${name}" PROPERTIES LABELS long)
    endif()
  endwhile()
endif()
