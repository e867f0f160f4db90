#include <memsave/accumulate.h>
#include <memsave/checkpoint.h>
#include <memsave/memory.h>
#include <memsave/offload.h>
#include <memsave/optim.h>
#include <memsave/trainer.h>

#include "zoo/zoo.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace memsave {
namespace {

namespace tnn = torch::nn;
namespace F = torch::nn::functional;

tnn::Sequential model() {
  torch::manual_seed(0);
  return tnn::Sequential(tnn::Linear(64, 128), tnn::Tanh(), tnn::Linear(128, 128), tnn::Tanh(),
                         tnn::Linear(128, 8));
}

/// `steps` steps of `opt` on `net` with a fixed stream of batches.
void train(tnn::Sequential& net, torch::optim::Optimizer& opt, int steps) {
  torch::manual_seed(42);
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    const auto x = torch::randn({32, 64}), y = torch::randint(8, {32});
    F::cross_entropy(net->forward(x), y).backward();
    opt.step();
  }
}

/// The loss the Trainer tests step with.
torch::Tensor ce(const torch::Tensor& out, const torch::Tensor& target) {
  return F::cross_entropy(out, target);
}

void expect_same_parameters(tnn::Sequential& a, tnn::Sequential& b) {
  const auto pa = a->parameters(), pb = b->parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pb[i])) << "parameter " << i;
}

TEST(Offload, HalfPrecisionParametersFollowTheirFp32Masters) {
  // A bf16 model: each parameter is its fp32 master rounded to bf16 after every step, the master stepped
  // with the bf16 gradient widened to fp32; the same whichever way the gradients are copied.
  const auto ways = {OffloadOptimizerOptions(1e-3), OffloadOptimizerOptions(1e-3).copy_during_backward(true),
                     OffloadOptimizerOptions(1e-3).step_during_backward(true)};
  for (const OffloadOptimizerOptions& way : ways) {
    auto net = model();
    net->to(torch::kBFloat16);
    std::vector<torch::Tensor> masters;
    for (const auto& p : net->parameters()) masters.push_back(p.detach().to(torch::kFloat).requires_grad_());
    OffloadOptimizer opt(net->parameters(), OffloadOptimizerOptions(way).state_bits(8));
    optim::AdamW8bit reference(masters, optim::AdamW8bitOptions(1e-3));
    torch::manual_seed(42);
    for (int s = 0; s < 4; ++s) {
      opt.zero_grad();
      const auto x = torch::randn({32, 64}).to(torch::kBFloat16), y = torch::randint(8, {32});
      F::cross_entropy(net->forward(x).to(torch::kFloat), y).backward();
      opt.step();
      for (size_t i = 0; i < masters.size(); ++i)
        masters[i].mutable_grad() = net->parameters()[i].grad().to(torch::kFloat);
      reference.step();
      for (size_t i = 0; i < masters.size(); ++i) {
        EXPECT_EQ(net->parameters()[i].scalar_type(), torch::kBFloat16);
        EXPECT_TRUE(torch::equal(net->parameters()[i], masters[i].detach().to(torch::kBFloat16)))
            << "step " << s << ", parameter " << i << (way.step_during_backward() ? ", stepped during" : "");
      }
    }
  }
}

TEST(Offload, StepIsBitIdenticalToTheSameKernelOnTheDevice) {
  for (const auto& [bits, during_backward] : {std::pair(32, false), std::pair(8, false), std::pair(4, false),
                                              std::pair(32, true), std::pair(8, true), std::pair(4, true)}) {
    SCOPED_TRACE(std::to_string(bits) + (during_backward ? " bits, copies during the backward" : " bits"));
    auto on_device = model(), offloaded = model();
    // The on-device reference: the same fused kernel (AdamW8bit, or AdamW4bit; fp32 state when nothing is
    // quantized).
    std::unique_ptr<torch::optim::Optimizer> reference;
    if (bits == 4) {
      reference = std::make_unique<optim::AdamW4bit>(on_device->parameters(), optim::AdamW4bitOptions(1e-3));
    } else {
      reference = std::make_unique<optim::AdamW8bit>(
          on_device->parameters(), optim::AdamW8bitOptions(1e-3).min_8bit_size(
                                       bits == 8 ? 4096 : std::numeric_limits<int64_t>::max()));
    }
    OffloadOptimizer opt(
        offloaded->parameters(),
        OffloadOptimizerOptions(1e-3).state_bits(bits).copy_during_backward(during_backward));
    train(on_device, *reference, 50);
    train(offloaded, opt, 50);
    expect_same_parameters(on_device, offloaded);
  }
}

/// Two parameter groups of four tensors: group 0 decays, group 1 does not and has its own lr and betas.
struct TwoGroups {
  using Group = torch::optim::OptimizerParamGroup;
  std::vector<torch::Tensor> a, b;  // a: 5120 (8-bit state) and 50 elements; b: 4900 and 30
  TwoGroups() {
    torch::manual_seed(5);
    a = {torch::randn({64, 80}).requires_grad_(), torch::randn({50}).requires_grad_()};
    b = {torch::randn({70, 70}).requires_grad_(), torch::randn({30}).requires_grad_()};
  }
  TwoGroups(const TwoGroups& other) {
    for (const auto& p : other.a) a.push_back(p.detach().clone().requires_grad_());
    for (const auto& p : other.b) b.push_back(p.detach().clone().requires_grad_());
  }
  std::vector<torch::Tensor> all() const { return {a[0], a[1], b[0], b[1]}; }
  /// min_offload_size 40: b[1] stays in the device's AdamW.
  std::unique_ptr<OffloadOptimizer> offload(int64_t bits) const {
    const auto storage = OffloadOptimizerOptions(1e-2).state_bits(bits).min_offload_size(40);
    return std::make_unique<OffloadOptimizer>(
        std::vector<Group>{
            Group(a, std::make_unique<OffloadOptimizerOptions>(
                         OffloadOptimizerOptions(storage).weight_decay(0.1))),
            Group(b, std::make_unique<OffloadOptimizerOptions>(
                         OffloadOptimizerOptions(storage).lr(3e-3).weight_decay(0).betas({0.8, 0.95})))},
        storage);
  }
  void gradients(int t) const {
    const auto ps = all();
    for (size_t i = 0; i < ps.size(); ++i) {
      torch::Generator gen = at::detail::createCPUGenerator(100 * t + i);
      ps[i].mutable_grad() = torch::randn(ps[i].sizes(), gen);
    }
  }
};

