#include <memsave/amp.h>
#include <memsave/checkpoint.h>
#include <memsave/memory.h>

#include "../src/compat.h"
#include "zoo/zoo.h"

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <iostream>
#include <string>
#include <vector>

namespace memsave {
namespace {

namespace tnn = torch::nn;
using memsave::nn::checkpoint_sequential;

/// Two models with the same weights: the reference and the one to wrap.
std::pair<tnn::Sequential, tnn::Sequential> twins(const std::function<tnn::Sequential()>& make) {
  torch::manual_seed(7);
  auto a = make();
  torch::manual_seed(7);
  auto b = make();
  return {a, b};
}

std::vector<torch::Tensor> grads_of(const std::vector<torch::Tensor>& parameters) {
  std::vector<torch::Tensor> out;
  for (const auto& p : parameters) out.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  return out;
}

void expect_bit_identical(const std::vector<torch::Tensor>& expected,
                          const std::vector<torch::Tensor>& actual) {
  ASSERT_EQ(expected.size(), actual.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    SCOPED_TRACE("tensor " + std::to_string(i));
    ASSERT_EQ(expected[i].defined(), actual[i].defined());
    if (expected[i].defined()) {
      EXPECT_TRUE(torch::equal(expected[i], actual[i]));
    }
  }
}

/// One forward and backward from the same RNG state; returns the parameters' gradients and the input's.
template <typename Model>
std::vector<torch::Tensor> train_step(Model& model, const torch::Tensor& input,
                                      const std::function<torch::Tensor(const torch::Tensor&)>& loss) {
  const auto x = input.is_floating_point() ? input.clone().requires_grad_() : input;
  torch::manual_seed(11);
  loss(model->forward(x)).backward();
  auto g = grads_of(model->parameters());
  if (x.requires_grad()) g.push_back(x.grad().clone());
  return g;
}

torch::Tensor sum_squares(const torch::Tensor& y) { return y.square().sum(); }

tnn::Sequential mlp() { return zoo::mlp(32, 64, 10); }

tnn::Sequential cnn_with_batchnorm_and_dropout() {
  return tnn::Sequential(tnn::Conv2d(tnn::Conv2dOptions(3, 8, 3).padding(1)), tnn::BatchNorm2d(8),
                         tnn::ReLU(), tnn::Dropout(0.3), tnn::Conv2d(tnn::Conv2dOptions(8, 8, 3).padding(1)),
                         tnn::BatchNorm2d(8), tnn::ReLU(), tnn::Dropout2d(0.2), tnn::Flatten(),
                         tnn::Linear(8 * 6 * 6, 5));
}

tnn::Sequential transformer() {
  return zoo::gpt(zoo::GPTConfig().vocab_size(50).context(12).layers(3).heads(2).width(16).dropout(0.1));
}

TEST(Checkpoint, SequentialGradientsAreBitIdenticalOnMLP) {
  for (int64_t segments : {1, 2, 3, 5}) {
    SCOPED_TRACE(segments);
    auto [plain, wrapped] = twins(mlp);
    auto net = checkpoint_sequential(wrapped, segments);
    const auto x = torch::randn({16, 32});
    expect_bit_identical(train_step(plain, x, sum_squares), train_step(net, x, sum_squares));
  }
}

TEST(Checkpoint, CNNWithBatchNormAndDropoutIsBitIdenticalAndUpdatesStatisticsOnce) {
  auto [plain, wrapped] = twins(cnn_with_batchnorm_and_dropout);
  auto net = checkpoint_sequential(wrapped, 10);  // every layer
  const auto x = torch::randn({4, 3, 6, 6});
  expect_bit_identical(train_step(plain, x, sum_squares), train_step(net, x, sum_squares));
  // Running statistics and the batch counter moved exactly as in the plain model: once.
  expect_bit_identical(plain->buffers(), wrapped->buffers());
  for (const auto& pair : wrapped->named_buffers())
    if (pair.key().find("num_batches_tracked") != std::string::npos) {
      EXPECT_EQ(pair.value().item<int64_t>(), 1);
    }
}

TEST(Checkpoint, TransformerWithDropoutAndTiedWeightsIsBitIdentical) {
  const auto tokens = torch::randint(50, {3, 12}, torch::kLong);
  auto loss = [&](const torch::Tensor& logits) {
    return torch::nn::functional::cross_entropy(logits.reshape({-1, 50}), tokens.reshape({-1}));
  };
  for (int64_t segments : {2, 6}) {
    SCOPED_TRACE(segments);
    auto [plain, wrapped] = twins(transformer);
    auto net = checkpoint_sequential(wrapped, segments);
    expect_bit_identical(train_step(plain, tokens, loss), train_step(net, tokens, loss));
  }
  auto [plain, wrapped] = twins(transformer);
  auto net = checkpoint_sequential(wrapped, nn::keep_compute_heavy({"head"}));
  expect_bit_identical(train_step(plain, tokens, loss), train_step(net, tokens, loss));
}

/// The segments of `net` are `expected`: (begin, end, recomputed) each.
void expect_plan(const nn::CheckpointSequentialImpl& net,
                 const std::vector<std::tuple<size_t, size_t, bool>>& expected) {
  ASSERT_EQ(net.segments().size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    const auto& s = net.segments()[i];
    EXPECT_EQ(std::make_tuple(s.begin, s.end, s.recompute), expected[i]) << i;
  }
}

TEST(Checkpoint, KeepPolicyRecomputesRunsOfCheapLayers) {
  auto net = checkpoint_sequential(cnn_with_batchnorm_and_dropout(), nn::keep_compute_heavy());
  expect_plan(*net, {{0, 1, false}, {1, 4, true}, {4, 5, false}, {5, 9, true}, {9, 10, false}});
}

/// Elements that work in place: LibTorch refuses one at the start of a recomputed piece (its input is a leaf
/// there), and the Identity before the LeakyReLU hands its input on unchanged.
tnn::Sequential cnn_in_place() {
  return tnn::Sequential(
      tnn::Conv2d(tnn::Conv2dOptions(3, 8, 3).padding(1)), tnn::BatchNorm2d(8),
      tnn::ReLU(tnn::ReLUOptions(true)), tnn::Conv2d(tnn::Conv2dOptions(8, 8, 3).padding(1)),
      tnn::Dropout(tnn::DropoutOptions(0.3).inplace(true)), tnn::Identity(),
      tnn::LeakyReLU(tnn::LeakyReLUOptions().inplace(true)), tnn::Flatten(), tnn::Linear(8 * 6 * 6, 5));
}

TEST(Checkpoint, NoPieceBeginsAtAnElementThatWorksInPlace) {
  EXPECT_EQ(nn::piece_may_begin(cnn_in_place()),
            (std::vector<bool>{true, true, false, true, false, false, false, true, true}));
  // Every layer: the in-place elements join the piece before them, and the gradients, the running
  // statistics and the dropout masks are the plain model's.
  using Segment = nn::CheckpointSequentialImpl::Segment;
  const auto x = torch::randn({4, 3, 6, 6});
  {
    auto [plain, wrapped] = twins(cnn_in_place);
    auto net = checkpoint_sequential(wrapped, 9);
    expect_plan(*net, {{0, 1, true}, {1, 3, true}, {3, 7, true}, {7, 8, true}, {8, 9, false}});
    expect_bit_identical(train_step(plain, x, sum_squares), train_step(net, x, sum_squares));
    expect_bit_identical(plain->buffers(), wrapped->buffers());
  }
  for (int64_t segments : {2, 3, 4, 5}) {
    SCOPED_TRACE(segments);
    auto [plain, wrapped] = twins(cnn_in_place);
    auto net = checkpoint_sequential(wrapped, segments);
    EXPECT_LE(net->segments().size(), static_cast<size_t>(segments));
    expect_bit_identical(train_step(plain, x, sum_squares), train_step(net, x, sum_squares));
  }
  {
    auto [plain, wrapped] = twins(cnn_in_place);
    auto net = checkpoint_sequential(wrapped, nn::keep_compute_heavy(), /*max_run=*/1);
    for (const Segment& s : net->segments())
      EXPECT_TRUE(nn::piece_may_begin(wrapped)[s.begin] || s.begin == 0);
    expect_bit_identical(train_step(plain, x, sum_squares), train_step(net, x, sum_squares));
  }
  // A plan given by hand that recomputes from such an element is an error when it is built.
  try {
    nn::CheckpointSequential(cnn_in_place(), std::vector<Segment>{{0, 2, true}, {2, 9, true}});
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("begins at element 2"), std::string::npos) << e.what();
  }
}

TEST(Checkpoint, KeepPolicyCutsRunsToMaxRun) {
  auto net = checkpoint_sequential(
      cnn_with_batchnorm_and_dropout(), [](const std::string&, const tnn::Module&) { return false; }, 3);
  ASSERT_EQ(net->segments().size(), 4u);  // 10 elements in pieces of 3, 3, 3, 1
  EXPECT_EQ(net->segments()[3].begin, 9u);
  for (const auto& s : net->segments()) EXPECT_TRUE(s.recompute);
  EXPECT_THROW(checkpoint_sequential(mlp(), nn::keep_compute_heavy(), -1), c10::Error);
}

TEST(Checkpoint, GradientsReachParametersWhenNoInputRequiresGrad) {
  // A frozen embedding feeds a checkpointed block: the block's parameters still get their gradients.
  auto make = [] {
    return tnn::Sequential(tnn::Embedding(20, 8), tnn::Linear(8, 8), tnn::Tanh(), tnn::Linear(8, 3));
  };
  auto [plain, wrapped] = twins(make);
  for (auto* net : {&plain, &wrapped}) (*net)[0]->parameters()[0].requires_grad_(false);
  auto net = checkpoint_sequential(wrapped, 2);  // recomputes [embedding, linear]; keeps [tanh, linear]
  const auto tokens = torch::randint(20, {5}, torch::kLong);
  const auto expected = train_step(plain, tokens, sum_squares);
  const auto actual = train_step(net, tokens, sum_squares);
  expect_bit_identical(expected, actual);
  EXPECT_TRUE(wrapped[1]->parameters()[0].grad().defined());

  // The same through the module wrapper, whose input never requires grad.
  torch::manual_seed(3);
  auto linear = tnn::Linear(4, 2);
  auto reference = tnn::Linear(4, 2);
  {
    torch::NoGradGuard no_grad;
    reference->weight.copy_(linear->weight);
    reference->bias.copy_(linear->bias);
  }
  nn::Checkpoint wrapper(linear);
  const auto x = torch::randn({3, 4});
  wrapper->forward(x).square().sum().backward();
  reference->forward(x).square().sum().backward();
  EXPECT_TRUE(torch::equal(linear->weight.grad(), reference->weight.grad()));
  EXPECT_TRUE(torch::equal(linear->bias.grad(), reference->bias.grad()));
}

TEST(Checkpoint, WorksWithAutogradGrad) {
  auto [plain, wrapped] = twins(mlp);
  auto net = checkpoint_sequential(wrapped, 3);
  const auto x = torch::randn({8, 32});
  const auto expected = torch::autograd::grad({plain->forward(x).square().sum()}, plain->parameters());
  const auto actual = torch::autograd::grad({net->forward(x).square().sum()}, net->parameters());
  expect_bit_identical(expected, actual);
  for (const auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined());  // grad() accumulates nothing
}

TEST(Checkpoint, DoubleBackwardThroughRecomputedPiecesMatchesThePlainGraph) {
  // A gradient penalty: the first gradients are built with create_graph and differentiated again. The second
  // recomputed piece's input comes from the first: its gradients must stay differentiable in that input, or
  // the first piece's weights and the model's input lose their second-order terms.
  auto make = [] {
    return tnn::Sequential(tnn::Linear(6, 8), tnn::Tanh(), tnn::Linear(8, 8), tnn::Tanh(), tnn::Linear(8, 3));
  };
  auto [plain, wrapped] = twins(make);
  auto net = checkpoint_sequential(wrapped, 3);  // recomputes [linear, tanh] twice; keeps the last linear
  const auto input = torch::randn({5, 6});
  auto second_order = [&](auto& model) {
    const auto x = input.clone().requires_grad_();
    std::vector<torch::Tensor> wrt = model->parameters();
    wrt.push_back(x);
    const auto first = torch::autograd::grad({model->forward(x).square().sum()}, wrt, {}, true, true);
    torch::Tensor penalty = torch::zeros({});
    for (const auto& g : first) penalty = penalty + g.square().sum();
    return torch::autograd::grad({penalty}, wrt);
  };
  const auto expected = second_order(plain);
  const auto actual = second_order(net);
  ASSERT_EQ(expected.size(), actual.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    SCOPED_TRACE("tensor " + std::to_string(i));
    ASSERT_TRUE(actual[i].defined());
    EXPECT_TRUE(torch::allclose(actual[i], expected[i], 1e-5, 1e-7)) << (actual[i] - expected[i]).abs().max();
  }

  // Offloaded inputs are copies without the caller's graph: the same backward is refused, not half done.
  auto offloaded = checkpoint_sequential(make(), 3, CheckpointOptions().offload_inputs(true));
  const auto x = input.clone().requires_grad_();
  try {
    torch::autograd::grad({offloaded->forward(x).square().sum()}, {x}, {}, true, true);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("offload_inputs"), std::string::npos) << e.what();
  }
}

