#include <memsave/accumulate.h>
#include <memsave/memory.h>
#include <memsave/optim.h>
#include <memsave/trainer.h>

#include "zoo/zoo.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <vector>

namespace memsave {
namespace {

namespace tnn = torch::nn;
namespace F = torch::nn::functional;

tnn::Sequential small_mlp() { return tnn::Sequential(tnn::Linear(6, 16), tnn::Tanh(), tnn::Linear(16, 4)); }

/// The largest |a - b| / max|b| over all gradients.
double relative_error(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double scale = b[i].abs().max().item<double>();
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>() / std::max(scale, 1e-30));
  }
  return worst;
}

std::vector<torch::Tensor> grads_of(tnn::Sequential& net) {
  std::vector<torch::Tensor> g;
  for (const auto& p : net->parameters()) g.push_back(p.grad().clone());
  return g;
}

/// An optimizer that records the gradients it is asked to step with and changes nothing.
class Recorder : public torch::optim::Optimizer {
 public:
  explicit Recorder(std::vector<torch::Tensor> params)
      : Optimizer({torch::optim::OptimizerParamGroup(std::move(params))},
                  std::make_unique<torch::optim::SGDOptions>(0.0)) {}
  torch::Tensor step(LossClosure = nullptr) override {
    ++steps;
    grads.clear();
    for (const auto& p : param_groups()[0].params()) grads.push_back(p.grad().clone());
    return {};
  }
  int steps = 0;
  std::vector<torch::Tensor> grads;
};

/// Reference: the gradient of the full batch's loss, mean over items.
std::vector<torch::Tensor> full_batch_grads(tnn::Sequential& net, const torch::Tensor& x,
                                            const torch::Tensor& y) {
  for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();
  F::cross_entropy(net->forward(x), y).backward();
  return grads_of(net);
}

TEST(Accumulate, EqualMicroBatchesGiveTheFullBatchGradient) {
  torch::manual_seed(0);
  auto net = small_mlp();
  const auto x = torch::randn({32, 6}), y = torch::randint(4, {32});
  const auto expected = full_batch_grads(net, x, y);
  Recorder rec(net->parameters());
  rec.zero_grad();
  GradientAccumulator acc(rec, AccumulateOptions().window(4));
  for (const auto& part : split_micro_batches({x, y}, 8)) {
    acc.backward(F::cross_entropy(net->forward(part[0]), part[1]), part[0].size(0));
  }
  ASSERT_EQ(rec.steps, 1);
  EXPECT_LE(relative_error(rec.grads, expected), 1e-5);
}

TEST(Accumulate, UnequalMicroBatchesAreWeightedByTheirItems) {
  torch::manual_seed(1);
  auto net = small_mlp();
  const auto x = torch::randn({23, 6}), y = torch::randint(4, {23});
  const auto expected = full_batch_grads(net, x, y);
  Recorder rec(net->parameters());
  rec.zero_grad();
  // 10 + 10 + 3 rows, without announcing the window: the first micro-batch's guess (10 × 3 = 30 items) is
  // corrected to 23 at the step.
  GradientAccumulator acc(rec, AccumulateOptions().window(3));
  for (const auto& part : split_micro_batches({x, y}, 10))
    acc.backward(F::cross_entropy(net->forward(part[0]), part[1]), part[0].size(0));
  ASSERT_EQ(rec.steps, 1);
  EXPECT_LE(relative_error(rec.grads, expected), 1e-5);

  // What "average the per-micro-batch means" gives is measurably different: the test can tell them apart.
  for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();
  for (const auto& part : split_micro_batches({x, y}, 10))
    (F::cross_entropy(net->forward(part[0]), part[1]) / 3).backward();
  EXPECT_GT(relative_error(grads_of(net), expected), 1e-3);
}