TEST(Offload, ParameterGroupsStepWithTheirOwnHyperParameters) {
  // The same groups stepped on the device by the same kernels: memsave's AdamW8bit (or AdamW4bit; fp32 state
  // when nothing is quantized) for what is offloaded, LibTorch's AdamW for the tensor left on the device. A
  // schedule that changes group 1's lr halfway changes it in both.
  using Group = torch::optim::OptimizerParamGroup;
  for (const int64_t bits : {32, 8, 4}) {
    SCOPED_TRACE(std::to_string(bits) + " bits");
    const TwoGroups offloaded, reference(offloaded);
    auto opt = offloaded.offload(bits);
    std::unique_ptr<optim::LowBitOptimizer> host;
    const auto host_options = [&](double lr, double weight_decay, optim::betas_t betas) {
      std::unique_ptr<torch::optim::OptimizerOptions> o;
      if (bits == 4) {
        o = std::make_unique<optim::AdamW4bitOptions>(
            optim::AdamW4bitOptions(lr).weight_decay(weight_decay).betas(betas));
      } else {
        o = std::make_unique<optim::AdamW8bitOptions>(
            optim::AdamW8bitOptions(lr)
                .weight_decay(weight_decay)
                .betas(betas)
                .min_8bit_size(bits == 8 ? 4096 : std::numeric_limits<int64_t>::max()));
      }
      return o;
    };
    const std::vector<Group> host_groups = {Group(reference.a, host_options(1e-2, 0.1, {0.9, 0.999})),
                                            Group({reference.b[0]}, host_options(3e-3, 0, {0.8, 0.95}))};
    if (bits == 4) {
      host = std::make_unique<optim::AdamW4bit>(host_groups);
    } else {
      host = std::make_unique<optim::AdamW8bit>(host_groups);
    }
    torch::optim::AdamW device({reference.b[1]},
                               torch::optim::AdamWOptions(3e-3).weight_decay(0).betas({0.8, 0.95}));
    for (int t = 0; t < 6; ++t) {
      if (t == 3) {
        opt->param_groups()[1].options().set_lr(1e-3);
        host->param_groups()[1].options().set_lr(1e-3);
        device.param_groups()[0].options().set_lr(1e-3);
      }
      offloaded.gradients(t);
      reference.gradients(t);
      opt->step();
      host->step();
      device.step();
    }
    const auto got = offloaded.all(), expected = reference.all();
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_TRUE(torch::equal(got[i], expected[i])) << "parameter " << i;
    EXPECT_EQ(opt->param_groups()[1].options().get_lr(), 1e-3);
    EXPECT_EQ(opt->options().weight_decay(), 0.1);  // the first group's

    // Saved and loaded group by group: a copy steps on as the original does.
    std::stringstream file;
    {
      torch::serialize::OutputArchive out;
      opt->save(out);
      out.save_to(file);
    }
    const TwoGroups copy(offloaded);
    auto resumed = copy.offload(bits);
    {
      torch::serialize::InputArchive in;
      in.load_from(file);
      resumed->load(in);
    }
    EXPECT_EQ(resumed->param_groups()[1].options().get_lr(), 1e-3);
    // copy_state reads and writes group by group too.
    const TwoGroups converted_params(offloaded);
    auto converted = converted_params.offload(bits);
    optim::copy_state(*opt, *converted);
    converted->param_groups()[1].options().set_lr(1e-3);
    for (int t = 6; t < 8; ++t) {
      for (const TwoGroups* g : {&offloaded, &copy, &converted_params}) g->gradients(t);
      opt->step();
      resumed->step();
      converted->step();
    }
    const auto resumed_params = copy.all(), converted_all = converted_params.all(),
               original = offloaded.all();
    for (size_t i = 0; i < original.size(); ++i) {
      EXPECT_TRUE(torch::equal(resumed_params[i], original[i])) << "resumed, parameter " << i;
      EXPECT_TRUE(torch::equal(converted_all[i], original[i])) << "converted, parameter " << i;
    }
    // A file of two groups does not load into an optimizer of one, which it leaves as it was.
    OffloadOptimizer one(copy.all(), OffloadOptimizerOptions(1e-2).state_bits(bits).min_offload_size(40));
    torch::serialize::InputArchive in;
    file.seekg(0);
    in.load_from(file);
    try {
      one.load(in);
      ADD_FAILURE() << "no error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(
                    "the file's parameter groups hold [2, 2] parameters, this optimizer's [4]"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(Offload, GroupsThatWouldKeepTheirStateOtherwiseAreRefused) {
  using Group = torch::optim::OptimizerParamGroup;
  const auto p = torch::zeros({8}, torch::requires_grad()), q = torch::zeros({8}, torch::requires_grad());
  const auto refused = [&](std::unique_ptr<torch::optim::OptimizerOptions> second,
                           const std::string& message) {
    std::vector<Group> groups = {Group({p}), Group({q}, std::move(second))};
    try {
      OffloadOptimizer opt(groups, OffloadOptimizerOptions(1e-2).state_bits(8));
      ADD_FAILURE() << "no error for " << message;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  };
  refused(std::make_unique<OffloadOptimizerOptions>(OffloadOptimizerOptions(1e-2).state_bits(4)),
          "parameter group 1 keeps its state otherwise than group 0 (state_bits 4 and 8");
  refused(std::make_unique<OffloadOptimizerOptions>(
              OffloadOptimizerOptions(1e-2).state_bits(8).min_offload_size(4)),
          "min_offload_size 4 and 0");
  refused(std::make_unique<torch::optim::AdamWOptions>(1e-2),
          "parameter group 1 has the options of another optimizer");
  refused(std::make_unique<OffloadOptimizerOptions>(OffloadOptimizerOptions(-1).state_bits(8)),
          "invalid learning rate: -1");
  // A schedule that gives one group other storage options is refused at the step, which changes nothing.
  OffloadOptimizer opt(std::vector<Group>{Group({p}), Group({q})},
                       OffloadOptimizerOptions(1e-2).state_bits(8));
  static_cast<OffloadOptimizerOptions&>(opt.param_groups()[1].options()).state_bits(32);
  p.mutable_grad() = torch::ones({8});
  q.mutable_grad() = torch::ones({8});
  EXPECT_THROW(opt.step(), c10::Error);
  EXPECT_TRUE(torch::equal(p, torch::zeros({8})));
  EXPECT_TRUE(torch::equal(q, torch::zeros({8})));
}

TEST(Offload, FiftyStepsMatchLibTorchsAdamW) {
  auto plain = model(), offloaded = model();
  torch::optim::AdamW reference(plain->parameters(), torch::optim::AdamWOptions(1e-3));
  OffloadOptimizer opt(offloaded->parameters(), OffloadOptimizerOptions(1e-3));
  train(plain, reference, 50);
  train(offloaded, opt, 50);
  const auto a = plain->parameters(), b = offloaded->parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::allclose(a[i], b[i], 1e-4, 1e-6)) << i;
}

TEST(Offload, TheDevicePoolsPeakDropsByTheOptimizerState) {
  install_meter();
  auto peak_of_second_step = [](bool offload) {
    auto net = model();
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (offload)
      opt = std::make_unique<OffloadOptimizer>(net->parameters(), OffloadOptimizerOptions(1e-3));
    else
      opt = std::make_unique<optim::AdamW8bit>(net->parameters(), optim::AdamW8bitOptions(1e-3).min_8bit_size(
                                                                      std::numeric_limits<int64_t>::max()));
    train(net, *opt, 1);  // creates the state
    torch::manual_seed(7);
    const auto x = torch::randn({32, 64}), y = torch::randint(8, {32});
    PeakScope scope(torch::kCPU);
    opt->zero_grad();
    F::cross_entropy(net->forward(x), y).backward();
    opt->step();
    return scope.peak();
  };
  const int64_t params = 64 * 128 + 128 + 128 * 128 + 128 + 128 * 8 + 8;
  const int64_t on_device = peak_of_second_step(false);
  const int64_t offloaded = peak_of_second_step(true);
  // Adam's two fp32 moments are no longer in the device pool: exactly their bytes (the meter does not round).
  EXPECT_EQ(on_device - offloaded, 2 * 4 * params);
}

TEST(Offload, StateLivesInTheHostArena) {
  install_meter();
  auto net = model();
  const int64_t host_before = host_memory_stats().current;
  {
    OffloadOptimizer opt(net->parameters(),
                         OffloadOptimizerOptions(1e-3).state_bits(8).min_offload_size(1000));
    train(net, opt, 1);
    int64_t host_bytes = 0;
    for (const auto& t : opt.host_state_tensors()) host_bytes += t.numel() * t.element_size();
    EXPECT_EQ(host_memory_stats().current - host_before, host_bytes);
    EXPECT_FALSE(opt.offloaded(net->parameters()[1]));  // a bias of 128 elements stays on the device
    EXPECT_TRUE(opt.offloaded(net->parameters()[0]));
    EXPECT_EQ(opt.state_tensors().size(), 3u * 2u);  // the three biases' AdamW moments, on the device
  }
  EXPECT_EQ(host_memory_stats().current, host_before);
}

TEST(Offload, AccumulationMatchesTheFullBatch) {
  auto full = model(), micro = model();
  OffloadOptimizer a(full->parameters(), OffloadOptimizerOptions(1e-2));
  OffloadOptimizer b(micro->parameters(), OffloadOptimizerOptions(1e-2));
  torch::manual_seed(3);
  const auto x = torch::randn({32, 64}), y = torch::randint(8, {32});
  F::cross_entropy(full->forward(x), y).backward();
  a.step();
  GradientAccumulator acc(b, AccumulateOptions().window(4));
  for (const auto& part : split_micro_batches({x, y}, 8))
    acc.backward(F::cross_entropy(micro->forward(part[0]), part[1]), 8);
  // The gradients copied to the host (once per window) are the full batch's, up to float rounding. (The
  // parameters after Adam's first step, ±lr·g/(|g|+eps), would amplify rounding where |g| is tiny.)
  const auto ha = a.host_state_tensors(), hb = b.host_state_tensors();
  for (size_t i = 1; i < 2 * full->parameters().size(); i += 2) {
    const double scale = ha[i].abs().max().item<double>();
    EXPECT_LE((ha[i] - hb[i]).abs().max().item<double>(), 1e-5 * scale) << i;
  }
}

TEST(Offload, GradientsGoToTheHostDuringTheBackwardAndOnlyChangedOnesAgainAtTheStep) {
  auto during = model(), at_step = model();
  OffloadOptimizer a(during->parameters(), OffloadOptimizerOptions(1e-3).copy_during_backward(true));
  OffloadOptimizer b(at_step->parameters(), OffloadOptimizerOptions(1e-3));
  const auto n = static_cast<int64_t>(during->parameters().size());
  torch::manual_seed(6);
  const auto x = torch::randn({32, 64}), y = torch::randint(8, {32});
  for (auto* pair : {&a, &b}) {
    auto& net = pair == &a ? during : at_step;
    pair->zero_grad();
    F::cross_entropy(net->forward(x), y).backward();
    // Changed after the backward copied it: the step must see the new value.
    torch::NoGradGuard no_grad;
    net->parameters()[2].mutable_grad().mul_(0.5);
    pair->step();
  }
  EXPECT_EQ(a.last_step_copies().during_backward, n);
  EXPECT_EQ(a.last_step_copies().at_step, 1);  // the one changed since
  EXPECT_EQ(b.last_step_copies().during_backward, 0);
  EXPECT_EQ(b.last_step_copies().at_step, n);
  expect_same_parameters(during, at_step);
  // A gradient replaced by another tensor is copied again too, and one set to none is not stepped. The one
  // the last step copied has no fingerprint to tell it unchanged: copied again; the rest are not.
  during->parameters()[0].mutable_grad() = during->parameters()[0].grad().clone();
  during->parameters()[1].mutable_grad() = torch::Tensor();
  a.step();
  EXPECT_EQ(a.last_step_copies().during_backward, 0);
  EXPECT_EQ(a.last_step_copies().at_step, 2);
}

/// The loss of `net` on (x, y); with `fail`, its backward throws once the gradients of all but the first
/// layer exist (a hook on the first layer's output), as an out-of-memory halfway through would.
torch::Tensor loss_failing_halfway(tnn::Sequential& net, const torch::Tensor& x, const torch::Tensor& y,
                                   bool fail) {
  torch::Tensor h = x;
  for (size_t i = 0; i < net->size(); ++i) {
    h = net->begin()[static_cast<std::ptrdiff_t>(i)].forward(h);
    if (i == 1 && fail)
      h.register_hook([](const torch::Tensor&) -> torch::Tensor { TORCH_CHECK(false, "injected"); });
  }
  return F::cross_entropy(h, y);
}

TEST(Offload, ABackwardThatThrowsHalfwayLeavesTheFollowingStepsExact) {
  auto during = model(), at_step = model();
  OffloadOptimizer a(during->parameters(), OffloadOptimizerOptions(1e-3).copy_during_backward(true));
  OffloadOptimizer b(at_step->parameters(), OffloadOptimizerOptions(1e-3));
  torch::manual_seed(6);
  const auto x = torch::randn({32, 64}), y = torch::randint(8, {32});
  auto backward = [&](tnn::Sequential& net, bool fail) { loss_failing_halfway(net, x, y, fail).backward(); };
  for (auto* pair : {&a, &b}) {
    auto& net = pair == &a ? during : at_step;
    pair->zero_grad();
    EXPECT_THROW(backward(net, /*fail=*/true), c10::Error);
    EXPECT_FALSE(net->parameters()[0].grad().defined());
    EXPECT_TRUE(net->parameters()[5].grad().defined());
    pair->step();  // on the gradients the failed backward left: the first layer is not stepped
  }
  EXPECT_EQ(a.last_step_copies().during_backward, 4);
  EXPECT_EQ(a.last_step_copies().at_step, 0);
  expect_same_parameters(during, at_step);
  for (auto* pair : {&a, &b}) {  // and a clean step after it
    auto& net = pair == &a ? during : at_step;
    pair->zero_grad();
    backward(net, /*fail=*/false);
    pair->step();
  }
  EXPECT_EQ(a.last_step_copies().during_backward, 6);
  EXPECT_EQ(a.last_step_copies().at_step, 0);
  expect_same_parameters(during, at_step);
}

TEST(Offload, ABackwardThatThrowsWhileSteppingKeepsWhatItSteppedAndTheNextStepsWork) {
  // With step_during_backward the host thread has stepped the four parameters whose gradients were complete
  // when the backward failed: they stay stepped, as an optimizer stepped at the step on the failed backward's
  // gradients would have them. The accumulator gives the window up (discard_backward), and the next windows
  // step during their backward as usual.
  auto during = model(), at_step = model();
  OffloadOptimizer a(during->parameters(), OffloadOptimizerOptions(1e-3).step_during_backward(true));
  OffloadOptimizer b(at_step->parameters(), OffloadOptimizerOptions(1e-3));
  train(during, a, 2);
  train(at_step, b, 2);
  a.zero_grad();  // the accumulator's windows start from no gradients
  GradientAccumulator acc(a);
  torch::manual_seed(6);
  const auto x = torch::randn({32, 64}), y = torch::randint(8, {32});
  EXPECT_THROW(acc.backward(loss_failing_halfway(during, x, y, /*fail=*/true), 32), c10::Error);
  b.zero_grad();
  EXPECT_THROW(loss_failing_halfway(at_step, x, y, /*fail=*/true).backward(), c10::Error);
  EXPECT_FALSE(at_step->parameters()[0].grad().defined());
  b.step();  // the four parameters with gradients
  for (int s = 0; s < 3; ++s) {
    acc.backward(loss_failing_halfway(during, x, y, /*fail=*/false), 32);
    EXPECT_EQ(a.last_step_copies().stepped_during_backward, 6);
    b.zero_grad();
    loss_failing_halfway(at_step, x, y, /*fail=*/false).backward();
    b.step();
  }
  expect_same_parameters(during, at_step);
}

TEST(Offload, TheScalersUnscaleIsSeenByTheCopiesMadeDuringTheBackward) {
  auto during = model(), at_step = model();
  OffloadOptimizer a(during->parameters(), OffloadOptimizerOptions(1e-3).copy_during_backward(true));
  OffloadOptimizer b(at_step->parameters(), OffloadOptimizerOptions(1e-3));
  for (auto* opt : {&a, &b}) {
    auto& net = opt == &a ? during : at_step;
    amp::GradScaler scaler;
    GradientAccumulator acc(*opt, AccumulateOptions(), &scaler);
    torch::manual_seed(9);
    for (int s = 0; s < 3; ++s) {
      const auto x = torch::randn({32, 64}), y = torch::randint(8, {32});
      EXPECT_TRUE(acc.backward(F::cross_entropy(net->forward(x), y), 32)->stepped);
    }
  }
  // unscale_ rewrote every gradient after its copy: all were copied again, and the steps agree.
  EXPECT_EQ(a.last_step_copies().at_step, static_cast<int64_t>(during->parameters().size()));
  expect_same_parameters(during, at_step);
}

TEST(Offload, TheTrainerCopiesGradientsOncePerWindow) {
  for (int64_t micro : {0, 8}) {
    SCOPED_TRACE(micro);
    auto net = model(), reference = model();
    Trainer trainer(net, adamw(1e-3, 0.0), Recipe().offload(Offload::kOptimizerState).micro_batch(micro));
    auto* opt = dynamic_cast<OffloadOptimizer*>(&trainer.optimizer());
    ASSERT_NE(opt, nullptr);
    OffloadOptimizer plain(reference->parameters(), OffloadOptimizerOptions(1e-3).weight_decay(0.0));
    GradientAccumulator acc(plain, AccumulateOptions().window(micro ? 4 : 1));
    const auto n = static_cast<int64_t>(net->parameters().size());
    torch::manual_seed(7);
    for (int s = 0; s < 3; ++s) {
      const auto x = torch::randn({32, 64}), y = torch::randint(8, {32});
      trainer.step(x, y, ce);
      // Four micro-batches, one copy of each gradient: during the last backward, none at the step.
      EXPECT_EQ(opt->last_step_copies().during_backward, n);
      EXPECT_EQ(opt->last_step_copies().at_step, 0);
      for (const auto& part : split_micro_batches({x, y}, micro ? micro : 32))
        acc.backward(F::cross_entropy(reference->forward(part[0]), part[1]),
                     static_cast<double>(part[0].size(0)));
    }
    expect_same_parameters(net, reference);
  }
}

TEST(Offload, AnOptimizerGoneLeavesNoHookBehind) {
  auto net = model();
  torch::manual_seed(8);
  const auto x = torch::randn({32, 64}), y = torch::randint(8, {32});
  { OffloadOptimizer gone(net->parameters(), OffloadOptimizerOptions().copy_during_backward(true)); }
  F::cross_entropy(net->forward(x), y).backward();  // the destroyed optimizer's hooks are not called
  OffloadOptimizer opt(net->parameters(), OffloadOptimizerOptions().copy_during_backward(true));
  for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();
  F::cross_entropy(net->forward(x), y).backward();
  opt.step();
  EXPECT_EQ(opt.last_step_copies().during_backward, static_cast<int64_t>(net->parameters().size()));
  EXPECT_EQ(opt.last_step_copies().at_step, 0);
}

TEST(Offload, SteppingDuringTheBackwardGivesTheSameParameters) {
  for (const int bits : {32, 8}) {
    SCOPED_TRACE(std::to_string(bits) + " bits");
    auto at_step = model(), during = model();
    OffloadOptimizer reference(at_step->parameters(), OffloadOptimizerOptions(1e-3).state_bits(bits));
    OffloadOptimizer opt(during->parameters(),
                         OffloadOptimizerOptions(1e-3).state_bits(bits).step_during_backward(true));
    const auto n = static_cast<int64_t>(during->parameters().size());
    train(at_step, reference, 1);
    train(during, opt, 1);  // the first step creates the state: at the step, all at once
    EXPECT_EQ(opt.last_step_copies().stepped_during_backward, 0);
    // A learning-rate change between steps is what the next backward's steps use.
    static_cast<OffloadOptimizerOptions&>(reference.param_groups().front().options()).lr(5e-4);
    static_cast<OffloadOptimizerOptions&>(opt.param_groups().front().options()).lr(5e-4);
    train(at_step, reference, 20);
    train(during, opt, 20);
    EXPECT_EQ(opt.last_step_copies().stepped_during_backward, n);
    EXPECT_EQ(opt.last_step_copies().at_step, 0);
    expect_same_parameters(at_step, during);
  }
}

TEST(Offload, SteppingDuringTheBackwardOfACheckpointedModel) {
  // A recomputed piece adds its parameters' gradients during its own backward: they are copied and stepped
  // from there, and the piece's backward then hands the outer backward nothing more for them.
  auto at_step = model(), during = model();
  auto checkpointed = nn::checkpoint_sequential(during, 3);
  OffloadOptimizer reference(at_step->parameters(), OffloadOptimizerOptions(1e-3).state_bits(8));
  OffloadOptimizer opt(during->parameters(),
                       OffloadOptimizerOptions(1e-3).state_bits(8).step_during_backward(true));
  torch::manual_seed(42);
  for (int s = 0; s < 6; ++s) {
    const auto x = torch::randn({32, 64}), y = torch::randint(8, {32});
    reference.zero_grad();
    F::cross_entropy(at_step->forward(x), y).backward();
    reference.step();
    opt.zero_grad();
    F::cross_entropy(checkpointed->forward(x), y).backward();
    opt.step();
  }
  EXPECT_EQ(opt.last_step_copies().stepped_during_backward,
            static_cast<int64_t>(during->parameters().size()));
  EXPECT_EQ(opt.last_step_copies().at_step, 0);
  expect_same_parameters(at_step, during);
}

TEST(Offload, SteppingDuringTheBackwardUnderAccumulationNeedsDeferredCopies) {
  auto at_step = model(), during = model();
  OffloadOptimizer reference(at_step->parameters(), OffloadOptimizerOptions(1e-3));
  OffloadOptimizer opt(during->parameters(), OffloadOptimizerOptions(1e-3).step_during_backward(true));
  torch::manual_seed(9);
  const auto x = torch::randn({32, 64}), y = torch::randint(8, {32});
  auto window = [&](tnn::Sequential& net, OffloadOptimizer& o, bool defer) {
    o.zero_grad();
    for (int micro = 0; micro < 2; ++micro) {
      o.defer_gradient_copies(defer && micro == 0);
      F::cross_entropy(net->forward(x.narrow(0, 16 * micro, 16)), y.narrow(0, 16 * micro, 16)).backward();
    }
    o.step();
  };
  for (int s = 0; s < 3; ++s) {
    window(at_step, reference, /*defer=*/true);
    window(during, opt, /*defer=*/true);
  }
  EXPECT_EQ(opt.last_step_copies().stepped_during_backward,
            static_cast<int64_t>(during->parameters().size()));
  expect_same_parameters(at_step, during);
  // Without deferring, the first micro-batch's backward steps the parameters: the second one's gradients
  // arrive too late, which the step reports. (Or the second backward itself fails first: when the host
  // thread is slow, it steps a parameter in place after the second forward saved it for the backward.)
  EXPECT_THROW(window(during, opt, /*defer=*/false), c10::Error);
  opt.discard_backward();               // as after any failed window
  window(during, opt, /*defer=*/true);  // and the optimizer goes on
  EXPECT_EQ(opt.last_step_copies().stepped_during_backward,
            static_cast<int64_t>(during->parameters().size()));
}

TEST(Offload, SteppingDuringTheBackwardRefusesGradientChangesAfterIt) {
  auto net = model();
  OffloadOptimizer opt(net->parameters(), OffloadOptimizerOptions(1e-3).step_during_backward(true));
  train(net, opt, 2);
  torch::manual_seed(10);
  const auto x = torch::randn({32, 64}), y = torch::randint(8, {32});
  opt.zero_grad();
  F::cross_entropy(net->forward(x), y).backward();
  {
    torch::NoGradGuard no_grad;
    net->parameters()[0].mutable_grad().mul_(0.5);  // as a clipping would, after the parameter was stepped
  }
  EXPECT_THROW(opt.step(), c10::Error);
  // What would change the gradients after the backward refuses such an optimizer up front.
  amp::GradScaler scaler;
  EXPECT_THROW(GradientAccumulator(opt, AccumulateOptions().max_grad_norm(1.0)), c10::Error);
  EXPECT_THROW(GradientAccumulator(opt, AccumulateOptions(), &scaler), c10::Error);
  opt.zero_grad();
  scaler.scale(F::cross_entropy(net->forward(x), y)).backward();
  EXPECT_THROW(scaler.unscale_(opt), c10::Error);
}

TEST(Offload, TheAccumulatorStepsDuringTheLastBackwardOfAWindow) {
  // Windows of unequal micro-batches announced by begin_window, full fixed windows, and a shorter window
  // closed by step(): the same parameters as the optimizer stepped at the step. The last backward of a
  // complete window steps every parameter (the accumulator defers the copies of the micro-batches before it);
  // the shorter window, whose gradients the step corrects, is stepped at the step.
  auto at_step = model(), during = model();
  OffloadOptimizer reference(at_step->parameters(), OffloadOptimizerOptions(1e-3).state_bits(8));
  OffloadOptimizer opt(during->parameters(),
                       OffloadOptimizerOptions(1e-3).state_bits(8).step_during_backward(true));
  GradientAccumulator reference_acc(reference, AccumulateOptions().window(3));
  GradientAccumulator acc(opt, AccumulateOptions().window(3));
  const auto n = static_cast<int64_t>(during->parameters().size());
  torch::manual_seed(11);
  const auto x = torch::randn({32, 64}), y = torch::randint(8, {32});
  auto micro = [&](tnn::Sequential& net, GradientAccumulator& a, int64_t start, int64_t rows) {
    return a.backward(F::cross_entropy(net->forward(x.narrow(0, start, rows)), y.narrow(0, start, rows)),
                      static_cast<double>(rows));
  };
  auto announced = [&](tnn::Sequential& net, GradientAccumulator& a) {  // 12 + 12 + 8 items
    a.begin_window(32);
    micro(net, a, 0, 12);
    micro(net, a, 12, 12);
    EXPECT_TRUE(micro(net, a, 24, 8).has_value());
  };
  auto full = [&](tnn::Sequential& net, GradientAccumulator& a) {  // 3 × 10 items
    micro(net, a, 0, 10);
    micro(net, a, 10, 10);
    EXPECT_TRUE(micro(net, a, 20, 10).has_value());
  };
  auto shorter = [&](tnn::Sequential& net, GradientAccumulator& a) {  // 20 of the 30 expected
    micro(net, a, 0, 10);
    micro(net, a, 10, 10);
    a.step();
  };
  announced(at_step, reference_acc);
  announced(during, acc);  // the first step creates the state, at the step
  for (int s = 0; s < 2; ++s) {
    announced(at_step, reference_acc);
    announced(during, acc);
    EXPECT_EQ(opt.last_step_copies().stepped_during_backward, n);
    EXPECT_EQ(opt.last_step_copies().during_backward, n) << "the micro-batches before the last copy nothing";
    full(at_step, reference_acc);
    full(during, acc);
    EXPECT_EQ(opt.last_step_copies().stepped_during_backward, n);
    shorter(at_step, reference_acc);
    shorter(during, acc);
    EXPECT_EQ(opt.last_step_copies().stepped_during_backward, 0);
    EXPECT_EQ(opt.last_step_copies().at_step, n);
  }
  expect_same_parameters(at_step, during);
  // A micro-batch after the window's items are complete, and stepped, is refused before it changes anything.
  reference_acc.begin_window(16);
  micro(at_step, reference_acc, 0, 16);
  reference_acc.step();
  acc.begin_window(16);
  micro(during, acc, 0, 16);
  EXPECT_THROW(micro(during, acc, 16, 8), c10::Error);
  EXPECT_EQ(acc.pending(), 1);
  acc.step();
  expect_same_parameters(at_step, during);
}

TEST(Offload, TheTrainerStepsDuringTheBackwardWithAnOptimizerThatDoes) {
  // (memsave::adamw never turns step_during_backward on: a hand-built optimizer.)
  auto net = model(), reference = model();
  auto opt = std::make_shared<OffloadOptimizer>(
      net->parameters(), OffloadOptimizerOptions(1e-3).weight_decay(0.0).step_during_backward(true));
  Trainer trainer(net, opt, Recipe().offload(Offload::kOptimizerState).micro_batch(12));  // 12 + 12 + 8
  Trainer plain(reference, adamw(1e-3, 0.0), Recipe().offload(Offload::kOptimizerState).micro_batch(12));
  EXPECT_FALSE(dynamic_cast<OffloadOptimizer&>(plain.optimizer()).options().step_during_backward());
  const auto n = static_cast<int64_t>(net->parameters().size());
  torch::manual_seed(12);
  for (int s = 0; s < 4; ++s) {
    const auto x = torch::randn({32, 64}), y = torch::randint(8, {32});
    trainer.step(x, y, ce);
    plain.step(x, y, ce);
    EXPECT_EQ(opt->last_step_copies().stepped_during_backward, s > 0 ? n : 0);
  }
  expect_same_parameters(net, reference);
  // Clipping and scaling change the gradients after the backward: such recipes refuse the optimizer.
  EXPECT_THROW(Trainer(net, opt, Recipe().offload(Offload::kOptimizerState).max_grad_norm(1.0)), c10::Error);
  EXPECT_THROW(Trainer(net, opt, Recipe().offload(Offload::kOptimizerState).grad_scaling(GradScaling::kOn)),
               c10::Error);
}

TEST(Offload, AScalerSkipLeavesParametersAndHostStateUnchanged) {
  auto net = model();
  OffloadOptimizer opt(net->parameters(),
                       OffloadOptimizerOptions(1e-3).state_bits(8).copy_during_backward(true));
  amp::GradScaler scaler;
  GradientAccumulator acc(opt, AccumulateOptions(), &scaler);
  torch::manual_seed(4);
  const auto x = torch::randn({32, 64}), y = torch::randint(8, {32});
  acc.backward(F::cross_entropy(net->forward(x), y), 32);  // a clean step creates the state
  std::vector<torch::Tensor> params, state;
  for (const auto& p : net->parameters()) params.push_back(p.clone());
  for (const auto& t : opt.host_state_tensors()) state.push_back(t.clone());
  const auto result =
      acc.backward(F::cross_entropy(net->forward(x), y) * std::numeric_limits<float>::quiet_NaN(), 32);
  ASSERT_TRUE(result.has_value());
  EXPECT_FALSE(result->stepped);
  const auto now = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], now[i]));
  const auto host = opt.host_state_tensors();
  // The gradient buffers (every second of the first 2n tensors) are scratch; masters and state must not move.
  for (size_t i = 0; i < host.size(); ++i) {
    if (i < 2 * params.size() && i % 2 == 1) continue;
    EXPECT_TRUE(torch::equal(state[i], host[i])) << i;
  }
}