TEST(Checkpoint, NestedCheckpointsAreBitIdentical) {
  auto [plain, wrapped] = twins(mlp);
  // The outer checkpoint covers the whole MLP; inside it, each Linear is checkpointed again.
  auto inner = tnn::Sequential();
  for (size_t i = 0; i < wrapped->size(); ++i) {
    if (wrapped[i]->as<tnn::Linear>())
      inner->push_back(nn::Checkpoint(std::dynamic_pointer_cast<tnn::LinearImpl>(wrapped->ptr(i))));
    else
      inner->push_back(tnn::ReLU());
  }
  nn::Checkpoint outer(inner);
  const auto x = torch::randn({4, 32});
  expect_bit_identical(train_step(plain, x, sum_squares), train_step(outer, x, sum_squares));
}

TEST(Checkpoint, ModuleWrapperSeesThroughToTheChild) {
  auto linear = tnn::Linear(3, 2);
  nn::Checkpoint wrapper(linear);
  ASSERT_EQ(wrapper->parameters().size(), 2u);
  EXPECT_TRUE(wrapper->named_parameters().contains("module.weight"));
  wrapper->eval();
  EXPECT_FALSE(linear->is_training());
  wrapper->to(torch::kDouble);
  EXPECT_EQ(linear->weight.scalar_type(), torch::kDouble);

  std::stringstream stream;
  torch::save(wrapper, stream);
  nn::Checkpoint loaded(tnn::Linear(3, 2));
  loaded->to(torch::kDouble);
  torch::load(loaded, stream);
  EXPECT_TRUE(torch::equal(loaded->parameters()[0], linear->weight));
}