TEST(Accumulate, TokenWeightedLossesAreNormalizedByTheWindowsTokens) {
  // Sequences with different numbers of real tokens: the loss is the mean over real tokens of the window.
  torch::manual_seed(2);
  auto net = small_mlp();
  const int64_t rows = 12, time = 5;
  const auto x = torch::randn({rows, time, 6});
  auto y = torch::randint(4, {rows, time});
  const auto lengths = torch::tensor({5, 1, 2, 5, 3, 1, 4, 5, 2, 1, 1, 5});
  const auto mask = torch::arange(time).unsqueeze(0) < lengths.unsqueeze(1);
  y = torch::where(mask, y, torch::full_like(y, -100));  // padding is ignored by the loss
  auto token_loss = [](const torch::Tensor& out, const torch::Tensor& target) {
    return F::cross_entropy(out.reshape({-1, 4}), target.reshape({-1}),
                            F::CrossEntropyFuncOptions().ignore_index(-100));
  };
  for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();
  token_loss(net->forward(x), y).backward();
  const auto expected = grads_of(net);

  Recorder rec(net->parameters());
  rec.zero_grad();
  GradientAccumulator acc(rec, AccumulateOptions().window(3));
  for (const auto& part : split_micro_batches({x, y, mask}, 4))
    acc.backward(token_loss(net->forward(part[0]), part[1]), part[2].sum().item<double>());
  ASSERT_EQ(rec.steps, 1);
  EXPECT_LE(relative_error(rec.grads, expected), 1e-5);
}

TEST(Accumulate, TheShortLastWindowIsNormalizedByItsOwnItems) {
  torch::manual_seed(3);
  auto net = small_mlp();
  const auto x = torch::randn({24, 6}), y = torch::randint(4, {24});
  Recorder rec(net->parameters());
  rec.zero_grad();
  GradientAccumulator acc(rec, AccumulateOptions().window(4));
  const auto parts = split_micro_batches({x, y}, 4);  // 6 micro-batches: a window of 4, then one of 2
  std::vector<std::vector<torch::Tensor>> stepped;
  for (const auto& part : parts) {
    if (acc.backward(F::cross_entropy(net->forward(part[0]), part[1]), 4)) stepped.push_back(rec.grads);
  }
  EXPECT_EQ(acc.pending(), 2);
  const WindowStep last = acc.step();
  EXPECT_EQ(last.items, 8);
  EXPECT_EQ(last.micro_batches, 2);
  stepped.push_back(rec.grads);
  ASSERT_EQ(stepped.size(), 2u);
  EXPECT_LE(relative_error(stepped[0], full_batch_grads(net, x.narrow(0, 0, 16), y.narrow(0, 0, 16))), 1e-5);
  EXPECT_LE(relative_error(stepped[1], full_batch_grads(net, x.narrow(0, 16, 8), y.narrow(0, 16, 8))), 1e-5);
}

TEST(Accumulate, SumReducedLossesAndTheWindowLoss) {
  torch::manual_seed(4);
  auto net = small_mlp();
  const auto x = torch::randn({10, 6}), y = torch::randint(4, {10});
  const auto expected = full_batch_grads(net, x, y);
  const double expected_loss = F::cross_entropy(net->forward(x), y).item<double>();
  Recorder rec(net->parameters());
  rec.zero_grad();
  GradientAccumulator acc(rec, AccumulateOptions().window(2).reduction(LossReduction::kSum));
  std::optional<WindowStep> result;
  for (const auto& part : split_micro_batches({x, y}, 6)) {
    auto sum =
        F::cross_entropy(net->forward(part[0]), part[1], F::CrossEntropyFuncOptions().reduction(torch::kSum));
    result = acc.backward(sum, part[0].size(0));
  }
  ASSERT_TRUE(result.has_value());
  EXPECT_NEAR(result->loss, expected_loss, 1e-6);
  EXPECT_LE(relative_error(rec.grads, expected), 1e-5);
}

