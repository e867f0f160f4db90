// memsave::optim::copy_state: optimizer state carried from one format into another.
#include <memsave/memory.h>
#include <memsave/offload.h>
#include <memsave/optim.h>

#include "../kernels/qmap.h"
#include "saved_state.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace memsave::optim {
namespace {

namespace k = memsave::kernels;
using memsave::testing::saved_bytes;
using Params = std::vector<torch::Tensor>;
using Make = std::function<std::unique_ptr<torch::optim::Optimizer>(const Params&)>;

/// Parameters of 5000 (quantized: over 4096 elements), 3000 and 7 elements (fp32 state in memsave's
/// optimizers), from a seed.
Params make_params(uint64_t seed) {
  torch::manual_seed(seed);
  Params p;
  for (const auto& shape :
       {std::vector<int64_t>{50, 100}, std::vector<int64_t>{3000}, std::vector<int64_t>{7}})
    p.push_back(torch::randn(shape).requires_grad_());
  return p;
}

Params clone(const Params& params) {
  Params out;
  for (const auto& p : params) out.push_back(p.detach().clone().requires_grad_());
  return out;
}

/// The gradient of parameter i at step t: the same for every run of a test.
torch::Tensor gradient(const torch::Tensor& p, size_t i, int t) {
  torch::Generator gen = at::detail::createCPUGenerator(1000 * t + i);
  return torch::randn(p.sizes(), gen) * (1 + static_cast<double>(i));
}

void train(torch::optim::Optimizer& opt, const Params& params, int from_step, int steps) {
  for (int t = from_step; t < from_step + steps; ++t) {
    for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = gradient(params[i], i, t);
    opt.step();
  }
}

void expect_equal(const Params& a, const Params& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << what << ", parameter " << i;
}

Make adamw() {
  return [](const Params& p) {
    return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(1e-2));
  };
}
Make adamw8() {
  return [](const Params& p) { return std::make_unique<AdamW8bit>(p, AdamW8bitOptions(1e-2)); };
}
Make adamw4() {
  return [](const Params& p) { return std::make_unique<AdamW4bit>(p, AdamW4bitOptions(1e-2)); };
}
Make offload(int64_t bits, int64_t min_offload_size = 0) {
  return [=](const Params& p) {
    return std::make_unique<OffloadOptimizer>(
        p, OffloadOptimizerOptions(1e-2).state_bits(bits).min_offload_size(min_offload_size));
  };
}

TEST(CopyState, IntoTheSameFormatContinuesBitForBit) {
  // A copy into a second optimizer of the same kind, over a copy of the parameters: the two then take the
  // same steps, bit for bit (torch's SGD and memsave's SGD8bit each stand for themselves too).
  const std::vector<std::pair<std::string, Make>> kinds = {
      {"torch AdamW", adamw()},
      {"AdamW8bit", adamw8()},
      {"AdamW4bit", adamw4()},
      {"Lion8bit", [](const Params& p) { return std::make_unique<Lion8bit>(p, Lion8bitOptions(1e-3)); }},
      {"torch SGD",
       [](const Params& p) {
         return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(1e-2).momentum(0.9));
       }},
      {"SGD8bit", [](const Params& p) { return std::make_unique<SGD8bit>(p, SGD8bitOptions(1e-2)); }},
      {"SGD4bit", [](const Params& p) { return std::make_unique<SGD4bit>(p, SGD4bitOptions(1e-2)); }},
      {"offloaded fp32", offload(32, 10)},
      {"offloaded 8-bit", offload(8, 10)},
      {"offloaded 4-bit", offload(4)},
  };
  for (const auto& [name, make] : kinds) {
    SCOPED_TRACE(name);
    const Params a = make_params(1);
    auto from = make(a);
    train(*from, a, 1, 3);
    const Params b = clone(a);
    auto to = make(b);
    copy_state(*from, *to);
    train(*from, a, 4, 3);
    train(*to, b, 4, 3);
    expect_equal(a, b, "after the copy");
  }
}