/// A block that takes its input and side information, with BatchNorm and dropout: the wrapper runs it
/// through Checkpoint::run.
struct SideBlockImpl : tnn::Module {
  SideBlockImpl()
      : a(register_module("a", tnn::Linear(32, 64))),
        b(register_module("b", tnn::Linear(4, 64))),
        norm(register_module("norm", tnn::BatchNorm1d(64))),
        out(register_module("out", tnn::Linear(64, 32))) {}
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& side) {
    return x + out(torch::dropout(torch::gelu(norm(a(x) + b(side))), 0.2, is_training()));
  }
  tnn::Linear a, b;
  tnn::BatchNorm1d norm;
  tnn::Linear out;
};
TORCH_MODULE(SideBlock);

/// Three such blocks in a module of one's own, each in a memsave::nn::Checkpoint, and a Sequential head in
/// one too (through the wrapper's forward).
struct SideNetImpl : tnn::Module {
  SideNetImpl() {
    for (int i = 0; i < 3; ++i) {
      blocks.push_back(SideBlock());
      wrappers.push_back(register_module("block" + std::to_string(i), nn::Checkpoint(blocks.back())));
    }
    mlp = tnn::Sequential(tnn::Linear(32, 128), tnn::GELU(), tnn::Linear(128, 10));
    head = register_module("head", nn::Checkpoint(mlp));
  }
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& side) {
    for (size_t i = 0; i < blocks.size(); ++i) {
      auto block = blocks[i];
      x = wrappers[i]->run(
          [block](at::TensorList in) mutable { return std::vector{block->forward(in[0], in[1])}; },
          {x, side})[0];
    }
    return head(x);
  }
  std::vector<SideBlock> blocks;
  std::vector<nn::Checkpoint> wrappers;
  tnn::Sequential mlp{nullptr};
  nn::Checkpoint head{nullptr};
};
TORCH_MODULE(SideNet);

