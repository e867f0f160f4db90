#include <memsave/amp.h>
#include <memsave/memory.h>
#include <memsave/optim.h>

#include "kernels/golden.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <memory>
#include <sstream>
#include <string>

namespace memsave::amp {
namespace {

using memsave::testing::golden;

// The sequence of scripts/golden/make_golden.py (scaler_sequence), replayed in C++.
TEST(GradScaler, ReplaysTorchAmpGradScalerExactly) {
  auto p = torch::tensor({1.0f, -2.0f, 3.0f, 0.5f}).requires_grad_();
  torch::optim::SGD opt(std::vector<torch::Tensor>{p}, torch::optim::SGDOptions(0.1).momentum(0.9));
  GradScaler scaler(
      GradScalerOptions().init_scale(1024).growth_factor(2).backoff_factor(0.5).growth_interval(3));
  const auto& scales = golden("scaler.scale");
  const auto& trackers = golden("scaler.tracker");
  const auto& stepped = golden("scaler.stepped");
  const auto& params = golden("scaler.params");
  for (int step = 1; step <= 12; ++step) {
    SCOPED_TRACE(step);
    opt.zero_grad();
    const auto loss = (p * p).sum() * 0.5 * step;
    scaler.scale(loss).backward();
    if (step == 2 || step == 6) p.mutable_grad()[1] = INFINITY;
    if (step == 5) p.mutable_grad()[1] = NAN;
    EXPECT_EQ(scaler.step(opt), stepped[step - 1] == 1.0f);
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), scales[step - 1]);
    EXPECT_EQ(scaler.growth_tracker(), static_cast<int64_t>(trackers[step - 1]));
    for (int i = 0; i < 4; ++i) EXPECT_NEAR(p[i].item<float>(), params[(step - 1) * 4 + i], 1e-6);
  }
}

TEST(GradScaler, AnInfSkipsTheStepAndLeavesEverythingBitIdentical) {
  auto p = torch::randn({5000}).requires_grad_();
  optim::AdamW8bit opt(std::vector<torch::Tensor>{p});
  GradScaler scaler;
  // one clean step so the optimizer has state
  scaler.scale(p.sum()).backward();
  EXPECT_TRUE(scaler.step(opt));
  scaler.update();
  const auto params = p.detach().clone();
  const auto state = opt.state_fp32(p);
  opt.zero_grad();
  scaler.scale((p * 2).sum()).backward();
  p.mutable_grad()[17] = INFINITY;
  EXPECT_FALSE(scaler.step(opt));
  EXPECT_TRUE(torch::equal(p.detach(), params));
  EXPECT_TRUE(torch::equal(opt.state_fp32(p)[0], state[0]));
  EXPECT_TRUE(torch::equal(opt.state_fp32(p)[1], state[1]));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 65536.0 / 2);
  EXPECT_EQ(scaler.growth_tracker(), 0);
}

TEST(GradScaler, ChecksAChannelsLastGradientWhereItLies) {
  // The inf check before a fused unscale reads a dense gradient's memory as it lies: a channels_last gradient
  // is not copied (the step allocates only scalars), and an inf anywhere in it still skips the step.
  auto w = torch::randn({64, 32, 3, 3}).contiguous(torch::MemoryFormat::ChannelsLast).requires_grad_();
  optim::AdamW8bit opt(std::vector<torch::Tensor>{w});
  GradScaler scaler(GradScalerOptions().fuse_unscale(FuseUnscale::kAlways));
  int step = 0;
  for (const bool poisoned : {false, false, true, false}) {
    opt.zero_grad();
    scaler.scale((w * torch::randn(w.sizes())).sum()).backward();
    ASSERT_TRUE(w.grad().is_contiguous(torch::MemoryFormat::ChannelsLast));  // autograd keeps the layout
    if (poisoned) w.mutable_grad()[40][7][1][2] = INFINITY;
    const auto before = w.detach().clone();
    const int64_t live = memory_stats(torch::kCPU).current;
    reset_peak(torch::kCPU);
    EXPECT_EQ(scaler.step(opt), !poisoned) << step;
    if (step++ > 0) {
      EXPECT_LT(memory_stats(torch::kCPU).peak - live, 4096) << step;  // the gradient: 73,728 B
    }
    if (poisoned) {
      EXPECT_TRUE(torch::equal(w.detach(), before));
    }
    scaler.update();
  }
}

