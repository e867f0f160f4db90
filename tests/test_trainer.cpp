#include <memsave/accumulate.h>
#include <memsave/memory.h>
#include <memsave/offload.h>
#include <memsave/optim.h>
#include <memsave/trainer.h>

#include "saved_state.h"
#include "zoo/zoo.h"

#include <ATen/MemoryOverlap.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace memsave {
namespace {

namespace tnn = torch::nn;
namespace F = torch::nn::functional;

torch::Tensor ce(const torch::Tensor& out, const torch::Tensor& target) {
  return F::cross_entropy(out, target);
}

/// Runs a Trainer step with `slack` bytes of budget above what is in use: whether it fitted (false: an
/// out-of-memory).
bool step_under_budget(Trainer& trainer, const torch::Tensor& x, const torch::Tensor& y, int64_t slack) {
  try {
    ScopedBudget budget(torch::kCPU, memory_stats(torch::kCPU).current + slack);
    trainer.step(x, y, ce);
    return true;
  } catch (const c10::OutOfMemoryError&) {
    return false;
  }
}

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

double global_norm(const std::vector<torch::Tensor>& grads) {
  double sum = 0;
  for (const auto& g : grads) sum += g.to(torch::kDouble).square().sum().item<double>();
  return std::sqrt(sum);
}

TEST(Accumulate, ClippingBoundsTheWindowsGradientAndReportsItsNormBefore) {
  torch::manual_seed(0);
  auto net = small_mlp();
  const auto x = torch::randn({32, 6}), y = torch::randint(4, {32});
  const auto expected = full_batch_grads(net, x, y);
  const double norm = global_norm(expected);
  for (const double max_norm : {norm / 2, norm * 2, 0.0}) {
    SCOPED_TRACE(max_norm);
    Recorder rec(net->parameters());
    rec.zero_grad();
    GradientAccumulator acc(rec, AccumulateOptions().window(4).max_grad_norm(max_norm));
    std::optional<WindowStep> window;
    for (const auto& part : split_micro_batches({x, y}, 8))
      window = acc.backward(F::cross_entropy(net->forward(part[0]), part[1]), 8);
    ASSERT_TRUE(window.has_value());
    EXPECT_NEAR(window->grad_norm, max_norm > 0 ? norm : 0.0, 1e-5 * norm);
    const double factor = max_norm > 0 && max_norm < norm ? max_norm / norm : 1.0;
    std::vector<torch::Tensor> scaled;
    for (const auto& g : expected) scaled.push_back(g * factor);
    EXPECT_LT(relative_error(rec.grads, scaled), 1e-5);
    if (max_norm > 0) {
      EXPECT_LE(global_norm(rec.grads), max_norm * (1 + 1e-5));
    }
  }
  // The Trainer reports it with the step.
  auto rec = std::make_shared<Recorder>(net->parameters());
  Trainer trainer(net, rec, Recipe().micro_batch(8).max_grad_norm(norm / 2));
  EXPECT_NEAR(trainer.step(x, y, ce).grad_norm, norm, 1e-5 * norm);
  EXPECT_LT(relative_error(rec->grads,
                           {expected[0] * 0.5, expected[1] * 0.5, expected[2] * 0.5, expected[3] * 0.5}),
            1e-5);
}

// A LibTorch optimizer over a module used twice lists its weights twice; the window's correction and clipping
// still touch each gradient once, and its norm counts it once.
TEST(Accumulate, AParameterListedTwiceIsCorrectedAndClippedOnce) {
  torch::manual_seed(0);
  tnn::Linear shared(6, 6);
  auto net = tnn::Sequential(shared, tnn::Tanh(), shared, tnn::Tanh(), tnn::Linear(6, 4));
  const auto x = torch::randn({12, 6}), y = torch::randint(4, {12});
  const auto unique = unique_parameters(net->parameters());
  for (auto& p : unique) p.mutable_grad() = torch::Tensor();
  F::cross_entropy(net->forward(x), y).backward();
  std::vector<torch::Tensor> expected;
  for (const auto& p : unique) expected.push_back(p.grad().clone());
  const double norm = global_norm(expected);

  Recorder rec(net->parameters());  // six tensors, two of them twice
  ASSERT_EQ(rec.param_groups()[0].params().size(), 6u);
  rec.zero_grad();
  GradientAccumulator acc(rec, AccumulateOptions().window(2).max_grad_norm(norm / 2));
  std::optional<WindowStep> window;
  // Micro-batches of 4 and 8 items in a window expecting 2 x 4: the window corrects by 8 / 12.
  for (const auto& part : {x.narrow(0, 0, 4), x.narrow(0, 4, 8)}) {
    const auto target = part.size(0) == 4 ? y.narrow(0, 0, 4) : y.narrow(0, 4, 8);
    window = acc.backward(F::cross_entropy(net->forward(part), target), part.size(0));
  }
  ASSERT_TRUE(window.has_value());
  EXPECT_NEAR(window->grad_norm, norm, 1e-5 * norm);
  const std::vector<torch::Tensor> halved = {expected[0] * 0.5, expected[1] * 0.5, expected[0] * 0.5,
                                             expected[1] * 0.5, expected[2] * 0.5, expected[3] * 0.5};
  EXPECT_LT(relative_error(rec.grads, halved), 1e-5);
}

TEST(Accumulate, AWindowStartsFromZeroGradients) {
  // Gradients left by a backward before the window (a plain loop's last step, an evaluation) are not the
  // window's: its step sees its own micro-batches' gradient alone, the first window as every later one.
  torch::manual_seed(0);
  auto net = small_mlp();
  const auto x = torch::randn({16, 6}), y = torch::randint(4, {16});
  const auto expected = full_batch_grads(net, x, y);
  net->forward(torch::randn({3, 6})).sum().backward();  // stale gradients
  Recorder rec(net->parameters());
  GradientAccumulator acc(rec, AccumulateOptions().window(2));
  for (int window = 0; window < 2; ++window) {
    for (const auto& part : split_micro_batches({x, y}, 8))
      acc.backward(F::cross_entropy(net->forward(part[0]), part[1]), 8);
    EXPECT_EQ(rec.steps, window + 1);
    EXPECT_LT(relative_error(rec.grads, expected), 1e-5) << "window " << window;
  }
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

TEST(Accumulate, ReducedPrecisionLossesAreNormalizedInFp32) {
  // An fp16 model's loss over a window of many tokens: the normalization in fp16 would report an inf loss
  // (loss x tokens > 65504) and bend the gradient (1 / tokens in fp16's subnormals: 5% off at 4M tokens).
  for (const auto dtype : {torch::kHalf, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    auto w = torch::ones({4}, torch::TensorOptions().dtype(dtype).requires_grad(true));
    Recorder rec({w});
    GradientAccumulator acc(rec, AccumulateOptions().window(2));
    const auto x = torch::tensor({1.0, 2.0, 3.0, 4.0}).to(dtype);
    acc.backward((w * x).mean(), 4e6);
    const std::optional<WindowStep> window = acc.backward((w * x).mean(), 4e6);
    ASSERT_TRUE(window.has_value());
    EXPECT_DOUBLE_EQ(window->loss, 2.5);  // both micro-batches' mean, exact in either dtype
    // d/dw of the window's mean loss: x / 4, exact in either dtype.
    EXPECT_TRUE(torch::equal(rec.grads[0], x / 4)) << rec.grads[0];
  }
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
  const auto sgd4 = sgd(0.1)(net->parameters(), Recipe().state_bits(4));
  ASSERT_NE(dynamic_cast<optim::SGD4bit*>(sgd4.get()), nullptr);
  EXPECT_EQ(static_cast<const optim::SGD4bitOptions&>(sgd4->param_groups()[0].options()).momentum(), 0.9);
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

// A module used twice (layers sharing weights): LibTorch's parameters() lists its weights twice, and a plain
// LibTorch loop over that list steps them twice per step and clips with their gradient counted twice. The
// Trainer steps and clips each weight once: a plain loop over the unique parameters, bit for bit.
TEST(Trainer, AModuleUsedTwiceIsSteppedOnce) {
  const double lr = 1e-2, weight_decay = 1e-2, max_norm = 0.05;
  torch::manual_seed(3);
  const auto x = torch::randn({16, 64}), y = torch::randint(64, {16});  // 64 x 64 weights: 8-bit state
  using Make = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;
  const std::vector<std::pair<Recipe, Make>> cases = {
      {Recipe(),
       [&](std::vector<torch::Tensor> p) {
         return std::make_unique<torch::optim::AdamW>(
             p, torch::optim::AdamWOptions(lr).weight_decay(weight_decay));
       }},
      {Recipe().state_bits(8),
       [&](std::vector<torch::Tensor> p) {
         return std::make_unique<optim::AdamW8bit>(p, optim::AdamW8bitOptions(lr).weight_decay(weight_decay));
       }},
      {Recipe().offload(Offload::kOptimizerState), [&](std::vector<torch::Tensor> p) {
         return std::make_unique<OffloadOptimizer>(p, OffloadOptimizerOptions(lr).weight_decay(weight_decay));
       }}};
  for (const auto& [recipe, make] : cases) {
    SCOPED_TRACE(recipe.label());
    auto model = [] {
      torch::manual_seed(0);
      tnn::Linear shared(64, 64);
      return tnn::Sequential(shared, tnn::Tanh(), shared, tnn::Tanh(), tnn::Linear(64, 64));
    };
    auto net = model(), reference = model();
    ASSERT_EQ(net->parameters().size(), 6u);  // the shared layer's two tensors, twice
    std::vector<torch::Tensor> unique = unique_parameters(reference->parameters());
    ASSERT_EQ(unique.size(), 4u);
    auto opt = make(unique);

    Trainer trainer(net, adamw(lr, weight_decay), Recipe(recipe).max_grad_norm(max_norm));
    for (int step = 0; step < 3; ++step) {
      const double norm = trainer.step(x, y, ce).grad_norm;
      opt->zero_grad();
      ce(reference->forward(x), y).backward();
      const double expected = torch::nn::utils::clip_grad_norm_(unique, max_norm);
      EXPECT_DOUBLE_EQ(norm, expected) << step;
      opt->step();
    }
    const auto got = unique_parameters(net->parameters());
    for (size_t i = 0; i < unique.size(); ++i) EXPECT_TRUE(torch::equal(got[i], unique[i])) << i;
  }
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

TEST(Trainer, EachMicroBatchWeighsItsMasksItems) {
  // Rows 1..4 do not count (their targets are ignored by the loss): the micro-batches of 2 hold 1, 0 and 2
  // items; the one without any is skipped, and the step is the full batch's mean over its 3 items.
  torch::manual_seed(0);
  auto net = small_mlp();
  const auto x = torch::randn({6, 6});
  const auto mask = torch::tensor({1, 0, 0, 0, 1, 1});
  const auto y = torch::where(mask > 0, torch::randint(4, {6}), torch::full({6}, -100, torch::kLong));
  auto loss = [](const torch::Tensor& out, const torch::Tensor& target) {
    return F::cross_entropy(out, target, F::CrossEntropyFuncOptions().ignore_index(-100));
  };
  for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();
  loss(net->forward(x), y).backward();
  const auto expected = grads_of(net);  // (which stay in the parameters: the step must not add to them)
  auto rec = std::make_shared<Recorder>(net->parameters());
  Trainer trainer(net, rec, Recipe().micro_batch(2));
  const StepStats stats = trainer.step(x, y, loss, mask);
  EXPECT_EQ(stats.items, 3);
  EXPECT_EQ(stats.micro_batches, 2);
  EXPECT_LT(relative_error(rec->grads, expected), 1e-5);
}

TEST(Trainer, PredictRunsInEvalModeAndPutsEveryModeBack) {
  torch::manual_seed(0);
  auto net = tnn::Sequential(tnn::Linear(6, 16), tnn::Dropout(0.5), tnn::Tanh(), tnn::Linear(16, 4));
  Trainer trainer(net, adamw(1e-3), Recipe().checkpoint(Checkpointing::every_layer()));
  const auto x = torch::randn({8, 6});
  auto modes = [&] {
    std::vector<bool> on;
    for (const auto& m : trainer.model()->modules()) on.push_back(m->is_training());
    return on;
  };
  // Dropout off, no graph: the eval-mode forward of the model as given.
  net->eval();
  const auto expected = net->forward(x);
  // Modes as a user may have set them: the model in train mode but for its dropout.
  trainer.model()->train();
  net[1]->eval();
  const auto before = modes();
  const auto out = trainer.predict(x);
  EXPECT_TRUE(torch::equal(out, expected));
  EXPECT_FALSE(out.requires_grad());
  EXPECT_EQ(modes(), before);
  // Also when the forward throws (an input of the wrong width).
  EXPECT_THROW(trainer.predict(torch::randn({8, 5})), c10::Error);
  EXPECT_EQ(modes(), before);
  trainer.model()->eval();
  trainer.predict(x);
  EXPECT_EQ(modes(), std::vector<bool>(before.size(), false));
}

TEST(Trainer, StepKeepsAFrozenBatchNormFrozenAndTrainsAModelLeftInEvalMode) {
  // Fine-tuning with a frozen BatchNorm: in eval mode it normalizes with its running statistics and must not
  // update them. The reference is LibTorch's AdamW on a twin in the same modes.
  const auto make = [] {
    torch::manual_seed(0);
    return tnn::Sequential(tnn::Linear(6, 16), tnn::BatchNorm1d(16), tnn::Tanh(), tnn::Linear(16, 4));
  };
  torch::manual_seed(1);
  const auto x = torch::randn({8, 6});
  const auto y = torch::randint(4, {8});
  for (const Recipe& recipe : {Recipe(), Recipe().checkpoint(Checkpointing::every_layer())}) {
    SCOPED_TRACE(recipe.label());
    auto net = make();
    auto twin = make();
    net[1]->eval();
    twin[1]->eval();
    const auto statistics = net[1]->buffers()[0].clone();
    Trainer trainer(net, adamw(1e-3), recipe);
    trainer.step(x, y, ce);
    torch::optim::AdamW reference(twin->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(1e-2));
    ce(twin->forward(x), y).backward();
    reference.step();
    EXPECT_FALSE(net[1]->is_training());
    EXPECT_TRUE(net->is_training() && net[0]->is_training());
    EXPECT_TRUE(torch::equal(net[1]->buffers()[0], statistics));
    for (size_t i = 0; i < twin->parameters().size(); ++i)
      EXPECT_TRUE(torch::allclose(net->parameters()[i], twin->parameters()[i], 1e-6, 1e-7))
          << "parameter " << i;
    // A model evaluated by hand and left in eval mode trains in train mode, all of it.
    net->eval();
    trainer.step(x, y, ce);
    for (const auto& m : net->modules()) EXPECT_TRUE(m->is_training());
    EXPECT_FALSE(torch::equal(net[1]->buffers()[0], statistics));
  }
}

TEST(TrainerErrors, ImpossibleRecipesAreRejectedAtConstruction) {
  auto net = small_mlp();
  EXPECT_THROW(Trainer(net, adamw(), Recipe().micro_batch(-1)), c10::Error);
  EXPECT_THROW(Trainer(net, adamw(), Recipe().amp(torch::kFloat)), c10::Error);
  EXPECT_THROW(Trainer(net, adamw(), Recipe().state_bits(6)), c10::Error);
  // offloaded state: AdamW only
  EXPECT_THROW(Trainer(net, sgd(0.1), Recipe().offload(Offload::kOptimizerState)), c10::Error);
  EXPECT_THROW(Trainer(net, adamw(), Recipe().checkpoint(Checkpointing::segments(9))), c10::Error);
  auto plain = std::make_shared<torch::optim::AdamW>(net->parameters());
  EXPECT_THROW(Trainer(net, plain, Recipe().state_bits(8)), c10::Error);
  auto eight = std::make_shared<optim::AdamW8bit>(net->parameters());
  EXPECT_THROW(Trainer(net, eight, Recipe().state_bits(4)), c10::Error);
  auto four = std::make_shared<optim::AdamW4bit>(net->parameters());
  EXPECT_NO_THROW(Trainer(net, four, Recipe().state_bits(4)));
  EXPECT_THROW(Trainer(net, four, Recipe().state_bits(8)), c10::Error);
  // A factory must build the state its recipe asks for: one that returns LibTorch's AdamW whatever the recipe
  // is refused for 8-bit or offloaded state, naming both, rather than train with fp32 state on the device.
  const OptimizerFactory plain_factory = [](const std::vector<torch::Tensor>& params, const Recipe&) {
    return std::make_unique<torch::optim::AdamW>(params);
  };
  EXPECT_NO_THROW(Trainer(net, plain_factory, Recipe()));
  const auto message = [&](const Recipe& recipe) {
    try {
      Trainer(net, plain_factory, recipe);
    } catch (const c10::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(Recipe().state_bits(8))
                .find("asks for 8-bit optimizer state but torch::optim::AdamW keeps "
                      "32-bit state"),
            std::string::npos);
  EXPECT_NE(message(Recipe().offload(Offload::kOptimizerState)).find("is not a memsave::OffloadOptimizer"),
            std::string::npos);
  // A factory may build fp32 state with one of memsave's optimizers (Lion, which LibTorch lacks, under its
  // size threshold).
  const OptimizerFactory lion = [](const std::vector<torch::Tensor>& params, const Recipe&) {
    return std::make_unique<optim::Lion8bit>(params,
                                             optim::Lion8bitOptions().min_8bit_size(int64_t{1} << 40));
  };
  EXPECT_NO_THROW(Trainer(net, lion, Recipe()));
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
  // All parameters frozen: said as such before anything runs (not as the backward's "does not require grad").
  for (auto& p : net->parameters()) p.requires_grad_(false);
  try {
    trainer.step(torch::randn({8, 6}), torch::randint(4, {8}), ce);
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no parameter of the model requires grad"), std::string::npos)
        << e.what();
  }
  for (auto& p : net->parameters()) p.requires_grad_(true);
  EXPECT_TRUE(torch::equal(before, net->parameters()[0]));
  for (const auto& p : net->parameters())
    EXPECT_FALSE(p.grad().defined() && p.grad().abs().sum().item<double>() > 0);
}

std::vector<torch::Tensor> model_tensors(tnn::Sequential& net) {
  std::vector<torch::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
  for (const auto& b : net->buffers()) out.push_back(b.clone());
  return out;
}

void expect_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "tensor " << i;
}

TEST(TrainerErrors, AnErrorInAMicroBatchSaysWhichAndChangesNothing) {
  // 17 rows in micro-batches of 4: the fifth has one row, which BatchNorm refuses in train mode. The error
  // says where it came from (the user's batch has 17 rows), and nothing has moved.
  torch::manual_seed(0);
  auto net = tnn::Sequential(tnn::Linear(6, 8), tnn::BatchNorm1d(8), tnn::ReLU(), tnn::Linear(8, 4));
  Trainer trainer(net, adamw(), Recipe().micro_batch(4));
  const std::vector<torch::Tensor> before = model_tensors(net);
  try {
    trainer.step(torch::randn({17, 6}), torch::randint(4, {17}), ce);
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("Expected more than 1 value per channel"), std::string::npos) << message;
    EXPECT_NE(message.find("Trainer::step: in micro-batch 5 of 5 (1 of the batch's 17 rows)"),
              std::string::npos)
        << message;
  }
  expect_equal(model_tensors(net), before);
  for (const auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined());
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
    try {
      trainer.step(batch.input, batch.target, ce);
      ADD_FAILURE() << "no error";
    } catch (const c10::OutOfMemoryError& e) {  // its type kept (the rescue catches it as one), with context
      const std::string message = e.what_without_backtrace();
      EXPECT_NE(message.find("Trainer::step: in micro-batch 1 of 4 (16 of the batch's 64 rows)"),
                std::string::npos)
          << message;
    }
  }
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(before[i], net->parameters()[i]));
  const auto stats = trainer.step(batch.input, batch.target, ce);  // and the next step works
  EXPECT_TRUE(stats.stepped);
}

TEST(TrainerErrors, AnOutOfMemoryInTheOptimizersStepLeavesTheModelAsItWas) {
  // LibTorch's AdamW and SGD allocate while they step (the state at the first step, AdamW's denominators at
  // every step) between their in-place updates. A model whose step is its peak (large weights, four rows),
  // under budgets rising by 256 KiB: each step either runs whole or changes no parameter.
  install_meter();
  const std::vector<std::pair<std::string, OptimizerFactory>> factories{{"AdamW", adamw(1e-3)},
                                                                        {"SGD", sgd(0.1)}};
  for (const auto& [name, factory] : factories) {
    for (const bool first : {true, false}) {
      SCOPED_TRACE(name + (first ? ", first step" : ", a later step"));
      torch::manual_seed(0);
      auto net = tnn::Sequential(tnn::Linear(8, 512), tnn::Tanh(), tnn::Linear(512, 2048), tnn::Tanh(),
                                 tnn::Linear(2048, 4));
      Trainer trainer(net, factory);
      const auto x = torch::randn({4, 8});
      const auto y = torch::randint(4, {4});
      if (!first) trainer.step(x, y, ce);
      int failed = 0;
      for (int64_t slack = 0;; slack += 256 << 10) {
        ASSERT_LT(slack, int64_t{64} << 20) << "no budget fitted";
        std::vector<torch::Tensor> before;
        for (const auto& p : net->parameters()) before.push_back(p.detach().clone());
        const size_t state = optimizer_state_tensors(trainer.optimizer()).size();
        if (step_under_budget(trainer, x, y, slack)) break;
        ++failed;
        for (size_t i = 0; i < before.size(); ++i)
          ASSERT_TRUE(torch::equal(before[i], net->parameters()[i]))
              << "parameter " << i << ", slack " << slack;
        ASSERT_EQ(optimizer_state_tensors(trainer.optimizer()).size(), state) << "slack " << slack;
      }
      EXPECT_GT(failed, 0);
    }
  }
}

// ---- save and load ----

/// A model with buffers (BatchNorm's running statistics) besides parameters.
tnn::Sequential resumable_net() {
  return tnn::Sequential(tnn::Linear(6, 32), tnn::BatchNorm1d(32), tnn::Tanh(), tnn::Linear(32, 4));
}

/// Adds a constant buffer that cannot be written (an expanded view): putting buffers back must leave it be.
struct ShiftImpl : tnn::Module {
  ShiftImpl() { shift = register_buffer("shift", torch::full({1}, 0.5).expand({4})); }
  torch::Tensor forward(const torch::Tensor& x) { return x + shift; }
  torch::Tensor shift;
};
TORCH_MODULE(Shift);

TEST(TrainerErrors, AnOutOfMemoryMidStepPutsTheBuffersBack) {
  // Every forward updates BatchNorm's running statistics. An out-of-memory at any point of a step (in the
  // second micro-batch's forward, in a backward, in the step) leaves them as they were, so the step that is
  // tried again updates them once: the model ends as a twin's that never failed.
  install_meter();
  const auto make = [] {
    torch::manual_seed(0);
    return tnn::Sequential(tnn::Linear(8, 256), tnn::BatchNorm1d(256), tnn::Tanh(), tnn::Linear(256, 512),
                           tnn::BatchNorm1d(512), tnn::Tanh(), tnn::Linear(512, 4), Shift());
  };
  torch::manual_seed(1);
  const auto x = torch::randn({256, 8});
  const auto y = torch::randint(4, {256});
  auto net = make();
  auto twin = make();
  Trainer trainer(net, adamw(1e-3), Recipe().micro_batch(64));
  Trainer twin_trainer(twin, adamw(1e-3), Recipe().micro_batch(64));
  // The copies take the buffers' bytes in the host arena, once (the Shift's expanded buffer is not copied).
  int64_t buffer_bytes = 0;
  for (const auto& b : net->buffers())
    if (at::has_internal_overlap(b) != at::MemOverlap::Yes) buffer_bytes += static_cast<int64_t>(b.nbytes());
  const int64_t host_before = host_memory_stats().current;
  trainer.step(x, y, ce);
  EXPECT_EQ(host_memory_stats().current - host_before, buffer_bytes);
  twin_trainer.step(x, y, ce);
  const int64_t host_kept = host_memory_stats().current;
  const std::vector<torch::Tensor> before = model_tensors(net);
  int failed = 0;
  for (int64_t slack = 0;; slack += 32 << 10) {
    ASSERT_LT(slack, int64_t{64} << 20) << "no budget fitted";
    if (step_under_budget(trainer, x, y, slack)) break;
    ++failed;
    const std::vector<torch::Tensor> now = model_tensors(net);
    for (size_t i = 0; i < before.size(); ++i)
      ASSERT_TRUE(torch::equal(before[i], now[i])) << "tensor " << i << ", slack " << slack;
  }
  EXPECT_GT(failed, 10);
  EXPECT_EQ(host_memory_stats().current, host_kept);
  twin_trainer.step(x, y, ce);
  expect_equal(model_tensors(net), model_tensors(twin));
}

/// A file name of this test's own in the temporary directory.
std::string temp_file(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("memsave_trainer_" + name + "_" + std::to_string(getpid()) + ".pt"))
      .string();
}

std::vector<zoo::Batch> mlp_batches(int count) {
  torch::manual_seed(7);
  std::vector<zoo::Batch> out;
  for (int i = 0; i < count; ++i) out.push_back({torch::randn({16, 6}), torch::randint(4, {16})});
  return out;
}

TEST(Trainer, Fp16OnTheCpuStepsAsALoopWithAutocastAndAGradScalerDoes) {
  // An fp16 recipe (meant for a card without bf16) tried on the CPU: each step is the one a hand-written
  // loop takes with Autocast and a GradScaler, bit for bit, a step skipped for an overflow included.
  auto batches = mlp_batches(6);
  batches[2].input = batches[2].input * 1000;  // the weight's fp16 gradient overflows at the scale 2^16
  torch::manual_seed(0);
  auto net = small_mlp();
  torch::manual_seed(0);
  auto by_hand = small_mlp();
  Trainer trainer(net, adamw(1e-2), Recipe().amp(torch::kHalf));
  ASSERT_NE(trainer.scaler(), nullptr);
  torch::optim::AdamW opt(by_hand->parameters(), torch::optim::AdamWOptions(1e-2));
  amp::GradScaler scaler;
  int skipped = 0;
  for (const zoo::Batch& b : batches) {
    const StepStats stats = trainer.step(b.input, b.target, ce);
    opt.zero_grad();
    torch::Tensor loss;
    {
      amp::Autocast autocast(torch::kCPU, torch::kHalf);
      const torch::Tensor out = by_hand->forward(b.input);
      EXPECT_EQ(out.scalar_type(), torch::kHalf);
      loss = ce(out, b.target);
    }
    scaler.scale(loss).backward();
    const bool stepped = scaler.step(opt);
    scaler.update();
    skipped += stepped ? 0 : 1;
    EXPECT_EQ(stats.stepped, stepped);
    EXPECT_EQ(stats.loss, loss.item<double>());
    expect_equal(model_tensors(net), model_tensors(by_hand));
    EXPECT_EQ(trainer.scaler()->get_scale(), scaler.get_scale());
  }
  EXPECT_EQ(skipped, 1);
  EXPECT_EQ(scaler.get_scale(), 32768.0);
}

TEST(Trainer, SaveAndLoadResumeExactly) {
  struct Case {
    Recipe recipe;
    OptimizerFactory optimizer;
  };
  const std::vector<Case> cases = {
      {Recipe(), adamw(1e-2)},
      {Recipe().micro_batch(4).amp(torch::kBFloat16).checkpoint(Checkpointing::every_layer()), adamw(1e-2)},
      {Recipe().state_bits(8).max_grad_norm(0.5), adamw(1e-2)},
      {Recipe().state_bits(4), adamw(1e-2)},
      {Recipe().offload(Offload::kOptimizerState), adamw(1e-2)},
      {Recipe().offload(Offload::kOptimizerState).state_bits(8).micro_batch(8), adamw(1e-2)},
      {Recipe().grad_scaling(GradScaling::kOn), adamw(1e-2)},
      {Recipe().offload(Offload::kOptimizerState).grad_scaling(GradScaling::kOn), adamw(1e-2)},
      {Recipe(), sgd(0.05)},
      {Recipe().state_bits(8), sgd(0.05)},
  };
  const auto batches = mlp_batches(6);
  const std::string file = temp_file("resume");
  for (const Case& c : cases) {
    SCOPED_TRACE(c.recipe.label());
    torch::manual_seed(0);
    auto straight = resumable_net();
    Trainer a(straight, c.optimizer, c.recipe);
    for (int s = 0; s < 3; ++s) a.step(batches[s].input, batches[s].target, ce);
    a.optimizer().param_groups()[0].options().set_lr(0.008);  // a schedule's, which the file keeps
    a.save(file);
    const auto saved = model_tensors(straight);
    for (int s = 3; s < 6; ++s) a.step(batches[s].input, batches[s].target, ce);

    torch::manual_seed(1);  // other initial weights, which the load replaces
    auto resumed = resumable_net();
    Trainer b(resumed, c.optimizer, c.recipe);
    b.load(file);
    expect_equal(model_tensors(resumed), saved);
    for (int s = 3; s < 6; ++s) b.step(batches[s].input, batches[s].target, ce);
    expect_equal(model_tensors(resumed), model_tensors(straight));
    if (a.scaler() != nullptr) {
      ASSERT_NE(b.scaler(), nullptr);
      EXPECT_EQ(a.scaler()->get_scale(), b.scaler()->get_scale());
      EXPECT_EQ(a.scaler()->growth_tracker(), b.scaler()->growth_tracker());
      EXPECT_EQ(b.scaler()->growth_tracker(), 6);
    }
  }

  // A file saved before the first step holds no optimizer state: loaded into a Trainer that has stepped, it
  // starts it afresh, as the Trainer that saved it.
  for (const Recipe& recipe : {Recipe(), Recipe().state_bits(8)}) {
    SCOPED_TRACE(recipe.label());
    torch::manual_seed(0);
    auto fresh = resumable_net();
    Trainer a(fresh, adamw(1e-2), recipe);
    a.save(file);
    torch::manual_seed(1);
    auto stepped = resumable_net();
    Trainer b(stepped, adamw(1e-2), recipe);
    for (int s = 0; s < 2; ++s) b.step(batches[s].input, batches[s].target, ce);
    b.load(file);
    for (int s = 0; s < 2; ++s) {
      a.step(batches[s].input, batches[s].target, ce);
      b.step(batches[s].input, batches[s].target, ce);
    }
    expect_equal(model_tensors(stepped), model_tensors(fresh));
  }

  // What does not touch the saved state may differ: here the checkpointing and the micro-batches.
  torch::manual_seed(0);
  auto net = resumable_net();
  Trainer a(net, adamw(1e-2), Recipe().checkpoint(Checkpointing::segments(2)).micro_batch(4));
  a.step(batches[0].input, batches[0].target, ce);
  a.save(file);
  torch::manual_seed(1);
  auto other = resumable_net();
  Trainer b(other, adamw(1e-2), Recipe());
  b.load(file);
  expect_equal(model_tensors(other), model_tensors(net));
  std::filesystem::remove(file);
}

/// A model whose second Linear (128 x 64) is large enough for 8- and 4-bit state.
tnn::Sequential convertible_net() {
  return tnn::Sequential(tnn::Linear(6, 128), tnn::BatchNorm1d(128), tnn::Tanh(), tnn::Linear(128, 64));
}

/// The mean absolute difference over every element of the model's parameters.
double mean_difference(tnn::Sequential& a, tnn::Sequential& b) {
  double sum = 0, count = 0;
  for (size_t i = 0; i < a->parameters().size(); ++i) {
    sum += (a->parameters()[i] - b->parameters()[i]).abs().sum().item<double>();
    count += static_cast<double>(a->parameters()[i].numel());
  }
  return sum / count;
}

TEST(Trainer, ResumesUnderARecipeWithOtherOptimizerState) {
  // A run saved under one recipe and resumed under another that keeps its optimizer state otherwise (fewer
  // bits, offloaded or not): the file's state is converted, so the resumed run follows the saved one's
  // continuation closely; a run that kept the weights but started its moments afresh strays far more.
  struct Case {
    Recipe from, to;
    OptimizerFactory optimizer;
    bool exact;  ///< the state needs no conversion: the resumed steps are the saved run's
  };
  const std::vector<Case> cases = {
      {Recipe(), Recipe().state_bits(8), adamw(1e-2), false},
      {Recipe(), Recipe().state_bits(4), adamw(1e-2), false},
      {Recipe(), Recipe().offload(Offload::kOptimizerState).state_bits(8), adamw(1e-2), false},
      // (not micro-batches: BatchNorm's statistics would differ)
      {Recipe().state_bits(8), Recipe().state_bits(4).checkpoint(Checkpointing::every_layer()), adamw(1e-2),
       false},
      {Recipe().state_bits(8), Recipe(), adamw(1e-2), false},
      {Recipe().offload(Offload::kOptimizerState), Recipe(), adamw(1e-2), false},
      {Recipe().offload(Offload::kOptimizerState).state_bits(8), Recipe().state_bits(8), adamw(1e-2), true},
      {Recipe(), Recipe().grad_scaling(GradScaling::kOn), adamw(1e-2), true},
      {Recipe(), Recipe().state_bits(8), sgd(0.05), false},
      {Recipe().state_bits(8), Recipe().state_bits(4), sgd(0.05), false},
      {Recipe().state_bits(4), Recipe(), sgd(0.05), false},
  };
  const auto batches = mlp_batches(6);
  const std::string file = temp_file("convert");
  for (const Case& c : cases) {
    SCOPED_TRACE(c.from.label() + " -> " + c.to.label());
    torch::manual_seed(0);
    auto straight = convertible_net();
    Trainer a(straight, c.optimizer, c.from);
    for (int s = 0; s < 3; ++s) a.step(batches[s].input, batches[s].target, ce);
    a.optimizer().param_groups()[0].options().set_lr(0.008);  // a schedule's: the resumed run takes it up
    a.save(file);
    const auto saved = model_tensors(straight);
    for (int s = 3; s < 6; ++s) a.step(batches[s].input, batches[s].target, ce);

    torch::manual_seed(1);
    auto resumed = convertible_net();
    Trainer b(resumed, c.optimizer, c.to);
    b.load(file);
    expect_equal(model_tensors(resumed), saved);
    EXPECT_EQ(b.optimizer().param_groups()[0].options().get_lr(), 0.008);
    for (int s = 3; s < 6; ++s) b.step(batches[s].input, batches[s].target, ce);

    torch::manual_seed(1);
    auto restarted = convertible_net();
    {  // the saved weights and buffers, in model_tensors' order
      torch::NoGradGuard no_grad;
      size_t i = 0;
      for (const auto& p : restarted->parameters()) p.copy_(saved[i++]);
      for (const auto& b : restarted->buffers()) b.copy_(saved[i++]);
    }
    Trainer fresh(restarted, c.optimizer, c.to);
    fresh.optimizer().param_groups()[0].options().set_lr(0.008);
    for (int s = 3; s < 6; ++s) fresh.step(batches[s].input, batches[s].target, ce);

    // Over 3 steps of lr 0.008 a restart moves each weight up to 0.024 off the saved run (about 0.01 on
    // average); a conversion to 8-bit state about 1e-4, to 4-bit 1e-3 (printed).
    const double converted = mean_difference(resumed, straight);
    const double restart = mean_difference(restarted, straight);
    std::printf("%s -> %s: mean difference %.3g converted, %.3g restarted\n", c.from.label().c_str(),
                c.to.label().c_str(), converted, restart);
    if (c.exact) {
      expect_equal(model_tensors(resumed), model_tensors(straight));
    } else {
      EXPECT_LT(converted, restart / 4);
    }
  }
  std::filesystem::remove(file);
}

TEST(Trainer, TakesOverAPlainLibTorchLoopsCheckpoint) {
  // A plain LibTorch loop saved its model and AdamW with torch::save. A Trainer over the loaded model takes
  // the loaded AdamW's moments with copy_state: under Recipe() it then steps as the plain loop would have,
  // bit for bit; under a recipe with other state near it, far nearer than with its moments started afresh.
  const auto batches = mlp_batches(6);
  const std::string model_file = temp_file("plain_model"), optimizer_file = temp_file("plain_adamw");
  torch::manual_seed(0);
  auto straight = convertible_net();
  torch::optim::AdamW plain(straight->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int s = 0; s < 6; ++s) {
    if (s == 3) {
      torch::save(straight, model_file);
      torch::save(plain, optimizer_file);
    }
    plain.zero_grad();
    ce(straight->forward(batches[s].input), batches[s].target).backward();
    plain.step();
  }
  for (const Recipe& recipe : {Recipe(), Recipe().amp(torch::kBFloat16).state_bits(8), Recipe().state_bits(4),
                               Recipe().offload(Offload::kOptimizerState).state_bits(8)}) {
    SCOPED_TRACE(recipe.label());
    auto resume = [&](bool take_moments) {
      torch::manual_seed(1);
      auto net = convertible_net();
      torch::load(net, model_file);
      torch::optim::AdamW loaded(net->parameters(), torch::optim::AdamWOptions(1e-2));
      torch::load(loaded, optimizer_file);
      Trainer trainer(net, adamw(1e-2), recipe);
      if (take_moments) optim::copy_state(loaded, trainer.optimizer());
      for (int s = 3; s < 6; ++s) trainer.step(batches[s].input, batches[s].target, ce);
      return net;
    };
    auto resumed = resume(true);
    if (recipe.state_bits() == 32 && !recipe.amp()) {
      expect_equal(model_tensors(resumed), model_tensors(straight));
    } else {
      auto restarted = resume(false);
      const double converted = mean_difference(resumed, straight),
                   restart = mean_difference(restarted, straight);
      std::printf("%s: mean difference %.3g with the plain loop's moments, %.3g restarted\n",
                  recipe.label().c_str(), converted, restart);
      EXPECT_LT(converted, restart / 4);
    }
  }
  std::filesystem::remove(model_file);
  std::filesystem::remove(optimizer_file);
}

TEST(TrainerErrors, ALoadThatDoesNotFitChangesNothing) {
  const auto batches = mlp_batches(3);
  auto trained = [&](tnn::Sequential net, const OptimizerFactory& optimizer, const Recipe& recipe) {
    auto trainer = std::make_unique<Trainer>(net, optimizer, recipe);
    trainer->step(batches[0].input, batches[0].target, ce);
    return trainer;
  };
  auto save = [&](const std::string& name, tnn::Sequential net, const OptimizerFactory& optimizer,
                  const Recipe& recipe) {
    const std::string path = temp_file(name);
    trained(std::move(net), optimizer, recipe)->save(path);
    return path;
  };
  // Another rule's state, and another optimizer's without a conversion (other bits, offload or scaling
  // convert: Trainer.ResumesUnderARecipeWithOtherOptimizerState).
  const OptimizerFactory lion = [](const std::vector<torch::Tensor>& p, const Recipe&) {
    return std::make_unique<optim::Lion8bit>(p);
  };
  const OptimizerFactory rmsprop = [](const std::vector<torch::Tensor>& p, const Recipe&) {
    return std::make_unique<torch::optim::RMSprop>(p);
  };
  const OptimizerFactory matrices_only = [](const std::vector<torch::Tensor>& params, const Recipe&) {
    std::vector<torch::Tensor> matrices;
    for (const auto& p : params) {
      if (p.dim() >= 2) matrices.push_back(p);
    }
    return std::make_unique<torch::optim::AdamW>(matrices, torch::optim::AdamWOptions(1e-2));
  };
  std::vector<std::string> bad = {
      save("lion", resumable_net(), lion, Recipe().state_bits(8)),
      save("rmsprop", resumable_net(), rmsprop, Recipe()),
      save("wider",
           tnn::Sequential(tnn::Linear(6, 48), tnn::BatchNorm1d(48), tnn::Tanh(), tnn::Linear(48, 4)),
           adamw(1e-2), Recipe()),
      save("unbuffered", tnn::Sequential(tnn::Linear(6, 32), tnn::Tanh(), tnn::Linear(32, 4)), adamw(1e-2),
           Recipe()),
      save("sgd", resumable_net(), sgd(0.1), Recipe()),            // the same model, another optimizer
      save("matrices", resumable_net(), matrices_only, Recipe()),  // no state for the biases and norms
      temp_file("tensor"),
      temp_file("truncated"),
  };
  torch::save(torch::ones({3}), bad[6]);  // a LibTorch archive, not a Trainer's
  const std::string whole = save("whole", resumable_net(), adamw(1e-2), Recipe());
  {
    std::ifstream in(whole, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream(bad[7], std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  }
  const std::string missing = temp_file("missing");

  torch::manual_seed(0);
  auto net = resumable_net();
  const auto trainer = trained(net, adamw(1e-2), Recipe());
  torch::manual_seed(0);
  auto control_net = resumable_net();
  const auto control = trained(control_net, adamw(1e-2), Recipe());
  const auto before = model_tensors(net);
  for (const std::string& path : bad) {
    SCOPED_TRACE(path);
    try {
      trainer->load(path);
      ADD_FAILURE() << "loaded";
    } catch (const c10::Error& e) {
      if (path == bad[5]) {
        EXPECT_NE(e.msg().find("the file's optimizer has no state for parameter 0.bias"), std::string::npos)
            << e.msg();
      }
    }
    expect_equal(model_tensors(net), before);
  }
  try {
    trainer->load(missing);
    ADD_FAILURE() << "a missing file loaded";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
  expect_equal(model_tensors(net), before);
  // The optimizer state is as it was too: the next steps are the control's.
  for (int s = 1; s < 3; ++s) {
    trainer->step(batches[s].input, batches[s].target, ce);
    control->step(batches[s].input, batches[s].target, ce);
  }
  expect_equal(model_tensors(net), model_tensors(control_net));
  // And a file that fits loads after all that.
  EXPECT_NO_THROW(trainer->load(whole));
  for (const std::string& path : bad) std::filesystem::remove(path);
  std::filesystem::remove(whole);
}

TEST(TrainerErrors, AnOptimizerLoadThatFailsHalfWayIsUndone) {
  // LibTorch's AdamW takes a file's groups one by one: the first fits here and is loaded, the second does
  // not.
  const auto batches = mlp_batches(3);
  auto groups = [](tnn::Sequential& net, size_t second) {
    const auto p = net->parameters();  // 2 per Linear and BatchNorm: 6
    return std::vector<torch::optim::OptimizerParamGroup>{
        torch::optim::OptimizerParamGroup({p[0], p[1]}),
        torch::optim::OptimizerParamGroup(std::vector<torch::Tensor>(p.begin() + 2, p.begin() + 2 + second))};
  };
  auto adamw_over = [](std::vector<torch::optim::OptimizerParamGroup> g) {
    return std::make_shared<torch::optim::AdamW>(std::move(g), torch::optim::AdamWOptions(1e-2));
  };
  torch::manual_seed(2);
  auto source = resumable_net();
  Trainer writer(source, adamw_over(groups(source, 4)), Recipe());
  for (int s = 0; s < 2; ++s) writer.step(batches[s].input, batches[s].target, ce);
  const std::string file = temp_file("groups");
  writer.save(file);

  torch::manual_seed(0);
  auto net = resumable_net();
  Trainer trainer(net, adamw_over(groups(net, 3)), Recipe());
  torch::manual_seed(0);
  auto control_net = resumable_net();
  Trainer control(control_net, adamw_over(groups(control_net, 3)), Recipe());
  trainer.step(batches[0].input, batches[0].target, ce);
  control.step(batches[0].input, batches[0].target, ce);
  EXPECT_THROW(trainer.load(file), c10::Error);
  for (int s = 1; s < 3; ++s) {
    trainer.step(batches[s].input, batches[s].target, ce);
    control.step(batches[s].input, batches[s].target, ce);
  }
  expect_equal(model_tensors(net), model_tensors(control_net));
  std::filesystem::remove(file);
}

TEST(Trainer, OffloadsAnOptimizerWithParameterGroupsAsLibTorchsAdamWStepsThem) {
  // Weights with decay, biases without and with their own lr: the groups of a GPT recipe. LibTorch's AdamW
  // over the same groups on the device is the reference, to rounding (the fused kernel rounds otherwise). (No
  // BatchNorm here: a bias before one has a gradient of rounding noise, which Adam scales up to the lr, so
  // that any rounding difference moves it by that much.)
  const auto batches = mlp_batches(4);
  using Group = torch::optim::OptimizerParamGroup;
  const auto split = [](tnn::Sequential& net) {
    const auto p = net->parameters();  // Linear weight, bias, Linear weight, bias
    return std::pair<std::vector<torch::Tensor>, std::vector<torch::Tensor>>{{p[0], p[2]}, {p[1], p[3]}};
  };
  torch::manual_seed(0);
  const auto make = [] { return tnn::Sequential(tnn::Linear(6, 32), tnn::Tanh(), tnn::Linear(32, 4)); };
  auto reference_net = make();
  const auto [decay, no_decay] = split(reference_net);
  auto reference_optimizer = std::make_shared<torch::optim::AdamW>(
      std::vector<Group>{Group(decay, std::make_unique<torch::optim::AdamWOptions>(
                                          torch::optim::AdamWOptions(1e-2).weight_decay(0.5))),
                         Group(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                             torch::optim::AdamWOptions(3e-3).weight_decay(0)))},
      torch::optim::AdamWOptions(1e-2));
  Trainer reference(reference_net, reference_optimizer, Recipe());
  torch::manual_seed(0);
  auto net = make();
  const auto [decay_o, no_decay_o] = split(net);
  const auto storage = OffloadOptimizerOptions(1e-2).copy_during_backward(true);
  auto offload = std::make_shared<OffloadOptimizer>(
      std::vector<Group>{Group(decay_o, std::make_unique<OffloadOptimizerOptions>(
                                            OffloadOptimizerOptions(storage).weight_decay(0.5))),
                         Group(no_decay_o, std::make_unique<OffloadOptimizerOptions>(
                                               OffloadOptimizerOptions(storage).lr(3e-3).weight_decay(0)))},
      storage);
  Trainer trainer(net, offload, Recipe().offload(Offload::kOptimizerState));
  for (const auto& b : batches) {
    reference.step(b.input, b.target, ce);
    trainer.step(b.input, b.target, ce);
  }
  const auto expected = reference_net->parameters(), actual = net->parameters();
  for (size_t i = 0; i < expected.size(); ++i)
    EXPECT_TRUE(torch::allclose(actual[i], expected[i], 1e-5, 1e-7)) << "parameter " << i;
}

/// AdamW (of the recipe's state, as memsave::adamw builds it) with two groups: matrices decay, vectors do
/// not and have their own lr; the vectors' group first or last.
OptimizerFactory grouped_adamw(bool vectors_first) {
  using Group = torch::optim::OptimizerParamGroup;
  return [vectors_first](const std::vector<torch::Tensor>& params,
                         const Recipe& recipe) -> std::unique_ptr<torch::optim::Optimizer> {
    std::vector<torch::Tensor> matrices, vectors;
    for (const auto& p : params) (p.dim() >= 2 ? matrices : vectors).push_back(p);
    const auto groups = [&](auto options) {
      using Options = decltype(options);
      std::vector<Group> out;
      out.emplace_back(matrices, std::make_unique<Options>(Options(options).weight_decay(0.5)));
      out.emplace_back(vectors, std::make_unique<Options>(Options(options).lr(3e-3).weight_decay(0)));
      if (vectors_first) std::swap(out[0], out[1]);
      return out;
    };
    if (recipe.offload() == Offload::kOptimizerState)
      return std::make_unique<OffloadOptimizer>(
          groups(OffloadOptimizerOptions(1e-2).state_bits(recipe.state_bits()).copy_during_backward(true)));
    if (recipe.state_bits() == 8)
      return std::make_unique<optim::AdamW8bit>(groups(optim::AdamW8bitOptions(1e-2)));
    if (recipe.state_bits() == 4)
      return std::make_unique<optim::AdamW4bit>(groups(optim::AdamW4bitOptions(1e-2)));
    return std::make_unique<torch::optim::AdamW>(groups(torch::optim::AdamWOptions(1e-2)));
  };
}

/// Each parameter's moments and step count (testing::adam_moments) under its name in `net`.
std::map<std::string, std::vector<torch::Tensor>> moments_by_name(torch::optim::Optimizer& o,
                                                                  const tnn::Sequential& net) {
  std::map<const c10::TensorImpl*, std::string> name;
  for (const auto& p : net->named_parameters()) name.emplace(p.value().unsafeGetTensorImpl(), p.key());
  const auto moments = testing::adam_moments(o);
  std::map<std::string, std::vector<torch::Tensor>> out;
  size_t i = 0;
  for (const auto& group : o.param_groups()) {
    for (const auto& p : group.params()) {
      out[name.at(p.unsafeGetTensorImpl())] = {moments[3 * i], moments[3 * i + 1], moments[3 * i + 2]};
      ++i;
    }
  }
  return out;
}

TEST(Trainer, ResumesAFineTuneWithFrozenLayersUnderOffloadedState) {
  // The first Linear frozen: the offloading optimizer keeps it on the device with no host master, its file
  // says which parameters it offloaded, and a run saved under offloaded 8-bit state resumes under 8-bit state
  // on the device, and back, step for step the saved run's continuation.
  auto frozen_net = [] {
    auto net = convertible_net();
    for (auto& p : net[0]->parameters()) p.requires_grad_(false);
    return net;
  };
  const Recipe offloaded = Recipe().offload(Offload::kOptimizerState).state_bits(8),
               on_device = Recipe().state_bits(8);
  const auto batches = mlp_batches(6);
  const std::string file = temp_file("frozen");
  for (const auto& [from, to] :
       {std::pair{offloaded, on_device}, std::pair{on_device, offloaded}, std::pair{offloaded, offloaded}}) {
    SCOPED_TRACE(from.label() + " -> " + to.label());
    torch::manual_seed(0);
    auto straight = frozen_net();
    const torch::Tensor frozen = straight->parameters()[0].clone();
    Trainer a(straight, adamw(1e-2), from);
    for (int s = 0; s < 3; ++s) a.step(batches[s].input, batches[s].target, ce);
    a.save(file);
    for (int s = 3; s < 6; ++s) a.step(batches[s].input, batches[s].target, ce);
    EXPECT_TRUE(torch::equal(straight->parameters()[0], frozen));

    torch::manual_seed(1);
    auto resumed = frozen_net();
    Trainer b(resumed, adamw(1e-2), to);
    b.load(file);
    for (int s = 3; s < 6; ++s) b.step(batches[s].input, batches[s].target, ce);
    expect_equal(model_tensors(resumed), model_tensors(straight));
  }
  // Into an offloading optimizer that froze another layer of the same shapes: an error naming the
  // difference, which changes nothing.
  auto twin = [] {
    return tnn::Sequential(tnn::Linear(6, 64), tnn::Tanh(), tnn::Linear(64, 64), tnn::Tanh(),
                           tnn::Linear(64, 64));
  };
  torch::manual_seed(0);
  auto first = twin();
  for (auto& p : first[2]->parameters()) p.requires_grad_(false);
  Trainer a(first, adamw(1e-2), offloaded);
  a.step(torch::randn({8, 6}), torch::randint(64, {8}), ce);
  a.save(file);
  torch::manual_seed(1);
  auto second = twin();
  for (auto& p : second[4]->parameters()) p.requires_grad_(false);
  Trainer b(second, adamw(1e-2), offloaded);
  b.step(torch::randn({8, 6}), torch::randint(64, {8}), ce);
  const auto before = model_tensors(second);
  const auto state_before = optimizer_state_tensors(b.optimizer());
  try {
    b.load(file);
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("frozen"), std::string::npos) << e.what();
  }
  expect_equal(model_tensors(second), before);
  const auto state_after = optimizer_state_tensors(b.optimizer());
  ASSERT_EQ(state_after.size(), state_before.size());
  for (size_t i = 0; i < state_after.size(); ++i) EXPECT_TRUE(state_after[i].is_same(state_before[i]));
}

TEST(Trainer, ResumesAnOptimizerWithParameterGroupsUnderOtherState) {
  // A run whose optimizer has two groups (matrices decay, vectors do not and have their own lr), saved with
  // fp32, 8-bit, 4-bit or offloaded state and resumed with another, as `memsave rescue` may advise: the
  // file's state is read in the file's groups and converted, and each group keeps the lr the file's had.
  const OptimizerFactory grouped = grouped_adamw(/*vectors_first=*/false);
  // 6144- and 4096-element weights: quantized in 8 and 4 bits.
  const auto make = [] { return tnn::Sequential(tnn::Linear(6, 1024), tnn::Tanh(), tnn::Linear(1024, 4)); };
  const auto batches = mlp_batches(3);
  const std::string file = temp_file("groups_convert");
  const std::vector<Recipe> recipes = {Recipe(), Recipe().state_bits(8), Recipe().state_bits(4),
                                       Recipe().offload(Offload::kOptimizerState).state_bits(8)};
  for (const Recipe& from : recipes) {
    torch::manual_seed(0);
    auto saved_net = make();
    Trainer saved(saved_net, grouped, from);
    for (const auto& b : batches) saved.step(b.input, b.target, ce);
    saved.optimizer().param_groups()[0].options().set_lr(8e-3);  // a schedule's, which the file keeps
    saved.optimizer().param_groups()[1].options().set_lr(2e-3);
    saved.save(file);
    for (const Recipe& to : recipes) {
      if (to.label() == from.label()) continue;
      SCOPED_TRACE(from.label() + " -> " + to.label());
      torch::manual_seed(1);  // other weights, which the file replaces
      auto net = make();
      Trainer resumed(net, grouped, to);
      resumed.load(file);
      expect_equal(model_tensors(net), model_tensors(saved_net));
      ASSERT_EQ(resumed.optimizer().param_groups().size(), 2u);
      EXPECT_EQ(resumed.optimizer().param_groups()[0].options().get_lr(), 8e-3);
      EXPECT_EQ(resumed.optimizer().param_groups()[1].options().get_lr(), 2e-3);
      // The state the saved run's optimizer converts into, by copy_state directly.
      std::vector<torch::Tensor> params;
      for (const auto& p : saved_net->parameters()) params.push_back(p.detach().clone().requires_grad_());
      auto direct = grouped(params, to);
      optim::copy_state(saved.optimizer(), *direct);
      // (copy_state pairs the i-th parameters of two optimizers, group after group)
      expect_equal(testing::adam_moments(resumed.optimizer()), testing::adam_moments(*direct));
      for (const auto& b : batches) resumed.step(b.input, b.target, ce);  // and it trains on
    }
  }
  std::filesystem::remove(file);
}

TEST(Trainer, ResumesUnderAnOptimizerThatGroupsTheParametersOtherwise) {
  // A run saved with one group of every parameter goes on with the biases and norms in a group of their own
  // (no decay), or the other way round, keeping its state or converting it: the file names each state's
  // parameter, and each goes to that parameter. Three vectors of 1024 elements (a bias, LayerNorm's weight
  // and bias) change places between the two lists: paired by place, they would swap their moments unnoticed.
  const auto make = [] {
    return tnn::Sequential(tnn::Linear(6, 1024), tnn::LayerNorm(tnn::LayerNormOptions({1024})), tnn::Tanh(),
                           tnn::Linear(1024, 4));
  };
  const auto batches = mlp_batches(3);
  const std::string file = temp_file("regrouped");
  const std::vector<Recipe> recipes = {Recipe(), Recipe().state_bits(8),
                                       Recipe().offload(Offload::kOptimizerState).state_bits(8)};
  const std::vector<std::pair<std::string, OptimizerFactory>> factories = {
      {"one group", adamw(1e-2)}, {"vectors first", grouped_adamw(/*vectors_first=*/true)}};
  for (size_t f = 0; f < factories.size(); ++f) {
    const auto& [saved_by, saving_factory] = factories[f];
    const auto& [resumed_by, resuming_factory] = factories[1 - f];
    for (const Recipe& from : recipes) {
      torch::manual_seed(0);
      auto saved_net = make();
      Trainer saved(saved_net, saving_factory, from);
      for (const auto& b : batches) saved.step(b.input, b.target, ce);
      saved.save(file);
      // The state each parameter should resume with: the saved optimizer's, converted by copy_state into
      // the same format over copies listed in the saved optimizer's order (paired in order).
      std::map<const c10::TensorImpl*, std::string> name;
      for (const auto& p : saved_net->named_parameters())
        name.emplace(p.value().unsafeGetTensorImpl(), p.key());
      for (const Recipe& to : recipes) {
        SCOPED_TRACE(saved_by + " " + from.label() + " -> " + resumed_by + " " + to.label());
        std::vector<torch::Tensor> copies;
        std::vector<std::string> names;
        for (const auto& group : saved.optimizer().param_groups()) {
          for (const auto& p : group.params()) {
            copies.push_back(p.detach().clone().requires_grad_());
            names.push_back(name.at(p.unsafeGetTensorImpl()));
          }
        }
        auto direct = adamw(1e-2)(copies, to);
        optim::copy_state(saved.optimizer(), *direct);
        const auto moments = testing::adam_moments(*direct);
        torch::manual_seed(1);  // other weights, which the file replaces
        auto net = make();
        Trainer resumed(net, resuming_factory, to);
        std::vector<double> lrs;
        for (const auto& group : resumed.optimizer().param_groups()) lrs.push_back(group.options().get_lr());
        resumed.load(file);
        expect_equal(model_tensors(net), model_tensors(saved_net));
        const auto got = moments_by_name(resumed.optimizer(), net);
        ASSERT_EQ(got.size(), names.size());
        for (size_t i = 0; i < names.size(); ++i) {
          for (size_t k = 0; k < 3; ++k)
            EXPECT_TRUE(torch::equal(got.at(names[i])[k], moments[3 * i + k]))
                << names[i] << ", tensor " << k;
        }
        // No group of the file has the same parameters as one of these: each keeps its own lr.
        for (size_t g = 0; g < lrs.size(); ++g)
          EXPECT_EQ(resumed.optimizer().param_groups()[g].options().get_lr(), lrs[g]);
        for (const auto& b : batches) resumed.step(b.input, b.target, ce);  // and it trains on
      }
    }
  }
  std::filesystem::remove(file);
}

TEST(TrainerErrors, AFailedSaveLeavesTheOlderFile) {
  torch::manual_seed(0);
  auto net = resumable_net();
  Trainer trainer(net, adamw(), Recipe());
  const auto batches = mlp_batches(2);
  trainer.step(batches[0].input, batches[0].target, ce);
  const std::string file = temp_file("older");
  trainer.save(file);
  const auto saved = model_tensors(net);
  trainer.step(batches[1].input, batches[1].target, ce);
  std::filesystem::create_directory(file + ".partial");  // where the save writes first: not writable
  EXPECT_THROW(trainer.save(file), c10::Error);
  std::filesystem::remove(file + ".partial");
  EXPECT_THROW(trainer.save(temp_file("no/such/directory")), c10::Error);

  torch::manual_seed(1);
  auto other = resumable_net();
  Trainer reader(other, adamw(), Recipe());
  reader.load(file);  // the older file, whole
  expect_equal(model_tensors(other), saved);
  std::filesystem::remove(file);
}

// ---- a model of any shape ----

/// A model that is not a Sequential: two inputs per row (features and side information), buffers too.
struct TwoInputsImpl : tnn::Module {
  TwoInputsImpl()
      : a(register_module("a", tnn::Linear(64, 64))),  // 4096 elements: 8-bit state
        b(register_module("b", tnn::Linear(8, 64))),
        norm(register_module("norm", tnn::BatchNorm1d(64))),
        head(register_module("head", tnn::Linear(64, 5))) {}
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& side) {
    return head(torch::tanh(norm(a(x) + b(side))));
  }
  tnn::Linear a, b;
  tnn::BatchNorm1d norm;
  tnn::Linear head;
};
TORCH_MODULE(TwoInputs);

TwoInputs two_inputs(uint64_t seed) {
  torch::manual_seed(seed);
  return TwoInputs();
}

Forward forward_of(TwoInputs net) {
  return [net](const std::vector<torch::Tensor>& in) mutable { return net->forward(in[0], in[1]); };
}

/// Rows whose mask is 0 have the target -100, which the loss ignores: the mask's sum counts the items.
struct TwoInputsBatch {
  torch::Tensor x, side, target, mask;
};

std::vector<TwoInputsBatch> two_inputs_batches(int count) {
  torch::manual_seed(11);
  std::vector<TwoInputsBatch> out;
  for (int i = 0; i < count; ++i) {
    TwoInputsBatch b{torch::randn({8, 64}), torch::randn({8, 8}), torch::randint(5, {8}),
                     (torch::rand({8}) > 0.3).to(torch::kFloat)};
    b.target = b.target.masked_fill(b.mask == 0, -100);
    out.push_back(b);
  }
  return out;
}

torch::Tensor masked_ce(const torch::Tensor& out, const torch::Tensor& target) {
  return F::cross_entropy(out, target, F::CrossEntropyFuncOptions().ignore_index(-100));
}

std::vector<torch::Tensor> module_tensors(const tnn::Module& net) {
  std::vector<torch::Tensor> out;
  for (const auto& p : net.parameters()) out.push_back(p.detach().clone());
  for (const auto& b : net.buffers()) out.push_back(b.clone());
  return out;
}

TEST(Trainer, AModelOfAnyShapeTakesSeveralInputsAndStepsAsTheWrappersDo) {
  // A module of one's own with two inputs, through a forward function: micro-batches of 3 (the last of 2),
  // tokens counted from the mask, bf16, 8-bit state and clipping. Each step is the one the individual
  // wrappers take by hand, bit for bit, BatchNorm's running statistics included.
  const auto batches = two_inputs_batches(4);
  const Recipe recipe = Recipe().micro_batch(3).amp(torch::kBFloat16).state_bits(8).max_grad_norm(0.5);
  auto net = two_inputs(0);
  Trainer trainer(net.ptr(), forward_of(net), adamw(1e-2), recipe);
  for (const auto& batch : batches) {
    const auto stats = trainer.step({batch.x, batch.side}, batch.target, masked_ce, batch.mask);
    EXPECT_EQ(stats.items, batch.mask.sum().item<double>());
    EXPECT_TRUE(stats.stepped);
  }

  auto by_hand = two_inputs(0);
  optim::AdamW8bit opt(by_hand->parameters(), optim::AdamW8bitOptions(1e-2).weight_decay(1e-2));
  GradientAccumulator acc(opt, AccumulateOptions().window(1000).max_grad_norm(0.5));
  for (const auto& batch : batches) {
    acc.begin_window(batch.mask.sum().item<double>());
    for (const auto& part : split_micro_batches({batch.x, batch.side, batch.target, batch.mask}, 3)) {
      const double items = part[3].sum().item<double>();
      if (items == 0) continue;
      torch::Tensor loss;
      {
        amp::Autocast autocast(torch::kCPU, torch::kBFloat16);
        loss = masked_ce(by_hand->forward(part[0], part[1]), part[2]);
      }
      acc.backward(loss, items);
    }
    acc.step();
  }
  expect_equal(module_tensors(*net), module_tensors(*by_hand));
  auto* eight = dynamic_cast<optim::AdamW8bit*>(&trainer.optimizer());
  ASSERT_NE(eight, nullptr);
  expect_equal(eight->state_fp32(net->a->weight), opt.state_fp32(by_hand->a->weight));

  // predict takes the inputs as step does, in eval mode.
  const auto out = trainer.predict({batches[0].x, batches[0].side});
  by_hand->eval();
  torch::Tensor expected;
  {
    torch::NoGradGuard no_grad;
    amp::Autocast autocast(torch::kCPU, torch::kBFloat16);
    expected = by_hand->forward(batches[0].x, batches[0].side);
  }
  EXPECT_TRUE(torch::equal(out, expected));
  EXPECT_TRUE(net->is_training());
}

TEST(Trainer, AModelOfAnyShapeSavesAndResumesExactly) {
  const auto batches = two_inputs_batches(6);
  const Recipe recipe = Recipe().micro_batch(4).state_bits(8);
  const std::string file = temp_file("any_shape");
  auto straight = two_inputs(0);
  Trainer a(straight.ptr(), forward_of(straight), adamw(1e-2), recipe);
  for (int s = 0; s < 3; ++s)
    a.step({batches[s].x, batches[s].side}, batches[s].target, masked_ce, batches[s].mask);
  a.save(file);
  const auto at_save = module_tensors(*straight);
  for (int s = 3; s < 6; ++s)
    a.step({batches[s].x, batches[s].side}, batches[s].target, masked_ce, batches[s].mask);

  auto resumed = two_inputs(1);  // other initial weights, which the load replaces
  Trainer b(resumed.ptr(), forward_of(resumed), adamw(1e-2), recipe);
  b.load(file);
  for (int s = 3; s < 6; ++s)
    b.step({batches[s].x, batches[s].side}, batches[s].target, masked_ce, batches[s].mask);
  expect_equal(module_tensors(*resumed), module_tensors(*straight));
  // The file names the tensors as the module does: LibTorch's own load reads its model.
  torch::serialize::InputArchive archive, model;
  archive.load_from(file);
  ASSERT_TRUE(archive.try_read("model", model));
  auto plain = two_inputs(2);
  plain->load(model);
  expect_equal(module_tensors(*plain), at_save);
  std::filesystem::remove(file);
}

/// A model of one's own whose blocks (two inputs each, BatchNorm and dropout inside) sit in
/// memsave::nn::Checkpoint wrappers, for the recipe to switch.
struct BlockImpl : tnn::Module {
  BlockImpl()
      : up(register_module("up", tnn::Linear(64, 256))),
        side(register_module("side", tnn::Linear(8, 256))),
        norm(register_module("norm", tnn::BatchNorm1d(256))),
        down(register_module("down", tnn::Linear(256, 64))) {}
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& s) {
    return x + down(F::dropout(torch::gelu(norm(up(x) + side(s))),
                               F::DropoutFuncOptions().p(0.1).training(is_training())));
  }
  tnn::Linear up, side;
  tnn::BatchNorm1d norm;
  tnn::Linear down;
};
TORCH_MODULE(Block);