TEST(Accumulate, WithAGradScalerOneUnscalePerWindowAndASkippedWindowChangesNothing) {
  torch::manual_seed(5);
  auto net = small_mlp();
  const auto x = torch::randn({16, 6}), y = torch::randint(4, {16});
  optim::AdamW8bit opt(net->parameters(), optim::AdamW8bitOptions(1e-2).min_8bit_size(1));
  amp::GradScaler scaler(amp::GradScalerOptions().init_scale(1024));
  GradientAccumulator acc(opt, AccumulateOptions().window(4), &scaler);
  // A clean window steps once; the scale is the same for its 4 micro-batches (unscale_ twice would throw).
  for (const auto& part : split_micro_batches({x, y}, 4))
    acc.backward(F::cross_entropy(net->forward(part[0]), part[1]), 4);
  EXPECT_EQ(scaler.get_scale(), 1024);
  std::vector<torch::Tensor> params, state;
  for (const auto& p : net->parameters()) {
    params.push_back(p.detach().clone());
    for (const auto& s : opt.state_fp32(p)) state.push_back(s.clone());
  }
  // A window with an inf in its second micro-batch: skipped once, scale backed off once, nothing changed.
  std::optional<WindowStep> result;
  int i = 0;
  for (const auto& part : split_micro_batches({x, y}, 4)) {
    auto loss = F::cross_entropy(net->forward(part[0]), part[1]);
    if (i++ == 1) loss = loss * std::numeric_limits<float>::infinity();
    result = acc.backward(loss, 4);
  }
  ASSERT_TRUE(result.has_value());
  EXPECT_FALSE(result->stepped);
  EXPECT_EQ(scaler.get_scale(), 512);
  size_t k = 0, j = 0;
  for (const auto& p : net->parameters()) {
    EXPECT_TRUE(torch::equal(p, params[k++]));
    for (const auto& s : opt.state_fp32(p)) EXPECT_TRUE(torch::equal(s, state[j++]));
  }
}

TEST(AccumulateErrors, BadInputIsRejectedAndNothingSteps) {
  auto net = small_mlp();
  Recorder rec(net->parameters());
  EXPECT_THROW(GradientAccumulator(rec, AccumulateOptions().window(0)), c10::Error);
  EXPECT_THROW(split_micro_batches({torch::zeros({4, 2}), torch::zeros({3})}, 2), c10::Error);
  EXPECT_THROW(split_micro_batches({torch::zeros({4, 2})}, 0), c10::Error);
  EXPECT_THROW(split_micro_batches({torch::zeros({4, 2})}, 5), c10::Error);
  EXPECT_THROW(split_micro_batches({torch::zeros({0, 2})}, 1), c10::Error);
  GradientAccumulator acc(rec, AccumulateOptions().window(2));
  const auto out = net->forward(torch::randn({3, 6}));
  EXPECT_THROW(acc.backward(out.sum(1), 3), c10::Error);  // not a scalar
  EXPECT_THROW(acc.backward(out.sum(), 0), c10::Error);   // no items
  EXPECT_THROW(acc.step(), c10::Error);                   // nothing to step
  EXPECT_EQ(rec.steps, 0);
  for (const auto& p : net->parameters())
    EXPECT_FALSE(p.grad().defined() && p.grad().abs().sum().item<double>() > 0);
}

// ---- Trainer ----

zoo::Batch cnn_batch(int64_t rows) { return {torch::randn({rows, 1, 28, 28}), torch::randint(10, {rows})}; }

torch::Tensor ce(const torch::Tensor& out, const torch::Tensor& target) {
  return F::cross_entropy(out, target);
}

/// Trains the small CNN for `steps` steps on a fixed batch and returns the first and last loss.
std::pair<double, double> train(const Recipe& recipe, int steps = 8) {
  torch::manual_seed(0);
  auto net = zoo::fashion_cnn();
  Trainer trainer(net, adamw(2e-3, 0.0), recipe);
  const auto batch = cnn_batch(32);
  double first = 0, last = 0;
  for (int s = 0; s < steps; ++s) {
    const StepStats stats = trainer.step(batch.input, batch.target, ce);
    EXPECT_TRUE(stats.stepped);
    EXPECT_EQ(stats.items, 32);
    if (s == 0) first = stats.loss;
    last = stats.loss;
  }
  return {first, last};
}