// LibTorch's Module::parameters() lists a module used twice twice, and a LibTorch optimizer built over it
// keeps one state for both entries; memsave's optimizers (the Trainer's) list each parameter once. The copy
// takes each parameter's state once, in the order of first appearance.
TEST(CopyState, ASourceListingAParameterTwiceGivesEachStateOnce) {
  const Params a = make_params(1);
  auto from = adamw()(Params{a[0], a[1], a[0], a[2]});
  train(*from, a, 1, 3);
  const Params b = clone(a);
  auto to = adamw()(b);
  copy_state(*from, *to);
  for (size_t i = 0; i < a.size(); ++i) {
    const auto& x =
        static_cast<const torch::optim::AdamWParamState&>(*from->state().at(a[i].unsafeGetTensorImpl()));
    const auto& y =
        static_cast<const torch::optim::AdamWParamState&>(*to->state().at(b[i].unsafeGetTensorImpl()));
    EXPECT_EQ(x.step(), y.step()) << i;
    EXPECT_TRUE(torch::equal(x.exp_avg(), y.exp_avg())) << i;
    EXPECT_TRUE(torch::equal(x.exp_avg_sq(), y.exp_avg_sq())) << i;
  }
}

TEST(CopyState, ReplacesWhatTheTargetHeld) {
  // The source never stepped parameter 2 (no gradient); the target had: after the copy it has no state for
  // it, and its next step starts it afresh, as the source's would.
  const Params a = make_params(7);
  auto from = adamw()(a);
  for (int t = 1; t <= 2; ++t) {
    for (size_t i = 0; i < 2; ++i) a[i].mutable_grad() = gradient(a[i], i, t);
    from->step();
  }
  for (const auto& [name, make] : std::vector<std::pair<std::string, Make>>{
           {"AdamW8bit", adamw8()}, {"offloaded 8-bit", offload(8, 10)}, {"torch AdamW", adamw()}}) {
    SCOPED_TRACE(name);
    const Params b = clone(a);
    auto to = make(b);
    train(*to, b, 1, 2);
    copy_state(*from, *to);
    EXPECT_EQ(to->state().count(b[2].unsafeGetTensorImpl()), 0u);
    auto again = adamw()(clone(a));
    copy_state(*to, *again);
    const auto params = again->param_groups()[0].params();
    EXPECT_EQ(again->state().size(), 2u);
    EXPECT_EQ(again->state().count(params[2].unsafeGetTensorImpl()), 0u);
  }
}

/// Codes of a quantized state, one per element.
std::vector<int> codes_of(const torch::Tensor& packed, int bits, int64_t n) {
  const torch::Tensor bytes = packed.cpu();
  const uint8_t* c = bytes.data_ptr<uint8_t>();
  std::vector<int> out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = bits == 8 ? c[i] : (i % 2 == 0 ? c[i / 2] >> 4 : c[i / 2] & 15);
  return out;
}

/// The code of `book` nearest to x (brute force, ties to the code nearer zero).
int nearest(const k::CodeBook& book, float x) {
  int best = 0;
  for (int c = 1; c < book.count; ++c) {
    const double d = std::fabs(static_cast<double>(x) - book.code[c]);
    const double e = std::fabs(static_cast<double>(x) - book.code[best]);
    if (d < e || (d == e && std::fabs(book.code[c]) < std::fabs(book.code[best]))) best = c;
  }
  return best;
}

/// `moment` quantized blockwise to `bits` by brute force is what `state` holds.
void expect_nearest_codes(const torch::Tensor& moment, const torch::Tensor& codes,
                          const torch::Tensor& absmax, const k::CodeBook& book, int bits, int64_t block) {
  const torch::Tensor x = moment.reshape({-1}).contiguous();
  const int64_t n = x.numel();
  const std::vector<int> got = codes_of(codes, bits, n);
  const float* v = x.data_ptr<float>();
  const float* a = absmax.data_ptr<float>();
  ASSERT_EQ(absmax.numel(), (n + block - 1) / block);
  for (int64_t b = 0; b * block < n; ++b) {
    const torch::Tensor part = x.narrow(0, b * block, std::min(block, n - b * block));
    ASSERT_EQ(a[b], part.abs().max().item<float>()) << "block " << b;
    for (int64_t i = b * block; i < std::min(n, (b + 1) * block); ++i)
      ASSERT_EQ(got[i], nearest(book, v[i] * (1.0f / a[b]))) << "element " << i;
  }
}