TEST(GradScaler, GrowsExactlyAfterTheIntervalAndNeverToInfinity) {
  auto p = torch::ones({4}).requires_grad_();
  torch::optim::SGD opt(std::vector<torch::Tensor>{p}, torch::optim::SGDOptions(0.0));
  GradScaler scaler(GradScalerOptions().init_scale(3e38).growth_interval(2));
  for (int i = 1; i <= 4; ++i) {
    opt.zero_grad();
    scaler.scale(p.sum()).backward();
    scaler.step(opt);
    scaler.update();
    // float32 cannot hold 6e38: growth is refused and the tracker restarts
    EXPECT_EQ(scaler.get_scale(), static_cast<double>(3e38f));
    EXPECT_EQ(scaler.growth_tracker(), i % 2);
  }
  GradScaler small(GradScalerOptions().init_scale(8).growth_interval(2));
  for (int i = 1; i <= 4; ++i) {
    opt.zero_grad();
    small.scale(p.sum()).backward();
    small.step(opt);
    small.update();
  }
  EXPECT_EQ(small.get_scale(), 32.0);
  small.update(0.25);
  EXPECT_EQ(small.get_scale(), 0.25);
}

TEST(GradScaler, UnscaleGivesTrueGradientsForClipping) {
  auto p = torch::tensor({3.0f, 4.0f}).requires_grad_();
  torch::optim::SGD opt(std::vector<torch::Tensor>{p}, torch::optim::SGDOptions(1.0));
  GradScaler scaler;
  scaler.scale((p * p).sum() * 0.5).backward();
  EXPECT_TRUE(torch::equal(p.grad(), torch::tensor({3.0f, 4.0f}) * 65536));
  scaler.unscale_(opt);
  EXPECT_TRUE(torch::equal(p.grad(), torch::tensor({3.0f, 4.0f})));
  torch::nn::utils::clip_grad_norm_(std::vector<torch::Tensor>{p}, 1.0);  // true norm 5 -> 1
  EXPECT_NEAR(p.grad().norm().item<double>(), 1.0, 1e-6);
  EXPECT_TRUE(scaler.step(opt));  // does not unscale again
  EXPECT_TRUE(torch::allclose(p.detach(), torch::tensor({3.0f - 0.6f, 4.0f - 0.8f}), 1e-6, 1e-6));
}

// A LibTorch optimizer over a module used twice lists its parameters twice (LibTorch's parameters() does):
// each gradient is still unscaled once.
TEST(GradScaler, AParameterListedTwiceIsUnscaledOnce) {
  auto p = torch::tensor({3.0f, 4.0f}).requires_grad_();
  torch::optim::SGD opt(std::vector<torch::Tensor>{p, p}, torch::optim::SGDOptions(1.0));
  GradScaler scaler;
  scaler.scale((p * p).sum() * 0.5).backward();
  scaler.unscale_(opt);
  EXPECT_TRUE(torch::equal(p.grad(), torch::tensor({3.0f, 4.0f})));
}

TEST(GradScaler, MisuseIsAnErrorThatChangesNothing) {
  auto p = torch::ones({4}).requires_grad_();
  torch::optim::SGD opt(std::vector<torch::Tensor>{p}, torch::optim::SGDOptions(0.1));
  GradScaler scaler;
  p.mutable_grad() = torch::ones({4});
  EXPECT_THROW(scaler.step(opt), c10::Error);  // never scaled
  EXPECT_TRUE(torch::equal(p.detach(), torch::ones({4})));
  scaler.scale(p.sum()).backward();
  scaler.unscale_(opt);
  EXPECT_THROW(scaler.unscale_(opt), c10::Error);  // twice
  scaler.step(opt);
  EXPECT_THROW(scaler.step(opt), c10::Error);      // step twice
  EXPECT_THROW(scaler.unscale_(opt), c10::Error);  // after step
  scaler.update();

  auto h = torch::ones({4}, torch::kHalf).requires_grad_();
  torch::optim::SGD half_opt(std::vector<torch::Tensor>{h}, torch::optim::SGDOptions(0.1));
  scaler.scale(h.sum()).backward();
  const auto grad = h.grad().clone();
  EXPECT_THROW(scaler.unscale_(half_opt), c10::Error);  // fp16 master gradients
  EXPECT_TRUE(torch::equal(h.grad(), grad));

  EXPECT_THROW(GradScaler(GradScalerOptions().growth_factor(1.0)), c10::Error);
  EXPECT_THROW(GradScaler(GradScalerOptions().backoff_factor(1.0)), c10::Error);
  EXPECT_THROW(GradScaler(GradScalerOptions().backoff_factor(0.0)), c10::Error);
  EXPECT_THROW(GradScaler(GradScalerOptions().growth_interval(0)), c10::Error);
}