TEST(Offload, ClippingSeesTheTrueGradients) {
  for (bool during_backward : {false, true}) {
    SCOPED_TRACE(during_backward);
    auto on_device = model(), offloaded = model();
    optim::AdamW8bit reference(on_device->parameters(), optim::AdamW8bitOptions(1e-3).min_8bit_size(
                                                            std::numeric_limits<int64_t>::max()));
    OffloadOptimizer opt(offloaded->parameters(),
                         OffloadOptimizerOptions(1e-3).copy_during_backward(during_backward));
    auto clipped_training = [](tnn::Sequential& net, torch::optim::Optimizer& optimizer) {
      GradientAccumulator acc(optimizer, AccumulateOptions().max_grad_norm(0.05));
      torch::manual_seed(5);
      for (int s = 0; s < 5; ++s) {
        const auto x = torch::randn({32, 64}), y = torch::randint(8, {32});
        acc.backward(F::cross_entropy(net->forward(x), y), 32);
      }
    };
    clipped_training(on_device, reference);
    clipped_training(offloaded, opt);
    expect_same_parameters(on_device, offloaded);
  }
}

TEST(Offload, GradientsChangedThroughDataAreCopiedAgain) {
  // LibTorch's clip_grad_norm_ and clip_grad_value_ write the gradients through .data(), which their version
  // counters do not see: the fingerprints do, and the step copies those gradients again instead of using the
  // unclipped copies of the backward. The reference copies at the step.
  enum class Clip { kNorm, kValue, kNone };
  for (const Clip clip : {Clip::kNorm, Clip::kValue, Clip::kNone}) {
    for (int bits : {32, 8}) {
      SCOPED_TRACE(std::to_string(static_cast<int>(clip)) + " " + std::to_string(bits));
      auto during = model(), at_step = model();
      OffloadOptimizer a(during->parameters(),
                         OffloadOptimizerOptions(1e-3).state_bits(bits).copy_during_backward(true));
      OffloadOptimizer b(at_step->parameters(), OffloadOptimizerOptions(1e-3).state_bits(bits));
      const auto n = static_cast<int64_t>(during->parameters().size());
      for (auto* opt : {&a, &b}) {
        auto& net = opt == &a ? during : at_step;
        torch::manual_seed(8);
        for (int s = 0; s < 4; ++s) {
          const auto x = torch::randn({32, 64}), y = torch::randint(8, {32});
          opt->zero_grad();
          F::cross_entropy(net->forward(x), y).backward();
          if (clip == Clip::kNorm) {
            ASSERT_GT(torch::nn::utils::clip_grad_norm_(net->parameters(), 0.05), 0.05);  // it clips
          } else if (clip == Clip::kValue) {
            torch::nn::utils::clip_grad_value_(net->parameters(), 1e-5);
          }
          opt->step();
        }
      }
      EXPECT_EQ(a.last_step_copies().during_backward, n);
      EXPECT_EQ(a.last_step_copies().at_step, clip == Clip::kNone ? 0 : n);  // only the clipped ones again
      expect_same_parameters(during, at_step);
    }
  }
  // With step_during_backward the parameters are stepped already: a clip after the backward is an error at
  // the step.
  auto net = model();
  OffloadOptimizer opt(net->parameters(), OffloadOptimizerOptions(1e-3).step_during_backward(true));
  train(net, opt, 2);
  opt.zero_grad();
  F::cross_entropy(net->forward(torch::randn({32, 64})), torch::randint(8, {32})).backward();
  torch::nn::utils::clip_grad_norm_(net->parameters(), 1e-3);
  EXPECT_THROW(opt.step(), c10::Error);
}