TEST(Checkpoint, WrapsBlocksOfSeveralInputsAndCanBeSwitchedOff) {
  // Blocks of two inputs through Checkpoint::run: gradients, running statistics and dropout as without
  // checkpointing, bit for bit; the forward keeps less. Switched off, the wrappers run the blocks as they are
  // and keep what the plain module keeps, byte for byte.
  install_meter();
  torch::manual_seed(3);
  SideNet on;
  torch::manual_seed(3);
  SideNet off;
  for (const auto& block : nn::checkpoint_blocks(off.ptr())) block->enable(false);
  const auto blocks = nn::checkpoint_blocks(on.ptr());
  ASSERT_EQ(blocks.size(), 4u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(blocks[i], on->wrappers[i].ptr());
  EXPECT_EQ(blocks[3], on->head.ptr());
  EXPECT_TRUE(blocks[0]->enabled());

  const auto x = torch::randn({16, 32}), side = torch::randn({16, 4}), target = torch::randint(10, {16});
  auto run = [&](SideNet& net, int64_t& kept) {
    const int64_t before = memory_stats(torch::kCPU).current;
    torch::manual_seed(11);
    const auto loss = torch::nn::functional::cross_entropy(net->forward(x, side), target);
    kept = memory_stats(torch::kCPU).current - before;
    loss.backward();
    std::vector<torch::Tensor> out = grads_of(net->parameters());
    for (const auto& b : net->buffers()) out.push_back(b.clone());
    return out;
  };
  int64_t kept_on = 0, kept_off = 0;
  const auto with = run(on, kept_on), without = run(off, kept_off);
  expect_bit_identical(without, with);
  EXPECT_LT(kept_on, kept_off / 2);

  // The plain module: the blocks' own forwards, no wrapper in the way.
  torch::manual_seed(3);
  SideNet plain;
  int64_t kept_plain = 0;
  {
    const int64_t before = memory_stats(torch::kCPU).current;
    torch::manual_seed(11);
    torch::Tensor h = x;
    for (auto& block : plain->blocks) h = block->forward(h, side);
    const auto loss = torch::nn::functional::cross_entropy(plain->mlp->forward(h), target);
    kept_plain = memory_stats(torch::kCPU).current - before;
    loss.backward();
  }
  EXPECT_EQ(kept_off, kept_plain);
  std::vector<torch::Tensor> reference = grads_of(plain->parameters());
  for (const auto& b : plain->buffers()) reference.push_back(b.clone());
  expect_bit_identical(reference, without);

  // A wrapper of a module whose forward takes two tensors has no forward of one.
  try {
    on->wrappers[0]->forward(x);
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("call Checkpoint::run"), std::string::npos) << e.what();
  }
}

TEST(Checkpoint, CostsNothingInEvalOrWithoutGrad) {
  install_meter();
  auto [plain, wrapped] = twins(mlp);
  auto net = checkpoint_sequential(wrapped, 3);
  const auto x = torch::randn({8, 32});
  {
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::equal(plain->forward(x), net->forward(x)));
  }
  net->eval();
  const auto y = net->forward(x);
  EXPECT_TRUE(y.grad_fn() != nullptr);
  EXPECT_EQ(y.grad_fn()->name(), plain->forward(x).grad_fn()->name());  // no checkpoint node on top
}