TEST(Trainer, EveryPairOfTechniquesComposesAndTrains) {
  const std::vector<Recipe> singles = {Recipe().micro_batch(8), Recipe().amp(torch::kBFloat16),
                                       Recipe().checkpoint(Checkpointing::segments(3)),
                                       Recipe().state_bits(8), Recipe().max_grad_norm(1.0)};
  for (size_t i = 0; i < singles.size(); ++i) {
    for (size_t j = i + 1; j < singles.size(); ++j) {
      Recipe r = singles[i];
      const Recipe& o = singles[j];
      if (o.micro_batch()) r.micro_batch(o.micro_batch());
      if (o.amp()) r.amp(o.amp());
      if (o.checkpoint().kind != Checkpointing::Kind::kNone) r.checkpoint(o.checkpoint());
      if (o.state_bits() != 32) r.state_bits(o.state_bits());
      if (o.max_grad_norm() > 0) r.max_grad_norm(o.max_grad_norm());
      SCOPED_TRACE(r.label());
      const auto [first, last] = train(r);
      EXPECT_LT(last, first * 0.7);
    }
  }
}

TEST(Trainer, FourBitStateTrainsAndIsWhatTheFactoryBuilds) {
  const auto [first, last] = train(Recipe().state_bits(4));
  EXPECT_LT(last, first * 0.7);
  auto net = small_mlp();
  const auto opt = adamw()(net->parameters(), Recipe().state_bits(4));
  ASSERT_NE(dynamic_cast<optim::AdamW4bit*>(opt.get()), nullptr);
}

TEST(Trainer, AccumulationGivesTheFullBatchStep) {
  // Same model, same batch: micro-batches of 8 (with a short last one) take the same SGD step as the full
  // batch, up to float rounding.
  auto run = [](int64_t micro) {
    torch::manual_seed(0);
    auto net = zoo::fashion_cnn();
    Trainer trainer(net, sgd(0.1, 0.9), Recipe().micro_batch(micro));
    torch::manual_seed(1);
    const auto batch = cnn_batch(30);
    const auto stats = trainer.step(batch.input, batch.target, ce);
    EXPECT_EQ(stats.micro_batches, (30 + micro - 1) / micro);
    return net->parameters();
  };
  const auto full = run(30), micro = run(8);
  for (size_t i = 0; i < full.size(); ++i) EXPECT_TRUE(torch::allclose(full[i], micro[i], 1e-5, 1e-7)) << i;
}

TEST(Trainer, MicroBatchesLowerThePeak) {
  install_meter();
  auto peak = [](int64_t micro) {
    torch::manual_seed(0);
    auto net = zoo::fashion_cnn();
    Trainer trainer(net, adamw(), Recipe().micro_batch(micro));
    const auto batch = cnn_batch(64);
    trainer.step(batch.input, batch.target, ce);  // creates the state
    return trainer.step(batch.input, batch.target, ce).peak_bytes;
  };
  EXPECT_LT(peak(16), peak(64));
}

TEST(Trainer, MaskedItemsCountAndAllMaskedIsAnError) {
  torch::manual_seed(0);
  auto net = small_mlp();
  Trainer trainer(net, sgd(0.1), Recipe().micro_batch(2));
  const auto x = torch::randn({4, 6}), y = torch::randint(4, {4});
  const auto stats = trainer.step(x, y, ce, torch::tensor({1, 0, 1, 1}));
  EXPECT_EQ(stats.items, 3);
  const auto before = net->parameters()[0].clone();
  EXPECT_THROW(trainer.step(x, y, ce, torch::zeros({4})), c10::Error);
  EXPECT_TRUE(torch::equal(before, net->parameters()[0]));
}

