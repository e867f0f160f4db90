// The CUDA optimizer kernels and their launch logic, compiled as host C++ and run on tests/kernels/simt.h's
// emulation of CUDA threads, against the CPU kernels: a machine without a GPU (this one, CI) checks every
// kernel's indexing, grid striding, block reductions, tails, argument packing and kernel choice bit for bit.
// What the emulation cannot check (the memory model of a real GPU, the speed, the CUDA runtime calls of
// optim_cuda.cu) is for tests/test_cuda.cpp on a GPU.
#include "simt.h"  // first: the CUDA primitives the kernels are written against

#include "optim_cpu.h"
#include "optim_cuda_kernels.cuh"
#include "qmap.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

namespace memsave::kernels {
namespace {

/// Runs step_with's launches on the emulator, as optim_cuda.cu's launcher runs them on a device that holds
/// `resident` thread blocks at once: fewer blocks than units, so the kernels stride.
struct EmulatedLaunch {
  std::int64_t resident = 2;
  int launches = 0;

  template <typename Kernel>
  int operator()(Kernel kernel, std::int64_t units, int groups, const LaunchArgs& args) {
    ++launches;
    simt::run(kernel, grid_blocks(units, groups, resident), kThreads, args);
    return 0;
  }
};

const char* rule_name(Rule rule) {
  static const char* const kRules[] = {"adam", "adamw", "lion", "sgd"};
  return kRules[static_cast<int>(rule)];
}

const char* dtype_name(DType dtype) {
  static const char* const kTypes[] = {"float32", "bfloat16", "float16"};
  return kTypes[static_cast<int>(dtype)];
}

struct Case {
  Rule rule = Rule::kAdamW;
  DType dtype = DType::kFloat32;
  bool quantized = true;
  std::int64_t block = 256;
  int bits = 8;

  std::string name() const {
    return std::string(rule_name(rule)) + " " + dtype_name(dtype) + " " +
           (quantized ? std::to_string(bits) + "-bit, block " + std::to_string(block)
                      : std::string("fp32 state"));
  }
};

std::size_t element_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

void store(DType dtype, std::vector<unsigned char>& bytes, std::int64_t i, float x) {
  unsigned char* at = bytes.data() + static_cast<std::size_t>(i) * element_size(dtype);
  if (dtype == DType::kFloat32) {
    std::memcpy(at, &x, 4);
  } else {
    const std::uint16_t bits =
        dtype == DType::kBFloat16 ? from_float<BFloat16>(x).bits : from_float<Float16>(x).bits;
    std::memcpy(at, &bits, 2);
  }
}

/// One parameter with its gradient and optimizer state, in host memory (the emulated device's memory too).
struct Tensor {
  std::int64_t numel = 0;
  std::vector<unsigned char> param, grad;
  std::vector<std::uint8_t> mq, vq;  // quantized state
  std::vector<float> m, v;           // fp32 state
  std::vector<float> absmax_m, absmax_v;
  StepScalars scalars;