void expect_save_and_load_resume_exactly(int bits) {
  auto straight = model(), resumed = model();
  OffloadOptimizer a(straight->parameters(),
                     OffloadOptimizerOptions(1e-3).state_bits(bits).min_offload_size(1000));
  train(straight, a, 3);
  std::stringstream file;
  {
    torch::serialize::OutputArchive archive;
    a.save(archive);
    archive.save_to(file);
  }
  OffloadOptimizer b(resumed->parameters(),
                     OffloadOptimizerOptions(1e-3).state_bits(bits).min_offload_size(1000));
  {
    // The model is saved and loaded on its own, as with any optimizer: here, copied.
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < straight->parameters().size(); ++i)
      resumed->parameters()[i].copy_(straight->parameters()[i]);
  }
  torch::serialize::InputArchive archive;
  archive.load_from(file);
  b.load(archive);
  expect_same_parameters(straight, resumed);
  train(straight, a, 3);
  train(resumed, b, 3);
  expect_same_parameters(straight, resumed);

  // A file for other parameters changes nothing.
  auto other = tnn::Sequential(tnn::Linear(3, 3));
  OffloadOptimizer c(other->parameters());
  std::stringstream file2;
  torch::serialize::OutputArchive out;
  c.save(out);
  out.save_to(file2);
  torch::serialize::InputArchive in;
  in.load_from(file2);
  const auto before = resumed->parameters()[0].clone();
  EXPECT_THROW(b.load(in), c10::Error);
  EXPECT_TRUE(torch::equal(before, resumed->parameters()[0]));
}