TEST(TrainerErrors, ImpossibleRecipesAreRejectedAtConstruction) {
  auto net = small_mlp();
  EXPECT_THROW(Trainer(net, adamw(), Recipe().micro_batch(-1)), c10::Error);
  EXPECT_THROW(Trainer(net, adamw(), Recipe().amp(torch::kHalf)), c10::Error);  // fp16 autocast on the CPU
  EXPECT_THROW(Trainer(net, adamw(), Recipe().amp(torch::kFloat)), c10::Error);
  EXPECT_THROW(Trainer(net, adamw(), Recipe().state_bits(6)), c10::Error);
  EXPECT_THROW(Trainer(net, sgd(0.1), Recipe().state_bits(4)), c10::Error);  // 4-bit state: AdamW only
  EXPECT_THROW(Trainer(net, adamw(), Recipe().checkpoint(Checkpointing::segments(9))), c10::Error);
  auto plain = std::make_shared<torch::optim::AdamW>(net->parameters());
  EXPECT_THROW(Trainer(net, plain, Recipe().state_bits(8)), c10::Error);
  auto eight = std::make_shared<optim::AdamW8bit>(net->parameters());
  EXPECT_THROW(Trainer(net, eight, Recipe().state_bits(4)), c10::Error);
  auto four = std::make_shared<optim::AdamW4bit>(net->parameters());
  EXPECT_NO_THROW(Trainer(net, four, Recipe().state_bits(4)));
  EXPECT_THROW(Trainer(net, four, Recipe().state_bits(8)), c10::Error);
}

TEST(TrainerErrors, BadBatchesChangeNothing) {
  torch::manual_seed(0);
  auto net = small_mlp();
  Trainer trainer(net, adamw(), Recipe().micro_batch(4));
  const auto before = net->parameters()[0].clone();
  EXPECT_THROW(trainer.step(torch::randn({2, 6}), torch::randint(4, {2}), ce), c10::Error);  // micro > batch
  EXPECT_THROW(trainer.step(torch::randn({8, 6}), torch::randint(4, {7}), ce), c10::Error);  // rows differ
  EXPECT_THROW(trainer.step(torch::randn({0, 6}), torch::randint(4, {0}), ce), c10::Error);  // empty
  auto not_scalar = [](const torch::Tensor& out, const torch::Tensor&) { return out.sum(1); };
  EXPECT_THROW(trainer.step(torch::randn({8, 6}), torch::randint(4, {8}), not_scalar), c10::Error);
  EXPECT_TRUE(torch::equal(before, net->parameters()[0]));
  for (const auto& p : net->parameters())
    EXPECT_FALSE(p.grad().defined() && p.grad().abs().sum().item<double>() > 0);
}

TEST(TrainerErrors, AnOutOfMemoryMidStepLeavesTheModelAsItWas) {
  install_meter();
  torch::manual_seed(0);
  auto net = zoo::fashion_cnn();
  Trainer trainer(net, adamw(), Recipe().micro_batch(16));
  const auto batch = cnn_batch(64);
  trainer.step(batch.input, batch.target, ce);
  std::vector<torch::Tensor> before;
  for (const auto& p : net->parameters()) before.push_back(p.detach().clone());
  {
    ScopedBudget budget(torch::kCPU, memory_stats(torch::kCPU).current + 2'000'000);
    EXPECT_THROW(trainer.step(batch.input, batch.target, ce), c10::OutOfMemoryError);
  }
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(before[i], net->parameters()[i]));
  const auto stats = trainer.step(batch.input, batch.target, ce);  // and the next step works
  EXPECT_TRUE(stats.stepped);
}

TEST(Recipe, DescribesItselfAsCpp) {
  const Recipe r =
      Recipe().micro_batch(8).amp(torch::kBFloat16).checkpoint(Checkpointing::segments(4)).state_bits(8);
  EXPECT_EQ(
      r.to_cpp(),
      "memsave::Recipe().micro_batch(8).amp(torch::kBFloat16).checkpoint(memsave::Checkpointing::segments(4))"
      ".state_bits(8)");
  EXPECT_EQ(r.label(), "micro 8 + bf16 + ckpt 4 segments + 8-bit state");
  EXPECT_EQ(Recipe().label(), "baseline");
  EXPECT_FALSE(r.scales_gradients());
  EXPECT_TRUE(Recipe().amp(torch::kHalf).scales_gradients());
}

}  // namespace
}  // namespace memsave