TEST(GradScaler, StateRoundTripsThroughAnArchive) {
  auto p = torch::ones({4}).requires_grad_();
  torch::optim::SGD opt(std::vector<torch::Tensor>{p}, torch::optim::SGDOptions(0.1));
  GradScaler a(GradScalerOptions().init_scale(512).growth_interval(5));
  for (int i = 0; i < 3; ++i) {
    opt.zero_grad();
    a.scale(p.sum()).backward();
    a.step(opt);
    a.update();
  }
  torch::serialize::OutputArchive out;
  a.serialize(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  GradScaler b;
  torch::serialize::InputArchive in;
  std::istringstream read(bytes.str());
  in.load_from(read);
  b.serialize(in);
  EXPECT_EQ(b.get_scale(), 512.0);
  EXPECT_EQ(b.growth_tracker(), 3);
  EXPECT_EQ(b.options().growth_interval(), 5);
}

TEST(GradScaler, TheArchiveOfADisabledScalerHoldsNoScale) {
  // torch.amp: a disabled scaler's state_dict is empty, and an enabled one refuses it. Taken as a scale of 1,
  // fp16 gradients would underflow until the scale had grown back, 2000 steps per doubling.
  auto save = [](const GradScaler& scaler) {
    torch::serialize::OutputArchive out;
    scaler.serialize(out);
    std::ostringstream bytes;
    out.save_to(bytes);
    return bytes.str();
  };
  auto load = [](GradScaler& scaler, const std::string& bytes) {
    torch::serialize::InputArchive in;
    std::istringstream read(bytes);
    in.load_from(read);
    scaler.serialize(in);
  };
  const std::string disabled = save(GradScaler(GradScalerOptions().enabled(false)));
  GradScaler enabled(GradScalerOptions().init_scale(1024));
  EXPECT_THROW(load(enabled, disabled), c10::Error);
  EXPECT_EQ(enabled.get_scale(), 1024.0);
  // A disabled scaler reads nothing, not even a file of an enabled one.
  GradScaler off(GradScalerOptions().enabled(false).growth_interval(7));
  load(off, save(GradScaler(GradScalerOptions().growth_interval(3))));
  EXPECT_EQ(off.options().growth_interval(), 7);
  EXPECT_EQ(off.get_scale(), 1.0);
}

TEST(GradScaler, AnOutOfMemoryInTheStepChangesNoParameterAndTheStepCanBeTriedAgain) {
  // LibTorch's AdamW allocates as it steps (its state at the first step): under budgets rising by 64 KiB,
  // each scaler step either runs whole or changes no parameter, and the one that fits is the step the first
  // try would have been.
  install_meter();
  torch::manual_seed(0);
  std::vector<torch::Tensor> params{torch::randn({256, 256}), torch::randn({1024, 256}), torch::randn({64})};
  for (auto& p : params) p.requires_grad_();
  std::vector<torch::Tensor> reference;
  for (const auto& p : params) reference.push_back(p.detach().clone().requires_grad_());
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW ref(reference, torch::optim::AdamWOptions(1e-2));
  GradScaler scaler, plain;
  auto loss = [](const std::vector<torch::Tensor>& ps) {
    torch::Tensor sum = torch::zeros({});
    for (const auto& p : ps) sum = sum + (p * p).sum();
    return sum;
  };
  scaler.scale(loss(params)).backward();
  plain.scale(loss(reference)).backward();
  int failed = 0;
  for (int64_t slack = 0;; slack += 64 << 10) {
    ASSERT_LT(slack, int64_t{16} << 20) << "no budget fitted";
    std::vector<torch::Tensor> before;
    for (const auto& p : params) before.push_back(p.detach().clone());
    try {
      ScopedBudget budget(torch::kCPU, memory_stats(torch::kCPU).current + slack);
      EXPECT_TRUE(scaler.step(opt));
      break;
    } catch (const c10::OutOfMemoryError&) {
      ++failed;
    }
    for (size_t i = 0; i < params.size(); ++i)
      ASSERT_TRUE(torch::equal(before[i], params[i])) << "parameter " << i << ", slack " << slack;
  }
  EXPECT_GT(failed, 0);
  EXPECT_TRUE(plain.step(ref));
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], reference[i])) << i;

  // Byte by byte around a later step of small tensors, whose scalars come from the same pool on the CPU.
  std::vector<torch::Tensor> small{torch::randn({100}), torch::randn({100})};
  for (auto& p : small) p.requires_grad_();
  torch::optim::AdamW small_opt(small, torch::optim::AdamWOptions(1e-2));
  GradScaler off(GradScalerOptions().enabled(false));
  for (auto& p : small) p.mutable_grad() = torch::randn({100});
  off.step(small_opt);
  for (int64_t slack = 0;; ++slack) {
    ASSERT_LT(slack, 4096) << "no budget fitted";
    std::vector<torch::Tensor> before;
    for (const auto& t : small) before.push_back(t.detach().clone());
    for (const auto& t : optimizer_state_tensors(small_opt)) before.push_back(t.clone());
    try {
      ScopedBudget budget(torch::kCPU, memory_stats(torch::kCPU).current + slack);
      off.step(small_opt);
      break;
    } catch (const c10::OutOfMemoryError&) {
    }
    std::vector<torch::Tensor> after;
    for (const auto& t : small) after.push_back(t.detach());
    for (const auto& t : optimizer_state_tensors(small_opt)) after.push_back(t);
    for (size_t i = 0; i < before.size(); ++i)
      ASSERT_TRUE(torch::equal(before[i], after[i])) << "tensor " << i << ", slack " << slack;
  }
}