struct BlocksImpl : tnn::Module {
  BlocksImpl() : head(register_module("head", tnn::Linear(64, 5))) {
    for (int i = 0; i < 3; ++i) {
      blocks.push_back(Block());
      wrappers.push_back(
          register_module("block" + std::to_string(i), memsave::nn::Checkpoint(blocks.back())));
    }
  }
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& s) {
    for (size_t i = 0; i < blocks.size(); ++i) {
      auto block = blocks[i];
      x = wrappers[i]->run(
          [block](at::TensorList in) mutable { return std::vector{block->forward(in[0], in[1])}; },
          {x, s})[0];
    }
    return head(x);
  }
  std::vector<Block> blocks;
  std::vector<memsave::nn::Checkpoint> wrappers;
  tnn::Linear head;
};
TORCH_MODULE(Blocks);

TEST(Trainer, TheRecipeSwitchesTheCheckpointedBlocksOfAModelOfAnyShape) {
  // Checkpointing every layer turns the blocks on: the same parameters, running statistics and dropout as
  // with them off, bit for bit; offloaded activations keep the blocks' inputs in the host arena. A recipe
  // without checkpointing turns them off. A Trainer that fails to build switches nothing. (What the blocks
  // save: Checkpoint.WrapsBlocksOfSeveralInputsAndCanBeSwitchedOff, Rescue.CheckpointsTheBlocksOf...)
  install_meter();
  const auto batches = two_inputs_batches(3);
  auto forward = [](Blocks net) -> Forward {
    return [net](const std::vector<torch::Tensor>& in) mutable { return net->forward(in[0], in[1]); };
  };
  auto train = [&](const Recipe& recipe, int64_t& host_peak) {
    torch::manual_seed(5);
    Blocks net;
    for (auto& w : net->wrappers) {  // the other way round, for the Trainer to switch
      w->enable(recipe.checkpoint().kind != Checkpointing::Kind::kEveryLayer);
      w->options().offload_inputs(!recipe.offload_activations());
    }
    Trainer trainer(net.ptr(), forward(net), adamw(1e-2), recipe);
    for (auto& w : net->wrappers) {
      EXPECT_EQ(w->enabled(), recipe.checkpoint().kind == Checkpointing::Kind::kEveryLayer);
      EXPECT_EQ(w->options().offload_inputs(), recipe.offload_activations());
    }
    torch::manual_seed(9);
    const int64_t host_before = host_memory_stats().current;
    reset_host_peak();
    for (const auto& b : batches) trainer.step({b.x, b.side}, b.target, masked_ce, b.mask);
    host_peak = host_memory_stats().peak - host_before;
    return module_tensors(*net);
  };
  int64_t plain_host = 0, on_host = 0, offloaded_host = 0;
  const auto plain = train(Recipe().micro_batch(4), plain_host);
  const auto on = train(Recipe().micro_batch(4).checkpoint(Checkpointing::every_layer()), on_host);
  const auto offloaded =
      train(Recipe().micro_batch(4).checkpoint(Checkpointing::every_layer()).offload_activations(true),
            offloaded_host);
  expect_equal(on, plain);
  expect_equal(offloaded, plain);
  EXPECT_EQ(on_host, plain_host);
  // Each block's two inputs of a micro-batch of 4 rows (x: 64 floats a row, side: 8).
  EXPECT_GE(offloaded_host - on_host, 4 * (64 + 8) * 4);

  // Built with them on, a recipe without checkpointing turns them off; a Trainer that fails to build leaves
  // them as they were.
  Blocks net;
  for (auto& w : net->wrappers) EXPECT_TRUE(w->enabled());
  Trainer off(net.ptr(), forward(net), adamw(), Recipe());
  for (auto& w : net->wrappers) EXPECT_FALSE(w->enabled());
  const OptimizerFactory none = [](const std::vector<torch::Tensor>&, const Recipe&) {
    return std::unique_ptr<torch::optim::Optimizer>();
  };
  EXPECT_THROW(Trainer(net.ptr(), forward(net), none, Recipe().checkpoint(Checkpointing::every_layer())),
               c10::Error);
  for (auto& w : net->wrappers) EXPECT_FALSE(w->enabled());
}