TEST(Offload, ChannelsLastWeightsKeepTheirLayoutOnTheHost) {
  // A channels_last weight's master and gradient buffer lie as it does, so its state follows the same memory
  // order as the on-device optimizers' (QuantizedParamState::strides): the steps agree bit for bit, and the
  // state passes between them as it is.
  const auto channels_last = torch::MemoryFormat::ChannelsLast;
  for (const int bits : {8, 4}) {
    SCOPED_TRACE(std::to_string(bits) + "-bit state");
    torch::manual_seed(3);
    const auto values = torch::randn({64, 32, 3, 3});
    auto offloaded = values.contiguous(channels_last).requires_grad_();
    auto on_device = values.contiguous(channels_last).requires_grad_();
    OffloadOptimizer opt({offloaded}, OffloadOptimizerOptions(1e-3).state_bits(bits));
    const auto make = [bits](const torch::Tensor& p) -> std::unique_ptr<optim::LowBitOptimizer> {
      if (bits == 4) return std::make_unique<optim::AdamW4bit>(std::vector<torch::Tensor>{p});
      return std::make_unique<optim::AdamW8bit>(std::vector<torch::Tensor>{p});
    };
    const auto reference = make(on_device);
    for (int t = 0; t < 5; ++t) {
      const auto g = torch::randn(values.sizes()).contiguous(channels_last);
      offloaded.mutable_grad() = g.clone();
      on_device.mutable_grad() = g.clone();
      opt.step();
      reference->step();
    }
    EXPECT_TRUE(torch::equal(offloaded.detach(), on_device.detach()));
    EXPECT_TRUE(offloaded.is_contiguous(channels_last));
    const auto host = opt.host_state_tensors();
    EXPECT_EQ(host.at(0).strides(), offloaded.strides());  // the master
    EXPECT_EQ(host.at(1).strides(), offloaded.strides());  // the gradient buffer
    auto copy = values.contiguous(channels_last).requires_grad_();
    const auto target = make(copy);
    optim::copy_state(opt, *target);
    const auto state = [](const torch::optim::Optimizer& o, const torch::Tensor& p) -> const auto& {
      return static_cast<const optim::QuantizedParamState&>(*o.state().at(p.unsafeGetTensorImpl()));
    };
    EXPECT_TRUE(state(*target, copy) == state(*reference, on_device));
  }
}