TEST(Checkpoint, ReplaysTheForwardsAutocastState) {
  auto [plain, wrapped] = twins(mlp);
  auto net = checkpoint_sequential(wrapped, 3);
  const auto x = torch::randn({8, 32});
  auto step = [&](auto& model) {
    torch::Tensor y;
    {
      amp::Autocast autocast(torch::kCPU, torch::kBFloat16);
      y = model->forward(x);
    }
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
    y.to(torch::kFloat).square().sum().backward();  // backward outside the guard, as in a training loop
    return grads_of(model->parameters());
  };
  expect_bit_identical(step(plain), step(net));
}

TEST(Checkpoint, LeavesNoCastWeightsInAutocastsCache) {
  install_meter();
  // Convolutions take their fp32 weights as they are, so autocast caches the bf16 copies it makes of them
  // (until the outermost autocast ends) unless its cache is off. A checkpointed piece's casts must go with
  // the piece: the bytes in use after the forward, and after a backward run inside autocast, are those of
  // the same steps with autocast's cache off altogether (torch's own flag, the reference).
  auto make = [] {
    tnn::Sequential s;
    for (int i = 0; i < 4; ++i) s->push_back(tnn::Conv2d(tnn::Conv2dOptions(32, 32, 3).padding(1)));
    return s;
  };
  const auto x = torch::randn({2, 32, 8, 8});
  struct Bytes {
    int64_t after_forward, after_backward;
    std::vector<torch::Tensor> grads;
  };
  auto step = [&](bool checkpointed, bool cache) {
    torch::manual_seed(3);
    tnn::Sequential model = make();
    using Segment = nn::CheckpointSequentialImpl::Segment;
    auto net = checkpointed
                   ? nn::CheckpointSequential(
                         model, std::vector<Segment>{{0, 1, true}, {1, 2, true}, {2, 3, true}, {3, 4, true}})
                         .ptr()
                   : nullptr;
    const bool was = at::autocast::is_autocast_cache_enabled();
    at::autocast::set_autocast_cache_enabled(cache);
    Bytes b;
    {
      const int64_t before = memory_stats(torch::kCPU).current;
      amp::Autocast autocast(torch::kCPU, torch::kBFloat16);
      torch::Tensor y = net ? net->forward(x) : model->forward(x);
      EXPECT_EQ(at::autocast::is_autocast_cache_enabled(), cache);  // put back after each piece
      b.after_forward = memory_stats(torch::kCPU).current - before;
      y.to(torch::kFloat).square().sum().backward();
      y = torch::Tensor();
      b.after_backward = memory_stats(torch::kCPU).current - before;
    }
    at::autocast::set_autocast_cache_enabled(was);
    b.grads = grads_of(model->parameters());
    return b;
  };
  const Bytes plain = step(false, true), checkpointed = step(true, true), reference = step(true, false);
  EXPECT_EQ(checkpointed.after_forward, reference.after_forward);
  EXPECT_EQ(checkpointed.after_backward, reference.after_backward);
  // What the cache would have held: the four convolutions' bf16 weights, which the plain forward's cache
  // still holds after its backward.
  EXPECT_GE(plain.after_backward - reference.after_backward, 4 * 32 * 32 * 9 * 2);
  expect_bit_identical(plain.grads, checkpointed.grads);
}

TEST(Checkpoint, FunctionalFormWithSeveralInputsAndOutputs) {
  auto a = torch::randn({4, 3}, torch::requires_grad());
  auto b = torch::randn({4, 3}, torch::requires_grad());
  auto fn = [](at::TensorList in) {
    return std::vector<torch::Tensor>{(in[0] * in[1]).sin(), in[0].exp() + in[1], torch::argmax(in[0], 1)};
  };
  auto out = checkpoint(fn, {a, b});
  ASSERT_EQ(out.size(), 3u);
  EXPECT_FALSE(out[2].requires_grad());
  (out[0].sum() + out[1].square().sum()).backward();
  auto ga = a.grad().clone(), gb = b.grad().clone();
  a.mutable_grad().reset();
  b.mutable_grad().reset();
  auto ref = fn({a, b});
  (ref[0].sum() + ref[1].square().sum()).backward();
  EXPECT_TRUE(torch::equal(ga, a.grad()));
  EXPECT_TRUE(torch::equal(gb, b.grad()));
}

TEST(Checkpoint, OffloadedInputsLiveInTheHostArenaAndGiveTheSameGradients) {
  install_meter();
  auto [plain, wrapped] = twins(mlp);
  auto net = checkpoint_sequential(wrapped, 5, CheckpointOptions().offload_inputs(true));
  const auto x = torch::randn({64, 32});
  const auto expected = train_step(plain, x, sum_squares);
  reset_host_peak();
  const int64_t host_before = host_memory_stats().current;
  const auto actual = train_step(net, x, sum_squares);
  expect_bit_identical(expected, actual);
  // Four recomputed segments kept their inputs in the host arena: x [64, 32] and three [64, 64] floats.
  EXPECT_EQ(host_memory_stats().peak - host_before, 64 * 32 * 4 + 3 * 64 * 64 * 4);
  EXPECT_EQ(host_memory_stats().current, host_before);
}