TEST(CopyState, QuantizesFp32MomentsToTheNearestCodesOfTheTargetsFormat) {
  const Params a = make_params(2);
  auto from = adamw()(a);
  train(*from, a, 1, 4);
  for (const int bits : {8, 4}) {
    SCOPED_TRACE(std::to_string(bits) + "-bit");
    const Params b = clone(a);
    auto to = bits == 8 ? adamw8()(b) : adamw4()(b);
    copy_state(*from, *to);
    for (size_t i = 0; i < a.size(); ++i) {
      const auto& source =
          static_cast<const torch::optim::AdamWParamState&>(*from->state().at(a[i].unsafeGetTensorImpl()));
      const auto& target =
          static_cast<const QuantizedParamState&>(*to->state().at(b[i].unsafeGetTensorImpl()));
      EXPECT_EQ(target.step(), 4);
      if (a[i].numel() < 4096) {  // under min_8bit_size / min_4bit_size: fp32, as it was
        EXPECT_FALSE(target.quantized());
        EXPECT_TRUE(torch::equal(target.m(), source.exp_avg().reshape({-1})));
        EXPECT_TRUE(torch::equal(target.v(), source.exp_avg_sq().reshape({-1})));
        continue;
      }
      ASSERT_TRUE(target.quantized());
      const int64_t block = bits == 8 ? 256 : 128;  // the target's own block size
      EXPECT_EQ(target.block_size(), block);
      expect_nearest_codes(source.exp_avg(), target.m(), target.absmax_m(), k::signed_code_book(bits), bits,
                           block);
      expect_nearest_codes(source.exp_avg_sq(), target.v(), target.absmax_v(), k::unsigned_code_book(bits),
                           bits, block);
    }
  }
}

TEST(CopyState, QuantizesSgdMomentumToTheNearestFourBitCodes) {
  // LibTorch's momentum buffers into SGD4bit: on the signed book, blocks of 128; state of step 1.
  const Params a = make_params(4);
  torch::optim::SGD sgd(a, torch::optim::SGDOptions(1e-2).momentum(0.9));
  train(sgd, a, 1, 3);
  const Params b = clone(a);
  SGD4bit to(b, SGD4bitOptions(1e-2));
  copy_state(sgd, to);
  for (size_t i = 0; i < a.size(); ++i) {
    const auto& source =
        static_cast<const torch::optim::SGDParamState&>(*sgd.state().at(a[i].unsafeGetTensorImpl()));
    const auto& target = static_cast<const QuantizedParamState&>(*to.state().at(b[i].unsafeGetTensorImpl()));
    EXPECT_EQ(target.step(), 1);  // SGD's update does not depend on the count
    EXPECT_FALSE(target.v().defined());
    if (a[i].numel() < 4096) {  // under min_4bit_size: fp32, as it was
      EXPECT_FALSE(target.quantized());
      EXPECT_TRUE(torch::equal(target.m(), source.momentum_buffer().reshape({-1})));
      continue;
    }
    ASSERT_TRUE(target.quantized());
    EXPECT_EQ(target.block_size(), 128);
    EXPECT_EQ(target.bits(), 4);
    expect_nearest_codes(source.momentum_buffer(), target.m(), target.absmax_m(), k::signed_code_book(4), 4,
                         128);
  }
}