TEST(Offload, SaveAndLoadResumeExactly) {
  for (const int bits : {32, 8, 4}) {
    SCOPED_TRACE(std::to_string(bits) + "-bit state");
    expect_save_and_load_resume_exactly(bits);
  }
}

int64_t host_state_bytes(const OffloadOptimizer& opt) {
  int64_t bytes = 0;
  for (const auto& t : opt.host_state_tensors()) bytes += t.nbytes();
  return bytes;
}

TEST(Offload, StateSavedWithOtherBitsIsConvertedOnLoad) {
  // A run saved with one state width and resumed with another goes on as if its state had been copied
  // across with copy_state: in the new width (as many host bytes), and to the same parameters.
  for (const auto& [from, to] : std::vector<std::pair<int, int>>{{32, 8}, {8, 32}, {8, 4}, {4, 32}}) {
    SCOPED_TRACE(std::to_string(from) + "-bit state loaded as " + std::to_string(to) + "-bit");
    auto saved = model(), loaded = model(), copied = model();
    OffloadOptimizer a(saved->parameters(), OffloadOptimizerOptions(1e-3).state_bits(from));
    train(saved, a, 3);
    std::stringstream file;
    torch::serialize::OutputArchive out;
    a.save(out);
    out.save_to(file);
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < saved->parameters().size(); ++i) {
        loaded->parameters()[i].copy_(saved->parameters()[i]);
        copied->parameters()[i].copy_(saved->parameters()[i]);
      }
    }
    OffloadOptimizer b(loaded->parameters(), OffloadOptimizerOptions(1e-3).state_bits(to));
    OffloadOptimizer c(copied->parameters(), OffloadOptimizerOptions(1e-3).state_bits(to));
    torch::serialize::InputArchive in;
    in.load_from(file);
    b.load(in);
    optim::copy_state(a, c);
    EXPECT_EQ(host_state_bytes(b), host_state_bytes(c));
    train(loaded, b, 3);
    train(copied, c, 3);
    expect_same_parameters(loaded, copied);
  }
}

