// Files saved by an earlier build of memsave (tests/data/archives, written by
// tests/archives/write_archives.cpp; SOURCE.md names the build) load into the current build: a user's saved
// training survives an upgrade.
#include <memsave/amp.h>
#include <memsave/memory.h>
#include <memsave/trainer.h>

#include "archives/scenario.h"
#include "saved_state.h"

#include <gtest/gtest.h>
#include <torch/serialize.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

namespace memsave {
namespace {

using archives::Params;
using memsave::testing::saved_bytes;

std::string archive_path(const std::string& name) {
  return std::string(MEMSAVE_ARCHIVES) + "/" + name + ".pt";
}

void expect_equal(const Params& actual, const Params& expected, const std::string& what);

/// `a` holds the state `b` holds, parameter by parameter.
void expect_same_state(torch::optim::Optimizer& a, torch::optim::Optimizer& b) {
  if (dynamic_cast<const optim::LowBitOptimizer*>(&a) != nullptr) {
    // Equal bytes when this build writes both: every tensor, step count and option.
    EXPECT_TRUE(saved_bytes(a) == saved_bytes(b));
  } else {
    expect_equal(testing::adam_moments(a), testing::adam_moments(b), "moment or step");
  }
}

void expect_equal(const Params& actual, const Params& expected, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i)
    EXPECT_TRUE(torch::equal(actual[i], expected[i])) << what << " " << i;
}

class Archives : public ::testing::TestWithParam<archives::Case> {};

TEST_P(Archives, AFileOfAnEarlierBuildLoadsIntoTheStateOfTheSameRunAndStepsOnAsIt) {
  // The optimizers' arithmetic is the same on every machine (one math for every instruction set), and so are
  // the run's values (scenario.h): this build's run of the same steps is the reference.
  install_meter();
  const archives::Case& c = GetParam();
  const Params run_params = archives::parameters();
  auto run = c.make(run_params);
  archives::train(*run, run_params, 1, archives::kSteps);
  // The earlier build's file, loaded into a new optimizer over the weights that run reached.
  Params params;
  for (const auto& p : run_params) params.push_back(p.detach().clone().requires_grad_());
  auto loaded = c.make(params);
  torch::serialize::InputArchive archive;
  archive.load_from(archive_path(c.name));
  loaded->load(archive);
  expect_same_state(*loaded, *run);
  archives::train(*run, run_params, archives::kSteps + 1, archives::kSteps + 2);
  archives::train(*loaded, params, archives::kSteps + 1, archives::kSteps + 2);
  expect_equal(params, run_params, "parameter");
}

INSTANTIATE_TEST_SUITE_P(Files, Archives, ::testing::ValuesIn(archives::cases()),
                         [](const ::testing::TestParamInfo<archives::Case>& info) {
                           return info.param.name;
                         });

class TrainerArchives : public ::testing::TestWithParam<archives::TrainerCase> {};

/// The model's parameters and buffers.
Params model_tensors(const torch::nn::Sequential& model) {
  auto out = model->parameters();
  for (const auto& b : model->buffers()) out.push_back(b);
  return out;
}

TEST_P(TrainerArchives, AFileOfAnEarlierBuildResumesAsItsPartsReadByHandDo) {
  // A Trainer's run goes through LibTorch's forward and backward, whose rounding may differ between machines
  // and versions: the reference is the file itself, its model read by LibTorch's Module::load, its optimizer
  // state by the optimizer's own load and its scaler's by GradScaler::serialize, in a Trainer built by hand.
  install_meter();
  const archives::TrainerCase& c = GetParam();
  auto model = archives::trainer_model();
  {
    torch::NoGradGuard no_grad;  // other weights and statistics, which the file replaces
    for (auto& t : model_tensors(model))
      if (t.is_floating_point()) t.normal_();
  }
  Trainer resumed(model, adamw(1e-2), c.recipe);
  resumed.load(archive_path(c.name));

  torch::serialize::InputArchive file, model_part, optimizer_part;
  file.load_from(archive_path(c.name));
  auto by_hand_model = archives::trainer_model();
  file.read("model", model_part);
  by_hand_model->load(model_part);
  expect_equal(model_tensors(model), model_tensors(by_hand_model), "model tensor");
  const Params by_hand_params = unique_parameters(by_hand_model->parameters());
  std::shared_ptr<torch::optim::Optimizer> by_hand_optimizer = adamw(1e-2)(by_hand_params, c.recipe);
  file.read("optimizer", optimizer_part);
  by_hand_optimizer->load(optimizer_part);
  expect_same_state(resumed.optimizer(), *by_hand_optimizer);
  Trainer by_hand(by_hand_model, by_hand_optimizer, c.recipe);
  ASSERT_EQ(resumed.scaler() != nullptr, by_hand.scaler() != nullptr);
  if (by_hand.scaler() != nullptr) {
    torch::serialize::InputArchive scaler_part;
    file.read("scaler", scaler_part);
    by_hand.scaler()->serialize(scaler_part);
    EXPECT_EQ(resumed.scaler()->get_scale(), by_hand.scaler()->get_scale());
    EXPECT_EQ(resumed.scaler()->growth_tracker(), by_hand.scaler()->growth_tracker());
    EXPECT_EQ(resumed.scaler()->growth_tracker(), archives::kSteps);
  }
  archives::train(resumed, archives::kSteps + 1, archives::kSteps + 2);
  archives::train(by_hand, archives::kSteps + 1, archives::kSteps + 2);
  expect_equal(model_tensors(model), model_tensors(by_hand_model), "model tensor");
}

INSTANTIATE_TEST_SUITE_P(Files, TrainerArchives, ::testing::ValuesIn(archives::trainer_cases()),
                         [](const ::testing::TestParamInfo<archives::TrainerCase>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace memsave