TEST(CopyState, QuantizesChannelsLastWeightsInTheirMemoryOrder) {
  // memsave's state of a channels_last weight follows the weight's memory (QuantizedParamState::strides): a
  // copy into it quantizes the blocks of that order, and a copy between two orders requantizes.
  const auto channels_last = [](const torch::Tensor& t) {
    return t.detach().contiguous(torch::MemoryFormat::ChannelsLast).requires_grad_();
  };
  const auto in_memory_order = [](const torch::Tensor& t) { return t.permute({0, 2, 3, 1}); };
  torch::manual_seed(7);
  // 18,432 elements (quantized) and 288 (fp32 state)
  const Params a = {channels_last(torch::randn({64, 32, 3, 3})), channels_last(torch::randn({8, 4, 3, 3}))};
  auto from = adamw()(a);
  train(*from, a, 1, 3);
  for (const int bits : {8, 4}) {
    SCOPED_TRACE(std::to_string(bits) + "-bit");
    const Make make = bits == 8 ? adamw8() : adamw4();
    const Params b = {channels_last(a[0]), channels_last(a[1])};
    auto to = make(b);
    copy_state(*from, *to);
    const auto& source =
        static_cast<const torch::optim::AdamWParamState&>(*from->state().at(a[0].unsafeGetTensorImpl()));
    const auto& target = static_cast<const QuantizedParamState&>(*to->state().at(b[0].unsafeGetTensorImpl()));
    ASSERT_TRUE(target.quantized());
    EXPECT_EQ(target.strides(), b[0].strides().vec());
    const int64_t block = bits == 8 ? 256 : 128;
    expect_nearest_codes(in_memory_order(source.exp_avg()), target.m(), target.absmax_m(),
                         k::signed_code_book(bits), bits, block);
    expect_nearest_codes(in_memory_order(source.exp_avg_sq()), target.v(), target.absmax_v(),
                         k::unsigned_code_book(bits), bits, block);
    const auto& small_source =
        static_cast<const torch::optim::AdamWParamState&>(*from->state().at(a[1].unsafeGetTensorImpl()));
    const auto& small = static_cast<const QuantizedParamState&>(*to->state().at(b[1].unsafeGetTensorImpl()));
    ASSERT_FALSE(small.quantized());
    EXPECT_EQ(small.strides(), b[1].strides().vec());
    EXPECT_TRUE(torch::equal(small.m(), in_memory_order(small_source.exp_avg()).reshape({-1})));

    // Into the same format over weights laid out alike: the codes as they are.
    const Params c = {channels_last(a[0]), channels_last(a[1])};
    auto same = make(c);
    copy_state(*to, *same);
    EXPECT_TRUE(target ==
                static_cast<const QuantizedParamState&>(*same->state().at(c[0].unsafeGetTensorImpl())));
    // Over row-major weights: the values read back, requantized in row-major blocks.
    const Params d = {a[0].detach().contiguous().requires_grad_(),
                      a[1].detach().contiguous().requires_grad_()};
    auto row_major = make(d);
    copy_state(*to, *row_major);
    const auto& requantized =
        static_cast<const QuantizedParamState&>(*row_major->state().at(d[0].unsafeGetTensorImpl()));
    EXPECT_TRUE(requantized.strides().empty());
    const auto values = static_cast<LowBitOptimizer&>(*to).state_fp32(b[0]);
    expect_nearest_codes(values[0], requantized.m(), requantized.absmax_m(), k::signed_code_book(bits), bits,
                         block);
    expect_nearest_codes(values[1], requantized.v(), requantized.absmax_v(), k::unsigned_code_book(bits),
                         bits, block);
    const auto& small_row_major =
        static_cast<const QuantizedParamState&>(*row_major->state().at(d[1].unsafeGetTensorImpl()));
    EXPECT_TRUE(torch::equal(small_row_major.m(),
                             static_cast<LowBitOptimizer&>(*to).state_fp32(b[1])[0].reshape({-1})));
  }
}

TEST(CopyState, IntoLibTorchsOptimizersLaysMomentsOutAsTheirOwnStepDoes) {
  // LibTorch's Adam, AdamW and SGD make a weight's moments like the weight (channels_last for a channels_last
  // weight): converted state takes the layout their first step would have given it, so that their later steps
  // run over tensors laid out alike.
  const auto channels_last = [](const torch::Tensor& t) {
    return t.detach().contiguous(torch::MemoryFormat::ChannelsLast).requires_grad_();
  };
  torch::manual_seed(7);
  const Params a = {channels_last(torch::randn({64, 32, 3, 3}))};
  const Make sgd = [](const Params& p) {
    return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(1e-2).momentum(0.9));
  };
  const Make sgd8 = [](const Params& p) {
    return std::make_unique<SGD8bit>(p, SGD8bitOptions(1e-2).momentum(0.9));
  };
  const auto train_like_autograd = [](torch::optim::Optimizer& o, const Params& p, int steps) {
    for (int t = 1; t <= steps; ++t) {  // gradients laid out as their weights, as autograd lays them out
      p[0].mutable_grad() = torch::empty_like(p[0]).copy_(gradient(p[0], 0, t));
      o.step();
    }
  };
  for (const auto& [lowbit, libtorch] : {std::pair{adamw8(), adamw()}, std::pair{sgd8, sgd}}) {
    auto from = lowbit(a);
    train_like_autograd(*from, a, 3);
    const Params own = {channels_last(a[0])}, converted = {channels_last(a[0])};
    auto reference = libtorch(own);
    train_like_autograd(*reference, own, 1);
    auto to = libtorch(converted);
    copy_state(*from, *to);
    const auto moments = [](const torch::optim::Optimizer& o, const torch::Tensor& p) {
      const auto& state = *o.state().at(p.unsafeGetTensorImpl());
      if (const auto* adam = dynamic_cast<const torch::optim::AdamWParamState*>(&state))
        return Params{adam->exp_avg(), adam->exp_avg_sq()};
      return Params{static_cast<const torch::optim::SGDParamState&>(state).momentum_buffer()};
    };
    const Params expected = moments(*reference, own[0]), actual = moments(*to, converted[0]);
    const Params values = static_cast<LowBitOptimizer&>(*from).state_fp32(a[0]);
    ASSERT_EQ(actual.size(), expected.size());
    for (size_t i = 0; i < actual.size(); ++i) {
      EXPECT_EQ(actual[i].strides(), expected[i].strides()) << "moment " << i;
      EXPECT_TRUE(torch::equal(actual[i], values[i])) << "moment " << i;
    }
  }
}