TEST(Offload, RefreshedMastersTakeUpWeightsSetOutsideTheOptimizer) {
  // Weights loaded into the model after the optimizer was made: refreshed, the masters step from them, as an
  // optimizer made after the load does; not refreshed, the next step writes the old masters back.
  for (const bool refresh : {true, false}) {
    auto net = model();
    OffloadOptimizer opt(net->parameters(), OffloadOptimizerOptions(1e-2).state_bits(8));
    train(net, opt, 2);
    torch::manual_seed(9);
    auto loaded = tnn::Sequential(tnn::Linear(64, 128), tnn::Tanh(), tnn::Linear(128, 128), tnn::Tanh(),
                                  tnn::Linear(128, 8));
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < net->parameters().size(); ++i)
        net->parameters()[i].copy_(loaded->parameters()[i]);
    }
    if (refresh) opt.refresh_masters();
    OffloadOptimizer reference(loaded->parameters(), OffloadOptimizerOptions(1e-2).state_bits(8));
    optim::copy_state(opt, reference);  // the same moments
    train(net, opt, 1);
    train(loaded, reference, 1);
    if (refresh) {
      expect_same_parameters(net, loaded);
    } else {
      EXPECT_FALSE(torch::equal(net->parameters()[2], loaded->parameters()[2]));
    }
  }
}

TEST(Offload, ParametersWithoutGradientsAreLeftAlone) {
  auto net = model();
  OffloadOptimizer opt(net->parameters());
  const auto frozen = net->parameters()[4].clone();  // the last layer's weight
  torch::manual_seed(6);
  const auto x = torch::randn({4, 64});
  net->forward(x).sum().backward();
  net->parameters()[4].mutable_grad() = torch::Tensor();
  opt.step();
  EXPECT_TRUE(torch::equal(frozen, net->parameters()[4]));
  EXPECT_FALSE(torch::equal(net->parameters()[0], model()->parameters()[0]));
}