TEST(Checkpoint, ChannelsLastInputsAreRecomputedInTheirLayoutFromTheDeviceOrTheHost) {
  // A channels_last model recomputes each piece on channels_last inputs, as its forward ran: a row-major copy
  // back from the host would run its convolutions in the other layout (another kernel, other rounding).
  install_meter();
  for (bool offload : {false, true}) {
    SCOPED_TRACE(offload ? "inputs offloaded" : "inputs kept");
    auto [plain, wrapped] = twins(cnn_with_batchnorm_and_dropout);
    for (auto* model : {&plain, &wrapped})
      for (auto& p : (*model)->parameters())
        if (p.dim() == 4) p.set_data(p.detach().contiguous(torch::MemoryFormat::ChannelsLast));
    auto net = checkpoint_sequential(wrapped, 10, CheckpointOptions().offload_inputs(offload));
    const auto x = torch::randn({4, 3, 6, 6}).contiguous(torch::MemoryFormat::ChannelsLast);
    const auto expected = train_step(plain, x, sum_squares);
    const auto actual = train_step(net, x, sum_squares);
    expect_bit_identical(expected, actual);
    for (size_t i = 0; i < expected.size(); ++i) EXPECT_EQ(expected[i].strides(), actual[i].strides()) << i;
  }
}

TEST(Checkpoint, PeakActivationMemoryFallsWithSegments) {
  install_meter();
  // 16 × (Linear, Tanh) of width 256 on 4096 rows: each layer output is 4 MiB, each weight 256 KiB, so
  // activations dominate. Without checkpointing each Tanh keeps its output (which the next Linear keeps as
  // its input): 16 outputs. With k segments the forward keeps k - 1 segment inputs plus the last segment's
  // 16/k outputs, and backward holds one recomputed segment (16/k outputs) at a time: k - 1 + 16/k, least at
  // k = 4. Backward adds a few outputs' worth of gradients in flight either way.
  auto make = [] {
    tnn::Sequential s;
    for (int i = 0; i < 16; ++i) {
      s->push_back(tnn::Linear(256, 256));
      s->push_back(tnn::Tanh());
    }
    return s;
  };
  const auto x = torch::randn({4096, 256});
  const int64_t out = 4096 * 256 * 4;
  auto activation_peak = [&](int64_t segments) {
    torch::manual_seed(1);
    tnn::Sequential model = make();
    auto net = segments == 0 ? nullptr : checkpoint_sequential(model, segments).ptr();
    for (auto& p : model->parameters())
      p.mutable_grad() = torch::zeros_like(p);  // gradients outside the peak
    PeakScope scope(torch::kCPU);
    auto y = net ? net->forward(x) : model->forward(x);
    y.sum().backward();
    y = torch::Tensor();
    return static_cast<double>(scope.peak() - scope.start()) / out;
  };
  const double none = activation_peak(0), two = activation_peak(2), four = activation_peak(4),
               eight = activation_peak(8);
  std::cout << "peak in layer outputs: none " << none << ", 2 segments " << two << ", 4 segments " << four
            << ", 8 segments " << eight << "\n";
  const double in_flight = none - 16;
  EXPECT_GE(in_flight, 0);
  EXPECT_LE(in_flight, 4);
  EXPECT_NEAR(two, 1 + 8 + in_flight, 1.5);
  EXPECT_NEAR(four, 3 + 4 + in_flight, 1.5);
  EXPECT_NEAR(eight, 7 + 2 + in_flight, 1.5);
  EXPECT_LT(four, two);
  EXPECT_LT(four, eight);
}

/// Two micro-batches of a window, from the same RNG state: the parameters' gradients after both (the second
/// backward adds to what the first left) and the second input's gradient.
template <typename Model>
std::vector<torch::Tensor> accumulate_two(Model& model, const torch::Tensor& first,
                                          const torch::Tensor& second,
                                          const std::function<torch::Tensor(const torch::Tensor&)>& loss) {
  train_step(model, first, loss);
  return train_step(model, second, loss);
}

TEST(Checkpoint, UnderAccumulationGradientsStayBitIdentical) {
  // Each parameter used once: a recomputed piece adds its gradients to .grad in its own backward.
  for (int64_t segments : {2, 5}) {
    SCOPED_TRACE(segments);
    auto [plain, wrapped] = twins(mlp);
    auto net = checkpoint_sequential(wrapped, segments);
    const auto a = torch::randn({16, 32}), b = torch::randn({16, 32});
    expect_bit_identical(accumulate_two(plain, a, b, sum_squares), accumulate_two(net, a, b, sum_squares));
  }
  // Tied embeddings: the token embedding's gradient arrives from its recomputed piece and from the head, and
  // is summed with the earlier micro-batch's in the order the plain backward sums it.
  const auto tokens = torch::randint(50, {3, 12}, torch::kLong),
             more = torch::randint(50, {3, 12}, torch::kLong);
  auto loss = [&](const torch::Tensor& logits) {
    return torch::nn::functional::cross_entropy(logits.reshape({-1, 50}), tokens.reshape({-1}));
  };
  {
    auto [plain, wrapped] = twins(transformer);
    auto net = checkpoint_sequential(wrapped, 9);  // every element but the head
    expect_bit_identical(accumulate_two(plain, tokens, more, loss), accumulate_two(net, tokens, more, loss));
  }
  // One Linear used by two recomputed pieces: its two gradients are added to .grad as one sum, as without
  // checkpointing, not one after the other.
  auto shared = [] {
    auto linear = tnn::Linear(32, 32);
    return tnn::Sequential(linear, tnn::Tanh(), linear, tnn::Tanh(), tnn::Linear(32, 4));
  };
  auto [plain, wrapped] = twins(shared);
  auto net = checkpoint_sequential(wrapped, 5);
  const auto a = torch::randn({16, 32}), b = torch::randn({16, 32});
  expect_bit_identical(accumulate_two(plain, a, b, sum_squares), accumulate_two(net, a, b, sum_squares));
}