TEST(GradScaler, DisabledPassesThrough) {
  auto p = torch::ones({4}).requires_grad_();
  torch::optim::SGD opt(std::vector<torch::Tensor>{p}, torch::optim::SGDOptions(0.5));
  GradScaler scaler(GradScalerOptions().enabled(false));
  const auto loss = p.sum();
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  loss.backward();
  EXPECT_TRUE(scaler.step(opt));
  scaler.update();
  EXPECT_TRUE(torch::equal(p.detach(), torch::full({4}, 0.5f)));
  EXPECT_EQ(scaler.get_scale(), 1.0);
}

TEST(Autocast, RunsMatmulsInBFloat16OnTheCpuAndRestoresTheState) {
  const auto a = torch::randn({8, 8}), b = torch::randn({8, 8});
  EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kFloat);
  {
    Autocast outer(torch::kCPU, torch::kBFloat16);
    const auto y = torch::mm(a, b);
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
    // losses stay in fp32 (autocast's CPU fp32 list)
    const auto target = torch::randint(8, {8}, torch::kLong);
    EXPECT_EQ(torch::nn::functional::cross_entropy(y, target).scalar_type(), torch::kFloat);
    EXPECT_EQ(torch::mse_loss(y, a).scalar_type(), torch::kFloat);
    {
      Autocast inner(torch::kCPU, torch::kBFloat16, /*enabled=*/false);
      EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kFloat);
    }
    EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kBFloat16);
  }
  EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kFloat);
  EXPECT_THROW(Autocast(torch::kCPU, torch::kFloat), c10::Error);
  EXPECT_THROW(Autocast(torch::kMeta, torch::kBFloat16), c10::Error);
}

TEST(Autocast, RunsFp16OnTheCpuAsTheExplicitCastsDo) {
  // LibTorch's CPU autocast takes fp16 as well (for recipes meant for CUDA cards without bf16, tried on the
  // CPU): a Linear computes in fp16 what it computes on inputs cast by hand, and a loss stays fp32.
  torch::manual_seed(0);
  torch::nn::Linear linear(64, 32);
  const auto x = torch::randn({16, 64});
  const auto target = torch::randint(32, {16}, torch::kLong);
  const auto by_hand = torch::nn::functional::linear(x.to(torch::kHalf), linear->weight.to(torch::kHalf),
                                                     linear->bias.to(torch::kHalf));
  {
    Autocast fp16(torch::kCPU, torch::kHalf);
    const auto y = linear(x);
    EXPECT_EQ(y.scalar_type(), torch::kHalf);
    EXPECT_TRUE(torch::equal(y, by_hand));
    const auto loss = torch::nn::functional::cross_entropy(y, target);
    EXPECT_EQ(loss.scalar_type(), torch::kFloat);
    EXPECT_TRUE(torch::equal(loss, torch::nn::functional::cross_entropy(by_hand.to(torch::kFloat), target)));
    {
      Autocast bf16(torch::kCPU, torch::kBFloat16);
      EXPECT_EQ(linear(x).scalar_type(), torch::kBFloat16);
    }
    EXPECT_EQ(linear(x).scalar_type(), torch::kHalf);  // the inner guard restored fp16
  }
  EXPECT_EQ(linear(x).scalar_type(), torch::kFloat);
}