TEST(Offload, AFrozenParameterTakesNoHostMemory) {
  // A fine-tune with its first layer frozen: the optimizer's host arena holds exactly what one built over
  // the trainable parameters alone holds, and the two train the same; unfrozen later, the layer is stepped
  // on the device with its moments there.
  install_meter();
  auto frozen_model = [] {
    auto net = model();
    for (auto& p : net[0]->parameters()) p.requires_grad_(false);
    return net;
  };
  auto net = frozen_model(), reference = frozen_model();
  const auto first = net->parameters()[0].clone();
  const OffloadOptimizerOptions options = OffloadOptimizerOptions(1e-2).state_bits(8).min_offload_size(1000);
  int64_t host_bytes = 0, reference_bytes = 0;
  {
    const int64_t before = host_memory_stats().current;
    OffloadOptimizer opt(net->parameters(), options);
    host_bytes = host_memory_stats().current - before;
    EXPECT_FALSE(opt.offloaded(net->parameters()[0]));
    EXPECT_TRUE(opt.offloaded(net->parameters()[2]));
    std::vector<torch::Tensor> trainable;
    for (const auto& p : reference->parameters())
      if (p.requires_grad()) trainable.push_back(p);
    const int64_t reference_before = host_memory_stats().current;
    OffloadOptimizer only_trainable(trainable, options);
    reference_bytes = host_memory_stats().current - reference_before;
    train(net, opt, 3);
    train(reference, only_trainable, 3);
    expect_same_parameters(net, reference);
    EXPECT_TRUE(torch::equal(first, net->parameters()[0]));
    EXPECT_EQ(opt.state_tensors().size(), 2u * 2u);  // the two trainable biases' moments, on the device

    net->parameters()[0].requires_grad_(true);
    train(net, opt, 1);
    EXPECT_FALSE(torch::equal(first, net->parameters()[0]));
    EXPECT_EQ(opt.state_tensors().size(), 2u * 2u + 2u);  // and the unfrozen weight's, on the device
  }
  EXPECT_EQ(host_bytes, reference_bytes);
  EXPECT_GT(host_bytes, 0);
}

TEST(Offload, AnOutOfMemoryInTheSmallTensorsStepLeavesEveryParameterAsItWas) {
  // The tensors under min_offload_size step with LibTorch's AdamW on the device, after the host step; it
  // allocates as it goes (its state at the first step). Under budgets rising by 16 KiB, each first step
  // either runs whole or changes no parameter.
  install_meter();
  auto net = model();
  OffloadOptimizer opt(net->parameters(), OffloadOptimizerOptions(1e-3).min_offload_size(10000));
  torch::manual_seed(3);
  const auto x = torch::randn({4, 64});
  const auto y = torch::randint(8, {4});
  int failed = 0;
  for (int64_t slack = 0;; slack += 16 << 10) {
    ASSERT_LT(slack, int64_t{4} << 20) << "no budget fitted";
    std::vector<torch::Tensor> before;
    for (const auto& p : net->parameters()) before.push_back(p.detach().clone());
    opt.zero_grad();
    F::cross_entropy(net->forward(x), y).backward();
    try {
      ScopedBudget budget(torch::kCPU, memory_stats(torch::kCPU).current + slack);
      opt.step();
      break;
    } catch (const c10::OutOfMemoryError&) {
      ++failed;
    }
    for (size_t i = 0; i < before.size(); ++i)
      ASSERT_TRUE(torch::equal(before[i], net->parameters()[i])) << "parameter " << i << ", slack " << slack;
  }
  EXPECT_GT(failed, 0);
}

TEST(OffloadErrors, BadInputIsRejected) {
  auto cpu = torch::zeros({4}, torch::requires_grad());
  auto meta = torch::empty({4}, torch::TensorOptions().device(torch::kMeta).requires_grad(true));
  EXPECT_THROW(OffloadOptimizer({cpu, meta}), c10::Error);
  EXPECT_THROW(OffloadOptimizer({cpu}, OffloadOptimizerOptions().state_bits(6)), c10::Error);
  EXPECT_THROW(OffloadOptimizer({cpu}, OffloadOptimizerOptions(-1)), c10::Error);
  EXPECT_THROW(OffloadOptimizer({cpu, cpu}), c10::Error);

  auto p = torch::zeros({4, 3}, torch::requires_grad());
  OffloadOptimizer opt({p});
  p.mutable_grad() = torch::eye(4, 3).to_sparse();
  EXPECT_THROW(opt.step(), c10::Error);
  EXPECT_TRUE(torch::equal(p, torch::zeros({4, 3})));

  // The host optimizer's kind is made with it: 8-bit state cannot turn into 4-bit state later.
  p.mutable_grad() = torch::ones({4, 3});
  static_cast<OffloadOptimizerOptions&>(opt.param_groups()[0].options()).state_bits(4);
  EXPECT_THROW(opt.step(), c10::Error);
  EXPECT_TRUE(torch::equal(p, torch::zeros({4, 3})));
  static_cast<OffloadOptimizerOptions&>(opt.param_groups()[0].options()).state_bits(8);  // 32 -> 8: allowed
  opt.step();
  EXPECT_FALSE(torch::equal(p, torch::zeros({4, 3})));

  // A double parameter would come back rounded to its fp32 master at every step.
  EXPECT_THROW(OffloadOptimizer({torch::zeros({4}, torch::kDouble).requires_grad_()}), c10::Error);
  // A group added later has no masters or state: stepping it would silently leave it behind.
  auto q = torch::zeros({5}, torch::requires_grad());
  q.mutable_grad() = torch::ones({5});
  const auto p1 = p.detach().clone();
  opt.add_param_group(torch::optim::OptimizerParamGroup({q}));
  try {
    opt.step();
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("1 parameter group(s) added after construction"), std::string::npos);
  }
  EXPECT_TRUE(torch::equal(p, p1));
  EXPECT_TRUE(torch::equal(q, torch::zeros({5})));
}

TEST(Offload, TheTrainerOffloadsWithARecipe) {
  torch::manual_seed(0);
  auto net = zoo::fashion_cnn();
  Trainer trainer(net, adamw(2e-3, 0.0),
                  Recipe()
                      .offload(Offload::kOptimizerState)
                      .state_bits(8)
                      .checkpoint(Checkpointing::segments(3))
                      .offload_activations(true)
                      .micro_batch(8));
  EXPECT_NE(dynamic_cast<OffloadOptimizer*>(&trainer.optimizer()), nullptr);
  const auto x = torch::randn({32, 1, 28, 28}), y = torch::randint(10, {32});
  const double first = trainer.step(x, y, ce).loss;
  double last = first;
  for (int s = 0; s < 8; ++s) last = trainer.step(x, y, ce).loss;
  EXPECT_LT(last, first * 0.7);
  EXPECT_THROW(Trainer(net, sgd(0.1), Recipe().offload(Offload::kOptimizerState)), c10::Error);
  EXPECT_THROW(Trainer(net, adamw(), Recipe().offload_activations(true)), c10::Error);
  // A hand-built optimizer must be what the recipe says: an offloading one, with the recipe's bits.
  auto on_device = std::make_shared<torch::optim::AdamW>(net->parameters());
  EXPECT_THROW(Trainer(net, on_device, Recipe().offload(Offload::kOptimizerState)), c10::Error);
  auto offloaded =
      std::make_shared<OffloadOptimizer>(net->parameters(), OffloadOptimizerOptions().state_bits(8));
  EXPECT_THROW(Trainer(net, offloaded, Recipe()), c10::Error);
  EXPECT_NO_THROW(Trainer(net, offloaded, Recipe().offload(Offload::kOptimizerState).state_bits(8)));
}

}  // namespace
}  // namespace memsave