TEST(TrainerErrors, AModelWithAForwardFunctionRefusesCheckpointingAndBadInputs) {
  auto net = two_inputs(0);
  const auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const c10::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  // Checkpointing switches the module's memsave::nn::Checkpoint blocks, of which this one has none; segments
  // cut a Sequential. Both refused at construction, naming what to do instead.
  EXPECT_NE(message([&] {
              Trainer(net.ptr(), forward_of(net), adamw(), Recipe().checkpoint(Checkpointing::every_layer()));
            }).find("has none; wrap its blocks in memsave::nn::Checkpoint"),
            std::string::npos);
  EXPECT_NE(message([&] {
              Trainer(net.ptr(), forward_of(net), adamw(), Recipe().checkpoint(Checkpointing::segments(2)));
            }).find("cuts a torch::nn::Sequential"),
            std::string::npos);
  EXPECT_THROW(Trainer(net.ptr(), Forward(), adamw()), c10::Error);
  EXPECT_THROW(Trainer(nullptr, forward_of(net), adamw()), c10::Error);

  Trainer trainer(net.ptr(), forward_of(net), adamw(), Recipe().micro_batch(4));
  const auto before = module_tensors(*net);
  const auto y = torch::randint(5, {8});
  EXPECT_NE(message([&] {
              trainer.step({torch::randn({8, 64}), torch::randn({7, 8})}, y, masked_ce);
            }).find("input 1 has 7 rows on dim 0 but input 0 has 8"),
            std::string::npos);
  EXPECT_NE(message([&] {
              trainer.step({torch::randn({8, 64}), torch::randn({8, 8})}, y.narrow(0, 0, 6), masked_ce);
            }).find("target has 6 rows"),
            std::string::npos);
  EXPECT_THROW(trainer.step(std::vector<torch::Tensor>{}, y, masked_ce), c10::Error);
  EXPECT_THROW(trainer.step({torch::randn({8, 64}), torch::Tensor()}, y, masked_ce), c10::Error);
  EXPECT_NE(message([&] {
              trainer.predict({torch::randn({8, 64}), torch::Tensor()});
            }).find("Trainer::predict: input 1 is not defined"),
            std::string::npos);
  expect_equal(module_tensors(*net), before);
  for (const auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined());

  // A Sequential takes one input: two are an error naming the way to several.
  auto seq = small_mlp();
  Trainer over_sequential(seq, adamw());
  EXPECT_NE(message([&] {
              over_sequential.step({torch::randn({8, 6}), torch::randn({8, 6})}, y, ce);
            }).find("a Trainer over a Sequential takes one input, got 2"),
            std::string::npos);
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