  bool operator==(const Tensor& o) const {
    return param == o.param && mq == o.mq && vq == o.vq && same_bits(m, o.m) && same_bits(v, o.v) &&
           same_bits(absmax_m, o.absmax_m) && same_bits(absmax_v, o.absmax_v);
  }
  static bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() &&
           (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  }
};

/// Tensors of the given sizes with random parameters and random state (codes anywhere in the books, one
/// all-zero block per tensor where it has two), state as each rule keeps it.
std::vector<Tensor> make_tensors(const Case& s, const std::vector<std::int64_t>& sizes, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> code(0, 255);
  std::uniform_real_distribution<float> uniform(0.01f, 1.0f);
  const bool second = has_second_moment(s.rule);
  std::vector<Tensor> tensors(sizes.size());
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    Tensor& t = tensors[k];
    t.numel = sizes[k];
    const auto n = static_cast<std::size_t>(t.numel);
    t.param.resize(n * element_size(s.dtype));
    t.grad.resize(t.param.size());
    for (std::int64_t i = 0; i < t.numel; ++i) store(s.dtype, t.param, i, normal(rng));
    if (s.quantized) {
      const auto blocks = static_cast<std::size_t>((t.numel + s.block - 1) / s.block);
      t.mq.resize(static_cast<std::size_t>(code_bytes(t.numel, s.bits)));  // any byte holds two 4-bit codes
      for (auto& c : t.mq) c = static_cast<std::uint8_t>(code(rng));
      t.absmax_m.resize(blocks);
      for (float& a : t.absmax_m) a = uniform(rng);
      if (blocks > 1) t.absmax_m[1] = 0.0f;
      if (second) {
        t.vq.resize(t.mq.size());
        for (auto& c : t.vq) c = static_cast<std::uint8_t>(code(rng));
        t.absmax_v.resize(blocks);
        for (float& a : t.absmax_v) a = uniform(rng) * 1e-2f;
        if (blocks > 1) t.absmax_v[1] = 0.0f;
      }
    } else {
      t.m.resize(n);
      for (float& x : t.m) x = 0.1f * normal(rng);
      if (second) {
        t.v.resize(n);
        for (float& x : t.v) x = 1e-2f * std::fabs(normal(rng));
      }
    }
  }
  return tensors;
}

/// New gradients and per-tensor scalars for step t.
void next_step(const Case& s, std::vector<Tensor>& tensors, int t, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::size_t k = 0; k < tensors.size(); ++k) {
    Tensor& x = tensors[k];
    for (std::int64_t i = 0; i < x.numel; ++i)
      store(s.dtype, x.grad, i, normal(rng) * (i % 5 == 0 ? 1e-3f : 1.0f));
    // each tensor at its own step count; every third one late in training, where Adam's bias corrections
    // round to 1
    const int step = k % 3 == 2 ? 20000 + t : t + static_cast<int>(k % 3);
    switch (s.rule) {
      case Rule::kAdam:
      case Rule::kAdamW:
        x.scalars = make_step_scalars(s.rule, 1e-3, 0.9, 0.999, 1e-8, 0.01, step);
        break;
      case Rule::kLion:
        x.scalars = make_step_scalars(s.rule, 1e-4, 0.9, 0.99, 0, 0.01, step);
        break;
      case Rule::kSgd:
        x.scalars = make_step_scalars(s.rule, 0.05, 0.9, 0, 0, 1e-3, step, /*nesterov=*/k % 2 == 1,
                                      /*dampening=*/k % 2 == 1 ? 0.0 : 0.1);
        break;
    }
    // every other tensor with stochastic rounding (which bf16 parameters take and the others ignore)
    x.scalars.stochastic_round = k % 2 == 0 ? 1 : 0;
    x.scalars.round_seed = stochastic_round_seed(step, static_cast<std::int64_t>(k));
  }
}

/// The CPU kernels' step of every tensor: the reference.
void step_on_cpu(const Case& s, std::vector<Tensor>& tensors, float grad_scale) {
  const bool second = has_second_moment(s.rule);
  for (Tensor& t : tensors) {
    auto common = [&](auto& step) {  // the fields StepQuantized and Step32 share
      step.param = t.param.data();
      step.grad = t.grad.data();
      step.dtype = s.dtype;
      step.numel = t.numel;
      step.rule = s.rule;
      step.scalars = t.scalars;
      step.grad_scale = grad_scale;
    };
    if (s.quantized) {
      StepQuantized step;
      common(step);
      step.m = t.mq.data();
      step.v = second ? t.vq.data() : nullptr;
      step.absmax_m = t.absmax_m.data();
      step.absmax_v = second ? t.absmax_v.data() : nullptr;
      step.block_size = s.block;
      step.bits = s.bits;
      step_quantized_cpu(step, 0, (t.numel + s.block - 1) / s.block);
    } else {
      Step32 step;
      common(step);
      step.m = t.m.data();
      step.v = second ? t.v.data() : nullptr;
      step32_cpu(step, 0, t.numel);
    }
  }
}

/// The CUDA kernels' step of every tensor, in one call of the launch logic, on the emulator.
int step_emulated(const Case& s, std::vector<Tensor>& tensors, EmulatedLaunch& launch,
                  const float* inv_scale = nullptr, const float* found_inf = nullptr) {
  std::vector<CudaTensorStep> list;
  for (Tensor& t : tensors) {
    CudaTensorStep x;
    x.param = t.param.data();
    x.grad = t.grad.data();
    x.m = s.quantized ? static_cast<void*>(t.mq.data()) : static_cast<void*>(t.m.data());
    x.v = s.quantized ? static_cast<void*>(t.vq.data()) : static_cast<void*>(t.v.data());
    x.absmax_m = t.absmax_m.data();
    x.absmax_v = t.absmax_v.data();
    x.numel = t.numel;
    x.scalars = t.scalars;
    list.push_back(x);
  }
  CudaStep step;
  step.tensors = list.data();
  step.count = static_cast<int>(list.size());
  step.quantized = s.quantized;
  step.block_size = s.block;
  step.bits = s.bits;
  step.rule = s.rule;
  step.dtype = s.dtype;
  step.signed_book = &signed_code_book(s.bits);
  step.unsigned_book = &unsigned_code_book(s.bits);
  step.inv_scale = inv_scale;
  step.found_inf = found_inf;
  return step_with(step, launch);
}