TEST(Checkpoint, UnderAccumulationAPieceAddsItsParameterGradientsAsTheyArrive) {
  install_meter();
  // One recomputed piece of four 512 x 512 layers (1 MiB of weights each) on 2 rows: the gradients of the
  // weights dwarf the activations. While a later micro-batch's backward runs, each weight's new gradient is
  // added to .grad and let go; a piece that handed them back together at its end would hold all four.
  auto make = [] {
    return tnn::Sequential(tnn::Linear(512, 512), tnn::Tanh(), tnn::Linear(512, 512), tnn::Tanh(),
                           tnn::Linear(512, 512), tnn::Tanh(), tnn::Linear(512, 512));
  };
  auto [plain, wrapped] = twins(make);
  nn::Checkpoint piece(wrapped);
  const auto x = torch::randn({2, 512});
  auto backward_peak = [&](auto& model) {
    model->forward(x).square().sum().backward();  // the first micro-batch: .grad exists from here on
    auto loss = model->forward(x).square().sum();
    PeakScope scope(torch::kCPU);
    loss.backward();
    return scope.peak() - scope.start();
  };
  const int64_t without = backward_peak(plain), with = backward_peak(piece);
  std::cout << "a later micro-batch's backward: " << without << " bytes above its start without "
            << "checkpointing, " << with << " with\n";
  const int64_t weight = 512 * 512 * 4;
  EXPECT_GE(without, weight);  // one weight's gradient in flight
  EXPECT_LT(without, 2 * weight);
  EXPECT_LT(with, without + weight / 8);  // beside it only the recomputed activations (2 rows)
  expect_bit_identical(grads_of(plain->parameters()), grads_of(wrapped->parameters()));
}

/// Counts the runs of a gradient accumulator, and fails on a run without a gradient (where
/// DistributedDataParallel's hook, which marks a gradient ready, would count one twice).
struct CountGradients : torch::autograd::FunctionPostHook {
  explicit CountGradients(int* count) : count(count) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& inputs) override {
    EXPECT_TRUE(!inputs.empty() && inputs[0].defined()) << "an accumulator ran without a gradient";
    ++*count;
    return outputs;
  }
  int* count;
};

TEST(Checkpoint, ParameterHooksSeeEachGradientOnceAsWithoutCheckpointing) {
  // A hook on a parameter (here one that doubles its gradient) runs once per backward, on the gradient;
  // so does a hook on another parameter's gradient accumulator. Two micro-batches: the second backward adds
  // to the gradients the first left.
  for (int64_t segments : {1, 3, 5}) {
    SCOPED_TRACE(segments);
    auto [plain, wrapped] = twins(mlp);
    int hooks[2] = {0, 0}, accumulated[2] = {0, 0};
    std::vector<compat::NodeRef> accumulators;  // a post hook lives with its node
    auto watch = [&](tnn::Sequential& net, int side) {
      net->parameters()[0].register_hook([&hooks, side](const torch::Tensor& grad) {
        ++hooks[side];
        return grad * 2;
      });
      accumulators.push_back(torch::autograd::impl::grad_accumulator(net->parameters()[2]));
      accumulators.back()->add_post_hook(std::make_unique<CountGradients>(&accumulated[side]));
    };
    watch(plain, 0);
    watch(wrapped, 1);
    auto net = checkpoint_sequential(wrapped, segments);
    const auto a = torch::randn({16, 32}), b = torch::randn({16, 32});
    expect_bit_identical(accumulate_two(plain, a, b, sum_squares), accumulate_two(net, a, b, sum_squares));
    EXPECT_EQ(hooks[0], 2);
    EXPECT_EQ(hooks[1], 2);
    EXPECT_EQ(accumulated[0], 2);
    EXPECT_EQ(accumulated[1], 2);
  }
}