/// `fp32` (LibTorch's Adam or AdamW, whose state type is `State`) holds for each parameter exactly what
/// `quantized` reads back as, after `steps` steps.
template <typename State>
void expect_dequantized(const torch::optim::Optimizer& fp32, LowBitOptimizer& quantized, int64_t steps) {
  const auto fp32_params = fp32.param_groups()[0].params();
  const auto quantized_params = quantized.param_groups()[0].params();
  for (size_t i = 0; i < fp32_params.size(); ++i) {
    const auto expected = quantized.state_fp32(quantized_params[i]);
    const auto& s = static_cast<const State&>(*fp32.state().at(fp32_params[i].unsafeGetTensorImpl()));
    EXPECT_EQ(s.step(), steps);
    EXPECT_TRUE(torch::equal(s.exp_avg(), expected[0])) << i;
    EXPECT_TRUE(torch::equal(s.exp_avg_sq(), expected[1])) << i;
  }
}

TEST(CopyState, IntoFp32StateIsTheDequantizedState) {
  // 8-bit -> torch AdamW -> 4-bit -> offloaded fp32 -> torch Adam: each copy into fp32 holds exactly what the
  // state before it reads back as.
  const Params a = make_params(3);
  auto eight = adamw8()(a);
  train(*eight, a, 1, 3);
  auto fp32 = adamw()(clone(a));
  copy_state(*eight, *fp32);
  expect_dequantized<torch::optim::AdamWParamState>(*fp32, static_cast<LowBitOptimizer&>(*eight), 3);
  auto four = adamw4()(clone(a));
  copy_state(*fp32, *four);
  auto offloaded = offload(32)(clone(a));
  copy_state(*four, *offloaded);
  auto adam = std::make_unique<torch::optim::Adam>(clone(a), torch::optim::AdamOptions(1e-2));
  copy_state(*offloaded, *adam);
  expect_dequantized<torch::optim::AdamParamState>(*adam, static_cast<LowBitOptimizer&>(*four), 3);
}

TEST(CopyState, AConvertedRunKeepsItsMomentsAndFollowsTheFp32One) {
  // fp32 AdamW for 20 steps, then 30 more three ways: on in fp32, in 8-bit state converted from it, and in
  // 8-bit state started afresh (what resuming without conversion gives). The converted run stays near the
  // fp32 one; the fresh one restarts its moments and its bias correction, and strays much further.
  const Params a = make_params(4);
  auto fp32 = adamw()(a);
  train(*fp32, a, 1, 20);
  const Params converted = clone(a), fresh = clone(a);
  auto eight = adamw8()(converted);
  copy_state(*fp32, *eight);
  auto restart = adamw8()(fresh);
  train(*fp32, a, 21, 30);
  train(*eight, converted, 21, 30);
  train(*restart, fresh, 21, 30);
  for (size_t i = 0; i < a.size(); ++i) {
    const double off = (converted[i] - a[i]).abs().max().item<double>();
    const double restarted = (fresh[i] - a[i]).abs().max().item<double>();
    SCOPED_TRACE("parameter " + std::to_string(i) + ": converted " + std::to_string(off) + ", restarted " +
                 std::to_string(restarted));
    std::printf("parameter %zu: converted %.3g, restarted %.3g\n", i, off, restarted);
    EXPECT_LT(off, 0.02);  // 30 steps of lr 1e-2: a parameter moved up to 0.3
    EXPECT_LT(off, restarted / 4);
  }
}