/// Sizes with a one-element tensor, a short one and one of more units than the emulated device holds at once
/// (with a partial last unit).
std::vector<std::int64_t> sizes_for(const Case& s) {
  const std::int64_t unit = s.quantized ? s.block : kThreads * kPerThread32;
  const std::int64_t units = s.quantized && s.block <= kWarpBlock ? 2 * kThreads / 32 + 1 : 5;
  return {1, 37, units * unit + 17};
}

/// One test per rule and parameter type: a failure names its case, and ctest spreads the cases over the
/// cores.
class EmulatedCudaRule : public testing::TestWithParam<std::tuple<Rule, DType>> {};

TEST_P(EmulatedCudaRule, IsBitIdenticalToTheCpuKernelsForEveryStateAndShape) {
  const auto [rule, dtype] = GetParam();
  std::int64_t resident = 1;
  for (const auto& [block, bits] : std::vector<std::pair<std::int64_t, int>>{
           {0, 8}, {64, 8}, {256, 8}, {2048, 8}, {4096, 8}, {128, 4}, {256, 4}, {2048, 4}}) {
    const Case s{rule, dtype, block != 0, block != 0 ? block : 256, bits};
    SCOPED_TRACE(s.name());
    std::mt19937 rng(static_cast<unsigned>(block) * 7 + static_cast<unsigned>(rule) * 3 +
                     static_cast<unsigned>(dtype) + static_cast<unsigned>(bits));
    std::vector<Tensor> cuda = make_tensors(s, sizes_for(s), rng);
    std::vector<Tensor> cpu = cuda;
    resident = 3 - resident;  // 2 and 1 thread blocks in turn
    EmulatedLaunch launch{resident};
    for (int t = 1; t <= 3; ++t) {
      next_step(s, cuda, t, rng);
      for (std::size_t k = 0; k < cuda.size(); ++k) {
        cpu[k].grad = cuda[k].grad;
        cpu[k].scalars = cuda[k].scalars;
      }
      ASSERT_EQ(step_emulated(s, cuda, launch), 0);
      step_on_cpu(s, cpu, 1.0f);
      for (std::size_t k = 0; k < cuda.size(); ++k)
        ASSERT_TRUE(cuda[k] == cpu[k])
            << "tensor " << k << " (" << cuda[k].numel << " elements) differs after step " << t;
    }
    EXPECT_EQ(launch.launches, 3) << "one launch per step for all tensors";
  }
}

INSTANTIATE_TEST_SUITE_P(EveryRuleAndType, EmulatedCudaRule,
                         testing::Combine(testing::Values(Rule::kAdam, Rule::kAdamW, Rule::kLion, Rule::kSgd),
                                          testing::Values(DType::kFloat32, DType::kBFloat16,
                                                          DType::kFloat16)),
                         [](const testing::TestParamInfo<EmulatedCudaRule::ParamType>& info) {
                           return std::string(rule_name(std::get<0>(info.param))) + "_" +
                                  dtype_name(std::get<1>(info.param));
                         });

TEST(EmulatedCudaStep, SplitsLongTensorListsIntoLaunchesOfAtMostTheArgumentLimit) {
  const Case s{Rule::kAdamW, DType::kBFloat16, true, 64};
  std::mt19937 rng(5);
  std::vector<std::int64_t> sizes;
  for (int k = 0; k < kMaxLaunchTensors + 6; ++k) sizes.push_back(k % 7 == 3 ? 0 : 1 + (k * 97) % 300);
  std::vector<Tensor> cuda = make_tensors(s, sizes, rng);
  next_step(s, cuda, 1, rng);
  std::vector<Tensor> cpu = cuda;
  EmulatedLaunch launch;
  ASSERT_EQ(step_emulated(s, cuda, launch), 0);
  step_on_cpu(s, cpu, 1.0f);
  EXPECT_EQ(launch.launches, 2);
  for (std::size_t k = 0; k < cuda.size(); ++k) EXPECT_TRUE(cuda[k] == cpu[k]) << "tensor " << k;
}