TEST(Checkpoint, TheBackwardLetsGoOfTheRecomputedOutputAndItsGradientAsWithoutCheckpointing) {
  install_meter();
  // A piece of four 4 MiB steps; the loss squares its output, so the output's gradient is 4 MiB too. Held to
  // the end of the piece's backward, the output and its gradient would be there when the gradient of the
  // piece's first step arrives, 8 MiB beside what the backward without checkpointing has then. With a
  // parameter the piece adds its gradient to .grad itself; without one it hands the input's gradient back.
  const int64_t rows = 4096, width = 256, bytes = rows * width * 4;
  for (bool with_parameter : {false, true}) {
    SCOPED_TRACE(with_parameter);
    torch::manual_seed(3);
    const auto x = torch::randn({rows, width}, torch::requires_grad());
    const auto w = torch::randn({width}, torch::requires_grad(with_parameter));
    int64_t at_first_step = 0;  // bytes in use when the gradient of the first step's result is ready
    const CheckpointFunction piece = [&](at::TensorList in) {
      torch::Tensor scaled = in[0] * w;
      scaled.register_hook([&](const torch::Tensor&) { at_first_step = memory_stats(torch::kCPU).current; });
      return std::vector<torch::Tensor>{scaled.tanh().tanh().tanh()};
    };
    auto in_use = [&](bool checkpointed) {
      x.mutable_grad().reset();
      w.mutable_grad().reset();
      const int64_t before = memory_stats(torch::kCPU).current;
      const auto y = checkpointed ? checkpoint(piece, {x})[0] : piece({x})[0];
      y.square().sum().backward();
      return at_first_step - before;
    };
    const int64_t plain = in_use(false), recomputed = in_use(true);
    std::cout << "in use when the first step's gradient is ready: " << plain
              << " bytes without checkpointing, " << recomputed << " with\n";
    EXPECT_GE(plain, bytes);  // that gradient
    EXPECT_LT(recomputed, plain + bytes / 4);
  }
}

TEST(Checkpoint, CapturedLeafTensorsGetTheirGradients) {
  auto x = torch::randn({4}, torch::requires_grad());
  auto w = torch::randn({4}, torch::requires_grad());  // captured, not passed: found in the forward's graph
  checkpoint([&](at::TensorList in) { return std::vector<torch::Tensor>{(in[0] * w).sin()}; }, {x})[0]
      .sum()
      .backward();
  EXPECT_TRUE(torch::equal(w.grad(), (x * w).cos().detach() * x.detach()));
  EXPECT_TRUE(torch::equal(x.grad(), (x * w).cos().detach() * w.detach()));
}

TEST(CheckpointErrors, CapturedTensorComputedOutsideTheFunction) {
  auto x = torch::randn({4}, torch::requires_grad());
  auto w = torch::randn({4}, torch::requires_grad());
  auto hidden = w * 2;  // has a graph of its own: its gradient could not flow back through the checkpoint
  try {
    checkpoint([&](at::TensorList in) { return std::vector<torch::Tensor>{in[0] * hidden}; }, {x});
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("was computed outside it"), std::string::npos) << e.what();
  }
}

TEST(CheckpointErrors, AnInputModifiedInPlaceByTheFunction) {
  // An input without grad (raw data scaled in place): the recomputation would scale it again and the
  // weight's gradient would be wrong without a word.
  auto w = torch::randn({4}, torch::requires_grad());
  auto x = torch::randn({4});
  try {
    checkpoint([&](at::TensorList in) { return std::vector<torch::Tensor>{(in[0].mul_(2) * w).sin()}; }, {x});
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("modified input 0 (shape [4]) in place"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(w.grad().defined());

  // An input with grad: a piece that starts with an in-place operation memsave does not recognize (a
  // module of the user's own) gets LibTorch's error with what it means here.
  nn::CheckpointSequential net(
      tnn::Sequential(tnn::Linear(4, 4), tnn::Functional([](torch::Tensor t) { return t.relu_(); }),
                      tnn::Linear(4, 2)),
      std::vector<nn::CheckpointSequentialImpl::Segment>{{0, 1, true}, {1, 3, true}});
  try {
    net->forward(torch::randn({3, 4}));
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint: inside a checkpointed piece its inputs are leaves"),
              std::string::npos)
        << e.what();
  }
}

TEST(CheckpointErrors, AnInferenceTensorInputGetsLibTorchsAdvice) {
  // The input is kept for the recomputation, which LibTorch refuses for an inference tensor; the in-place
  // check above must not get there first with an error about version counters.
  auto w = torch::randn({4}, torch::requires_grad());
  torch::Tensor x;
  {
    torch::InferenceMode inference;
    x = torch::randn({4});
  }
  try {
    checkpoint([&](at::TensorList in) { return std::vector<torch::Tensor>{(in[0] + w).sin()}; }, {x});
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("Inference tensors cannot be saved for backward"), std::string::npos)
        << e.what();
  }
}

TEST(CheckpointErrors, AnEmptyModuleIsNamedAsSuch) {
  // An empty holder (a member not yet assigned) would otherwise get LibTorch's "Accessing empty
  // ModuleHolder".
  for (const auto& make :
       std::vector<std::function<void()>>{[] { (void)nn::Checkpoint(tnn::Linear(nullptr)); },
                                          [] { (void)nn::Checkpoint(std::shared_ptr<tnn::LinearImpl>()); }}) {
    try {
      make();
      FAIL() << "no error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("Checkpoint: module is empty"), std::string::npos) << e.what();
    }
  }
}

TEST(CheckpointErrors, BadSegmentCounts) {
  EXPECT_THROW(checkpoint_sequential(mlp(), 0), c10::Error);
  EXPECT_THROW(checkpoint_sequential(mlp(), 6), c10::Error);
  EXPECT_THROW(checkpoint_sequential(tnn::Sequential(), 1), c10::Error);
}

}  // namespace
}  // namespace memsave