TEST(CopyState, IntoAnOffloadingOptimizerMovesTheStateOffTheDevicePool) {
  // torch AdamW's fp32 state (on the CPU "device") into an OffloadOptimizer with 8-bit host state: the large
  // tensors' state leaves the device pool for the host arena (quantized), the small one's stays on the device
  // with the device's AdamW, exactly. CPU, simulated device.
  const Params a = make_params(5);
  auto from = adamw()(a);
  train(*from, a, 1, 2);
  const Params b = clone(a);
  auto to = offload(8, /*min_offload_size=*/10)(b);
  const int64_t device_before = memory_stats(torch::kCPU).current;
  const int64_t host_before = host_memory_stats().current;
  copy_state(*from, *to);
  const auto& o = static_cast<OffloadOptimizer&>(*to);
  // On the device: the 7-element tensor's two fp32 moments, all of them.
  int64_t device_state = 0;
  for (const auto& t : o.state_tensors()) device_state += t.nbytes();
  EXPECT_EQ(device_state, 2 * 7 * 4);
  EXPECT_EQ(memory_stats(torch::kCPU).current - device_before, device_state);
  // In the host arena: 5000 elements in 8-bit codes (20 blocks of 256) and 3000 in fp32 (under
  // min_8bit_size).
  const int64_t host_state = 2 * (5000 + 20 * 4) + 2 * 3000 * 4;
  EXPECT_EQ(host_memory_stats().current - host_before, host_state);
  EXPECT_TRUE(o.offloaded(b[0]) && o.offloaded(b[1]) && !o.offloaded(b[2]));
  // And it steps as an OffloadOptimizer given that state: within the 8-bit bound of the fp32 run.
  train(*from, a, 3, 5);
  train(*to, b, 3, 5);
  EXPECT_TRUE(torch::equal(a[2], b[2]));  // fp32 state on the device: torch's AdamW on both sides
  for (size_t i = 0; i < 2; ++i) EXPECT_LT((a[i] - b[i]).abs().max().item<double>(), 5e-3) << i;
}

TEST(CopyState, AnOffloadingTargetStepsDuringTheBackwardWhatItWasGiven) {
  // With step_during_backward, the backward after a copy steps each parameter that the copy gave state to,
  // beside the backward, and ends where the same optimizer stepping at step() ends.
  const Params a = make_params(8);
  auto from = adamw()(a);
  train(*from, a, 1, 2);
  const Params during = clone(a), at_step = clone(a);
  OffloadOptimizer beside(during, OffloadOptimizerOptions(1e-2).state_bits(8).step_during_backward(true));
  OffloadOptimizer plain(at_step, OffloadOptimizerOptions(1e-2).state_bits(8));
  copy_state(*from, beside);
  copy_state(*from, plain);
  for (const auto& [params, opt] : {std::pair<const Params*, OffloadOptimizer*>{&during, &beside},
                                    std::pair<const Params*, OffloadOptimizer*>{&at_step, &plain}}) {
    opt->zero_grad();
    torch::Tensor loss = torch::zeros({});
    for (size_t i = 0; i < params->size(); ++i)
      loss = loss + ((*params)[i] * gradient((*params)[i], i, 3)).sum();
    loss.backward();
    opt->step();
  }
  EXPECT_EQ(beside.last_step_copies().stepped_during_backward, 3);
  EXPECT_EQ(plain.last_step_copies().stepped_during_backward, 0);
  expect_equal(during, at_step, "stepped during the backward");
}