TEST(EmulatedCudaStep, UnscalesByInvScaleAndChangesNothingWhenFoundInfIsSet) {
  for (const bool quantized : {true, false}) {
    const Case s{Rule::kAdam, DType::kFloat16, quantized, 256};
    SCOPED_TRACE(s.name());
    std::mt19937 rng(11);
    std::vector<Tensor> cuda = make_tensors(s, {300, 5000}, rng);
    next_step(s, cuda, 1, rng);
    const std::vector<Tensor> before = cuda;
    std::vector<Tensor> cpu = cuda;
    const float inv_scale = 1.0f / 64, found = 1.0f, not_found = 0.0f;
    EmulatedLaunch launch;
    ASSERT_EQ(step_emulated(s, cuda, launch, &inv_scale, &found), 0);
    for (std::size_t k = 0; k < cuda.size(); ++k)
      EXPECT_TRUE(cuda[k] == before[k]) << "skipped step, tensor " << k;
    ASSERT_EQ(step_emulated(s, cuda, launch, &inv_scale, &not_found), 0);
    step_on_cpu(s, cpu, inv_scale);
    for (std::size_t k = 0; k < cuda.size(); ++k)
      EXPECT_TRUE(cuda[k] == cpu[k]) << "unscaled step, tensor " << k;
    EXPECT_FALSE(cuda[0] == before[0]);
  }
}

TEST(EmulatedCudaStep, RefusesBlockSizesAndCodeWidthsOutsideTheCodeBooksBeforeLaunching) {
  for (const std::int64_t block : {std::int64_t{0}, kMinBlock - 2, kMaxBlock + 1}) {
    Case s{Rule::kAdamW, DType::kFloat32, true, 256};
    std::mt19937 rng(3);
    std::vector<Tensor> tensors = make_tensors(s, {100}, rng);
    next_step(s, tensors, 1, rng);
    const std::vector<Tensor> before = tensors;
    s.block = block;
    EmulatedLaunch launch;
    EXPECT_EQ(step_emulated(s, tensors, launch), kInvalidValue) << "block " << block;
    EXPECT_EQ(launch.launches, 0);
    EXPECT_TRUE(tensors[0] == before[0]);
  }
  Case s{Rule::kAdamW, DType::kFloat32, true, 256, 8};
  std::mt19937 rng(3);
  std::vector<Tensor> tensors = make_tensors(s, {100}, rng);
  next_step(s, tensors, 1, rng);
  s.bits = 6;  // codes of no book
  EmulatedLaunch launch;
  EXPECT_EQ(step_emulated(s, tensors, launch), kInvalidValue);
  EXPECT_EQ(launch.launches, 0);
}

// ---- the emulation itself -------------------------------------------------------------------------------

std::vector<std::uint32_t>* sums = nullptr;

/// Each thread's (block, thread) mixed into a value; the warp's and then the block's maximum by the same
/// reduction the optimizer kernels use.
__global__ void block_maxima(int salt) {
  std::uint32_t a = (blockIdx.x * 1000 + threadIdx.x) * 2654435761u + static_cast<std::uint32_t>(salt);
  std::uint32_t b = ~a;
  __shared__ std::uint32_t shared[2 * kThreads / 32];
  group_max<kThreads>(a, b, shared);
  (*sums)[blockIdx.x * kThreads + threadIdx.x] = a ^ b;
}

TEST(Simt, ShufflesAndBarriersReduceAsOnAGpu) {
  constexpr int kBlocks = 3;
  std::vector<std::uint32_t> out(kBlocks * kThreads);
  sums = &out;
  simt::run(block_maxima, kBlocks, kThreads, 7);
  sums = nullptr;
  for (unsigned b = 0; b < kBlocks; ++b) {
    std::uint32_t a = 0, c = 0;
    for (unsigned t = 0; t < kThreads; ++t) {
      const std::uint32_t x = (b * 1000 + t) * 2654435761u + 7u;
      a = std::max(a, x);
      c = std::max(c, ~x);
    }
    for (unsigned t = 0; t < kThreads; ++t)
      ASSERT_EQ(out[b * kThreads + t], a ^ c) << "block " << b << " thread " << t;
  }
}

__global__ void divergent_shuffle(int) {
  if (threadIdx.x % 32 == 5) return;
  (void)__shfl_xor_sync(0xffffffffu, 1.0f, 1);
}

TEST(SimtDeathTest, AShuffleThatALaneDoesNotReachStopsTheProgram) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(simt::run(divergent_shuffle, 1, 64, 0), "__shfl_xor_sync: a thread it waits for has returned");
}

}  // namespace
}  // namespace memsave::kernels