/// Two twins trained with a GradScaler: `fused` lets the scaler fuse the unscale into AdamW8bit's kernels,
/// the other calls unscale_ first (LibTorch's unscale pass, then the kernel).
struct ScaledRun {
  torch::nn::Sequential net;
  std::unique_ptr<optim::AdamW8bit> opt;
  GradScaler scaler{GradScalerOptions().init_scale(1024).fuse_unscale(FuseUnscale::kAlways)};

  ScaledRun() {
    torch::manual_seed(0);
    net = torch::nn::Sequential(torch::nn::Linear(64, 96), torch::nn::Tanh(), torch::nn::Linear(96, 4));
    opt = std::make_unique<optim::AdamW8bit>(net->parameters(),
                                             optim::AdamW8bitOptions(1e-2).min_8bit_size(1000));
  }
  bool step(bool fused, int seed, float poison = 1.0f) {
    torch::manual_seed(seed);
    const auto x = torch::randn({16, 64}), y = torch::randint(4, {16});
    opt->zero_grad();
    scaler.scale(torch::nn::functional::cross_entropy(net->forward(x), y) * poison).backward();
    if (!fused) scaler.unscale_(*opt);
    const bool stepped = scaler.step(*opt);
    scaler.update();
    return stepped;
  }
};

TEST(GradScaler, FusedUnscaleIsBitIdenticalToTheUnscalePass) {
  ScaledRun fused, plain;
  for (int s = 0; s < 6; ++s) {
    EXPECT_TRUE(fused.step(true, s));
    EXPECT_TRUE(plain.step(false, s));
  }
  const auto a = fused.net->parameters(), b = plain.net->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::equal(a[i], b[i])) << i;
    const auto sa = fused.opt->state_fp32(a[i]), sb = plain.opt->state_fp32(b[i]);
    for (size_t j = 0; j < sa.size(); ++j) EXPECT_TRUE(torch::equal(sa[j], sb[j])) << i << "/" << j;
    // No pass rewrote the fused run's gradients: they are still the scaled ones, 1024 × the plain run's.
    EXPECT_TRUE(torch::allclose(a[i].grad(), b[i].grad() * 1024, 1e-6, 0)) << i;
  }
}

TEST(GradScaler, AFusedStepTheOptimizerRefusesCanBeTriedAgain) {
  ScaledRun run, twin;
  EXPECT_TRUE(run.step(true, 0));
  EXPECT_TRUE(twin.step(true, 0));
  EXPECT_TRUE(twin.step(true, 1));

  torch::manual_seed(1);  // run.step(true, 1), with a gradient the optimizer refuses before the step
  const auto x = torch::randn({16, 64}), y = torch::randint(4, {16});
  run.opt->zero_grad();
  run.scaler.scale(torch::nn::functional::cross_entropy(run.net->forward(x), y)).backward();
  torch::Tensor weight = run.net->parameters()[0];
  const torch::Tensor grad = weight.grad();
  weight.mutable_grad() = grad.to(torch::kDouble);
  EXPECT_THROW(run.scaler.step(*run.opt), c10::Error);
  weight.mutable_grad() = grad;
  EXPECT_TRUE(run.scaler.step(*run.opt));
  run.scaler.update();

  EXPECT_EQ(run.scaler.get_scale(), twin.scaler.get_scale());
  const auto a = run.net->parameters(), b = twin.net->parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << i;
}

TEST(GradScaler, FusedStepSkipsOnInfOrNaNAndChangesNothing) {
  ScaledRun run;
  EXPECT_TRUE(run.step(true, 0));  // creates the state
  for (const float poison :
       {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<torch::Tensor> params, state;
    for (const auto& p : run.net->parameters()) {
      params.push_back(p.detach().clone());
      for (const auto& t : run.opt->state_fp32(p)) state.push_back(t);
    }
    const double scale = run.scaler.get_scale();
    EXPECT_FALSE(run.step(true, 1, poison));
    EXPECT_EQ(run.scaler.get_scale(), scale / 2);
    size_t k = 0, j = 0;
    for (const auto& p : run.net->parameters()) {
      EXPECT_TRUE(torch::equal(p, params[k++]));
      for (const auto& t : run.opt->state_fp32(p)) EXPECT_TRUE(torch::equal(t, state[j++]));
    }
  }
}

}  // namespace
}  // namespace memsave::amp