TEST(CopyState, OptimizersOverTheSameParametersArePairedTensorByTensor) {
  // LibTorch's AdamW over a model's parameters, and an optimizer over the same tensors listed otherwise
  // (another factory's groups): each takes its own tensor's state, not that of the one in its place. In
  // place 1 and 3 are two tensors of 3000 elements, which a copy by position would swap without an error.
  Params a = make_params(8);
  a.push_back(torch::randn({3000}).requires_grad_());
  auto source = adamw()(a);
  train(*source, a, 1, 3);
  const Params reordered = {a[0], a[3], a[2], a[1]};
  const Params subset = {a[3], a[1]};
  for (const auto& [name, make] : std::vector<std::pair<std::string, Make>>{
           {"fp32", adamw()}, {"8-bit", adamw8()}, {"4-bit", adamw4()}, {"offloaded 8-bit", offload(8)}}) {
    SCOPED_TRACE(name);
    // Reference: the same format over copies listed as the source lists its parameters (paired in order).
    const Params copies = clone(a);
    auto in_order = make(copies);
    copy_state(*source, *in_order);
    const auto expected = testing::adam_moments(*in_order);  // per parameter: m, v, step
    const auto of = [&](size_t i) {
      return std::vector<torch::Tensor>(expected.begin() + 3 * i, expected.begin() + 3 * i + 3);
    };
    const auto expect_moments = [&](const Params& listed, const std::vector<size_t>& which) {
      auto target = make(listed);
      copy_state(*source, *target);
      const auto got = testing::adam_moments(*target);
      ASSERT_EQ(got.size(), 3 * which.size());
      for (size_t j = 0; j < which.size(); ++j) {
        const auto want = of(which[j]);
        for (size_t k = 0; k < 3; ++k)
          EXPECT_TRUE(torch::equal(got[3 * j + k], want[k])) << "place " << j << ", tensor " << k;
      }
    };
    expect_moments(reordered, {0, 3, 2, 1});
    expect_moments(subset, {3, 1});  // a target over some of the source's parameters
  }
}

TEST(CopyStateErrors, WhatDoesNotFitChangesNothing) {
  const Params a = make_params(6);
  auto adamw_source = adamw()(a);
  train(*adamw_source, a, 1, 2);
  const Params b = clone(a);
  auto target = adamw8()(b);
  train(*target, b, 1, 1);
  const std::string before = saved_bytes(*target);
  auto expect_refused = [&](const torch::optim::Optimizer& from, const std::string& says) {
    SCOPED_TRACE(says);
    try {
      copy_state(from, *target);
      ADD_FAILURE() << "copied";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
    EXPECT_EQ(saved_bytes(*target), before);
  };
  const Params c = clone(a);
  torch::optim::SGD sgd(c, torch::optim::SGDOptions(0.1).momentum(0.9));
  train(sgd, c, 1, 1);
  expect_refused(sgd, "keeps SGD with momentum state, the target");
  Lion8bit lion(clone(a), Lion8bitOptions());
  expect_refused(lion, "keeps Lion state");
  Params fewer(a.begin(), a.begin() + 2);
  torch::optim::AdamW short_one(clone(fewer), torch::optim::AdamWOptions());
  expect_refused(short_one, "the source has 2 parameters, the target 3");
  Params reshaped = clone(a);
  reshaped[0] = torch::randn({100, 50}).requires_grad_();
  torch::optim::AdamW other_shape(reshaped, torch::optim::AdamWOptions());
  expect_refused(
      other_shape,
      "parameter 0 of the target is [50, 100], its source's (parameter 0 of the source) [100, 50]");
  // A source over some of the target's own parameters and copies of the others: neither pairing applies.
  Params some_shared = clone(b);
  some_shared[1] = b[1];
  torch::optim::AdamW mixed(some_shared, torch::optim::AdamWOptions());
  train(mixed, some_shared, 1, 1);
  expect_refused(mixed, "1 of the target's 3 parameters are the source's and the others are not");
  torch::optim::AdamW amsgrad(clone(a), torch::optim::AdamWOptions().amsgrad(true));
  expect_refused(amsgrad, "uses AMSGrad");
  torch::optim::RMSprop rmsprop(clone(a), torch::optim::RMSpropOptions());
  expect_refused(rmsprop, "the source (from) is a torch::optim::RMSprop");
  // Out of memory while the new state is built (8-bit codes for 8000 elements, fp32 for 3007).
  {
    ScopedBudget budget(torch::kCPU, memory_stats(torch::kCPU).current + 20000);
    EXPECT_THROW(copy_state(*adamw_source, *target), c10::OutOfMemoryError);
  }
  EXPECT_EQ(saved_bytes(*target), before);
  // Into SGD without momentum, which has nowhere to keep it.
  torch::optim::SGD plain(clone(a), torch::optim::SGDOptions(0.1));
  EXPECT_THROW(copy_state(sgd, plain), c10::Error);
  // And a copy that fits still works after all that.
  EXPECT_NO_THROW(copy_state(*adamw_source, *target));
  EXPECT_NE(saved_bytes(*target), before);
}

}  // namespace
}  // namespace memsave::optim
