// CUDA: the meter's device pool and budget, pinned host arena, the optimizer kernels' launches and scaler
// inputs, offload from a CUDA model and checkpointing on CUDA. Every test skips at run time without a device.
#include <memsave/amp.h>
#include <memsave/checkpoint.h>
#include <memsave/memory.h>
#include <memsave/offload.h>
#include <memsave/optim.h>
#include <memsave/rescue.h>
#include <memsave/trainer.h>

#include "../kernels/fingerprint.h"
#include "../kernels/optim_cuda.h"
#include "../src/memory_internal.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace memsave {
namespace {

#define SKIP_WITHOUT_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device"

const torch::Device kCuda(torch::kCUDA, 0);

TEST(CudaMeter, CountsTheCachingAllocatorsBytesExactly) {
  SKIP_WITHOUT_CUDA();
  torch::cuda::synchronize();
  const int64_t before = memory_stats(kCuda).current;
  {
    const auto t = torch::empty({1 << 20}, torch::TensorOptions().device(kCuda));  // 4 MiB, a multiple of 512
    EXPECT_EQ(memory_stats(kCuda).current - before, 4 << 20);
    PeakScope scope(kCuda);
    { const auto u = torch::empty({1 << 18}, torch::TensorOptions().device(kCuda)); }
    EXPECT_EQ(scope.peak() - scope.start(), 1 << 20);
  }
  EXPECT_EQ(memory_stats(kCuda).current, before);
}

TEST(CudaMeter, WorksInAProgramThatHasNotUsedCudaYet) {
  SKIP_WITHOUT_CUDA();
  // A fresh process (the death test runs this test again in a new one), where no CUDA tensor has been made:
  // setting a budget first and reading the pool, as a user rescuing a model does, must not meet LibTorch's
  // uninitialized caching allocator ("did you call init?").
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
  EXPECT_EXIT(
      {
        set_budget(kCuda, int64_t{1} << 30);
        const MemoryStats stats = memory_stats(kCuda);
        const PeakScope scope(kCuda);
        reset_peak(kCuda);
        std::exit(stats.budget == (int64_t{1} << 30) && scope.peak() >= 0 ? 0 : 1);  // an error: abort
      },
      ::testing::ExitedWithCode(0), "");
  EXPECT_THROW(memory_stats(torch::Device(torch::kCUDA, 99)), c10::Error);  // no such device: a clear error
}

TEST(CudaMeter, ABudgetBoundsTheDevicePool) {
  SKIP_WITHOUT_CUDA();
  c10::cuda::CUDACachingAllocator::emptyCache();
  {
    ScopedBudget budget(kCuda, int64_t{256} << 20);
    EXPECT_EQ(get_budget(kCuda), int64_t{256} << 20);
    EXPECT_NO_THROW(torch::empty({16 << 20}, torch::TensorOptions().device(kCuda)));  // 64 MiB
    EXPECT_THROW(torch::empty({128 << 20}, torch::TensorOptions().device(kCuda)),
                 c10::OutOfMemoryError);  // 512 MiB
  }
  EXPECT_FALSE(get_budget(kCuda).has_value());
  EXPECT_NO_THROW(torch::empty({128 << 20}, torch::TensorOptions().device(kCuda)));
}

TEST(CudaMeter, TheHostArenaIsPinned) {
  SKIP_WITHOUT_CUDA();
  EXPECT_TRUE(host_memory_is_pinned());
  const auto h = host_empty({1024}, torch::kFloat);
  EXPECT_TRUE(h.is_pinned());
  const auto d = h.fill_(3).to(kCuda, /*non_blocking=*/true);
  EXPECT_EQ(d.sum().item<float>(), 3072.0f);
}

TEST(CudaMeter, AnArenaBlockIsNotHandedOutAgainWhileACopyStillReadsIt) {
  SKIP_WITHOUT_CUDA();
  // A copy to the device queued behind a long sleep reads an arena tensor that is then freed. The next arena
  // tensor of that size must not get the block (and be written) before the copy has run: LibTorch's copy_
  // cannot find the caching host allocator's block under an arena tensor, memsave tells it.
  const int64_t n = int64_t{1} << 20;
  auto on_device = torch::empty({n}, torch::TensorOptions().device(kCuda));
  torch::cuda::synchronize();
  const void* first = nullptr;
  {
    const auto host = host_empty({n}, torch::kFloat).fill_(1);
    first = host.data_ptr();
    const c10::cuda::CUDAStream stream = at::cuda::getCurrentCUDAStream();
    at::cuda::sleep(int64_t{1} << 30);  // about half a second
    on_device.copy_(host, /*non_blocking=*/true);
    detail::cuda_record_host_use(host, stream);
  }
  const auto again = host_empty({n}, torch::kFloat).fill_(2);
  EXPECT_NE(again.data_ptr(), first);
  EXPECT_EQ(on_device.sum().item<float>(), static_cast<float>(n)) << "the copy read the new tensor's 2s";
}

TEST(CudaOptim, OneLaunchPerGroupOfTensors) {
  SKIP_WITHOUT_CUDA();
  std::vector<torch::Tensor> big, small;
  for (int i = 0; i < 30; ++i)
    big.push_back(torch::randn({5000}, torch::TensorOptions().device(kCuda)).requires_grad_());
  for (int i = 0; i < 10; ++i)
    small.push_back(torch::randn({100}, torch::TensorOptions().device(kCuda)).requires_grad_());
  std::vector<torch::Tensor> ten(big.begin(), big.begin() + 10);
  optim::AdamW8bit a(ten);
  for (auto& p : ten) p.mutable_grad() = torch::randn_like(p);
  int64_t before = kernels::cuda_step_launches();
  a.step();
  EXPECT_EQ(kernels::cuda_step_launches() - before, 1) << "10 tensors of one kind: one launch";

  std::vector<torch::Tensor> all = big;
  all.insert(all.end(), small.begin(), small.end());
  optim::AdamW8bit b(all);
  for (auto& p : all) p.mutable_grad() = torch::randn_like(p);
  before = kernels::cuda_step_launches();
  b.step();
  // 30 quantized tensors: two launches of at most kMaxLaunchTensors; 10 fp32-state tensors: one more
  EXPECT_EQ(kernels::cuda_step_launches() - before, 3);
}

TEST(CudaOptim, StepsOnTheCurrentStream) {
  SKIP_WITHOUT_CUDA();
  // On a side stream made current: a long sleep, then the gradient's new value, then the step. A step queued
  // on that stream sees the new gradient; one on any other stream would run ahead and read the old value.
  torch::manual_seed(0);
  const auto start = torch::randn({8192}), old_grad = torch::randn({8192}), new_grad = torch::randn({8192});
  auto p = start.cuda().requires_grad_();
  auto reference = start.clone().requires_grad_();
  optim::AdamW8bit a(std::vector<torch::Tensor>{p});
  optim::AdamW8bit b(std::vector<torch::Tensor>{reference});
  p.mutable_grad() = old_grad.cuda();
  reference.mutable_grad() = old_grad.clone();
  a.step();  // the state exists before the timed part: nothing below allocates or waits
  b.step();
  const auto new_on_device = new_grad.cuda();
  torch::cuda::synchronize();
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, 0);
  {
    const c10::cuda::CUDAStreamGuard guard(side);
    at::cuda::sleep(int64_t{1} << 30);  // about half a second
    p.mutable_grad().copy_(new_on_device);
    a.step();
  }
  torch::cuda::synchronize();
  reference.mutable_grad() = new_grad;
  b.step();
  EXPECT_TRUE(torch::equal(p.detach().cpu(), reference.detach()));
}

TEST(CudaOptim, KernelHonoursInvScaleAndFoundInf) {
  SKIP_WITHOUT_CUDA();
  const auto opts = torch::TensorOptions().device(kCuda);
  // the parameters before and after a step; the same start in every call (seeded on the device's generator)
  auto run = [&](float grad_factor, float inv_scale, float found_inf) {
    torch::manual_seed(0);
    auto p = torch::randn({4096}, opts);
    const auto before = p.cpu();
    auto g = torch::randn({4096}, opts) * grad_factor;
    auto m = torch::full({4096}, 127, opts.dtype(torch::kUInt8)),
         v = torch::zeros({4096}, opts.dtype(torch::kUInt8));
    auto am = torch::zeros({16}, opts), av = torch::zeros({16}, opts);
    auto scale = torch::full({1}, inv_scale, opts), inf = torch::full({1}, found_inf, opts);
    const auto books =
        torch::empty({2, static_cast<int64_t>(sizeof(kernels::CodeBook))}, opts.dtype(torch::kUInt8));
    books[0].copy_(torch::from_blob(const_cast<kernels::CodeBook*>(&kernels::signed_code_book()),
                                    {static_cast<int64_t>(sizeof(kernels::CodeBook))}, torch::kUInt8));
    books[1].copy_(torch::from_blob(const_cast<kernels::CodeBook*>(&kernels::unsigned_code_book()),
                                    {static_cast<int64_t>(sizeof(kernels::CodeBook))}, torch::kUInt8));
    kernels::CudaTensorStep t;
    t.param = p.data_ptr();
    t.grad = g.data_ptr();
    t.m = m.data_ptr();
    t.v = v.data_ptr();
    t.absmax_m = am.data_ptr<float>();
    t.absmax_v = av.data_ptr<float>();
    t.numel = 4096;
    t.scalars = kernels::make_step_scalars(kernels::Rule::kAdamW, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1);
    kernels::CudaStep step;
    step.tensors = &t;
    step.count = 1;
    step.signed_book = reinterpret_cast<const kernels::CodeBook*>(books[0].data_ptr());
    step.unsigned_book = reinterpret_cast<const kernels::CodeBook*>(books[1].data_ptr());
    step.inv_scale = scale.data_ptr<float>();
    step.found_inf = inf.data_ptr<float>();
    EXPECT_EQ(kernels::launch_step_cuda(step, at::cuda::getCurrentCUDAStream().stream()), 0);
    return std::make_pair(before, p.cpu());
  };
  const auto [start, plain] = run(1, 1, 0);
  EXPECT_FALSE(torch::equal(plain, start)) << "the step must change the parameters";
  EXPECT_TRUE(torch::equal(plain, run(1024, 1.0f / 1024, 0).second));  // unscaling by a power of two is exact
  const auto [start_inf, after_inf] = run(1, 1, 1);
  EXPECT_TRUE(torch::equal(start_inf, start));
  EXPECT_TRUE(torch::equal(after_inf, start)) << "found_inf must leave the parameters unchanged";
}

/// 2^31 + 1000 bf16 elements (about 12 GiB with gradient and state) stepped by `Optimizer` with blocks of
/// `block`. Blocks are stepped independently, so the last 5096 elements, from a block boundary below 2^31 to
/// the end, stepped on their own on the CPU are the reference for that stretch of the big tensor.
template <typename Optimizer, typename Options>
void expect_64_bit_indexing(int64_t block, int64_t bits) {
  const int64_t n = (int64_t{1} << 31) + 1000, from = n - 5096;
  const auto opts = torch::TensorOptions().device(kCuda).dtype(torch::kBFloat16);
  auto p = torch::randn({n}, opts).requires_grad_();
  auto tail = p.detach().slice(0, from).cpu().requires_grad_();
  Optimizer big(std::vector<torch::Tensor>{p}, Options(1e-3).block_size(block));
  Optimizer small(std::vector<torch::Tensor>{tail}, Options(1e-3).block_size(block));
  for (int t = 0; t < 2; ++t) {
    p.mutable_grad() = torch::randn({n}, opts);
    tail.mutable_grad() = p.grad().slice(0, from).cpu();
    big.step();
    small.step();
  }
  EXPECT_TRUE(torch::equal(p.detach().slice(0, from).cpu(), tail.detach()));
  const auto& s = static_cast<optim::QuantizedParamState&>(*big.state().at(p.unsafeGetTensorImpl()));
  const auto& r = static_cast<optim::QuantizedParamState&>(*small.state().at(tail.unsafeGetTensorImpl()));
  const int64_t from_byte = bits == 4 ? from / 2 : from;  // `from` is even: a byte boundary for 4-bit codes
  EXPECT_TRUE(torch::equal(s.m().slice(0, from_byte).cpu(), r.m()));
  EXPECT_TRUE(torch::equal(s.v().slice(0, from_byte).cpu(), r.v()));
  EXPECT_TRUE(torch::equal(s.absmax_m().slice(0, from / block).cpu(), r.absmax_m()));
  EXPECT_TRUE(torch::equal(s.absmax_v().slice(0, from / block).cpu(), r.absmax_v()));
}

TEST(CudaOptim, IndexesTensorsOfMoreThanTwoTo31Elements) {
  SKIP_WITHOUT_CUDA();
  expect_64_bit_indexing<optim::AdamW8bit, optim::AdamW8bitOptions>(256, 8);
  expect_64_bit_indexing<optim::AdamW4bit, optim::AdamW4bitOptions>(128, 4);
}

TEST(CudaOffload, StepsACudaModelExactlyAsACpuModel) {
  SKIP_WITHOUT_CUDA();
  // The host step is the same CPU kernel whatever the device: with the same gradients, a CUDA model and a CPU
  // model end bit-identical, and the CUDA pool holds no optimizer state.
  torch::manual_seed(0);
  auto cpu = torch::nn::Linear(256, 256), cuda = torch::nn::Linear(256, 256);
  {
    torch::NoGradGuard no_grad;
    cuda->weight.copy_(cpu->weight);
    cuda->bias.copy_(cpu->bias);
  }
  cuda->to(kCuda);
  for (int64_t bits : {32, 8, 4}) {
    OffloadOptimizer a(cpu->parameters(), OffloadOptimizerOptions(1e-3).state_bits(bits));
    OffloadOptimizer b(cuda->parameters(), OffloadOptimizerOptions(1e-3).state_bits(bits));
    EXPECT_TRUE(b.state_tensors().empty());
    for (int step = 0; step < 5; ++step) {
      for (size_t i = 0; i < 2; ++i) {
        const auto g = torch::randn(cpu->parameters()[i].sizes());
        cpu->parameters()[i].mutable_grad() = g;
        cuda->parameters()[i].mutable_grad() = g.to(kCuda);
      }
      a.step();
      b.step();
    }
    for (size_t i = 0; i < 2; ++i)
      EXPECT_TRUE(torch::equal(cpu->parameters()[i], cuda->parameters()[i].cpu()));
    // the masters and gradient buffers, which copies read and write, are pinned; the state is not
    const std::vector<torch::Tensor> host = b.host_state_tensors();
    ASSERT_GT(host.size(), 4u);
    for (size_t i = 0; i < host.size(); ++i) EXPECT_EQ(host[i].is_pinned(), i < 4) << bits << " bits, " << i;
  }
}

TEST(CudaOffload, HalfPrecisionParametersAreConvertedOnTheHost) {
  SKIP_WITHOUT_CUDA();
  // bf16 parameters on CUDA: the gradients land in host buffers of their dtype, and the stepped masters are
  // converted into them before the copy back, so no copy converts on the device. The parameters end with the
  // bits of a bf16 CPU model given the same gradients, whichever way the gradients are copied, and the host
  // holds 2 more bytes per parameter than for that CPU model.
  const auto ways = {OffloadOptimizerOptions(1e-3), OffloadOptimizerOptions(1e-3).copy_during_backward(true),
                     OffloadOptimizerOptions(1e-3).step_during_backward(true)};
  for (const OffloadOptimizerOptions& way : ways) {
    torch::manual_seed(0);
    auto cpu = torch::nn::Linear(512, 256);
    cpu->to(torch::kBFloat16);
    auto cuda = torch::nn::Linear(512, 256);
    {
      torch::NoGradGuard no_grad;
      cuda->weight.copy_(cpu->weight);
      cuda->bias.copy_(cpu->bias);
    }
    cuda->to(kCuda, torch::kBFloat16);
    OffloadOptimizer a(cpu->parameters(), OffloadOptimizerOptions(1e-3).state_bits(8));
    OffloadOptimizer b(cuda->parameters(), OffloadOptimizerOptions(way).state_bits(8));
    auto host_bytes = [](const OffloadOptimizer& opt) {
      int64_t bytes = 0;
      for (const auto& t : opt.host_state_tensors()) bytes += t.nbytes();
      return bytes;
    };
    EXPECT_EQ(host_bytes(b) - host_bytes(a), 2 * (512 * 256 + 256));
    for (int step = 0; step < 4; ++step) {
      b.zero_grad();
      const auto x = torch::randn({32, 512}).to(kCuda, torch::kBFloat16);
      cuda->forward(x).to(torch::kFloat).square().sum().backward();
      b.step();
      for (size_t i = 0; i < 2; ++i) cpu->parameters()[i].mutable_grad() = cuda->parameters()[i].grad().cpu();
      a.step();
      for (size_t i = 0; i < 2; ++i)
        EXPECT_TRUE(torch::equal(cpu->parameters()[i], cuda->parameters()[i].cpu())) << step << " " << i;
    }
  }
}

/// The same small CUDA model every call (seeded).
torch::nn::Sequential cuda_mlp() {
  torch::manual_seed(1);
  auto net =
      torch::nn::Sequential(torch::nn::Linear(512, 1024), torch::nn::Tanh(), torch::nn::Linear(1024, 10));
  net->to(kCuda);
  return net;
}

/// The loss the Trainer tests step with.
torch::Tensor ce(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(out, target);
}

/// A cuda_mlp that an fp32 AdamW Trainer stepped once on (x, y) and saved to `file` (in the temporary
/// directory): a file to resume under a recipe with other state.
struct SavedRun {
  torch::nn::Sequential net;
  torch::Tensor x, y;
  std::string file;
};
SavedRun saved_fp32_run(uint64_t seed, const std::string& name) {
  torch::manual_seed(seed);
  SavedRun run;
  run.x = torch::randn({32, 512}, kCuda);
  run.y = torch::randint(10, {32}, torch::TensorOptions(kCuda).dtype(torch::kLong));
  run.file = (std::filesystem::temp_directory_path() / name).string();
  run.net = cuda_mlp();
  Trainer trainer(run.net, adamw(1e-3), Recipe());
  trainer.step(run.x, run.y, ce);
  trainer.save(run.file);
  return run;
}

/// Two CUDA models, one offloaded with `during` (work done while the backward runs) and one with the copies
/// made at the step, stay bit-identical over 5 steps; with `max_norm`, LibTorch's clip_grad_norm_ clips the
/// gradients of both after each backward.
void expect_backward_work_gives_the_same_steps(const OffloadOptimizerOptions& during_options,
                                               double max_norm = 0) {
  auto during = cuda_mlp(), at_step = cuda_mlp();
  OffloadOptimizer a(during->parameters(), during_options);
  OffloadOptimizer b(at_step->parameters(), OffloadOptimizerOptions(during_options.lr()));
  torch::manual_seed(2);
  for (int step = 0; step < 5; ++step) {
    const auto x = torch::randn({64, 512}, kCuda),
               y = torch::randint(10, {64}, torch::TensorOptions(kCuda).dtype(torch::kLong));
    for (auto* opt : {&a, &b}) {
      auto& net = opt == &a ? during : at_step;
      opt->zero_grad();
      torch::nn::functional::cross_entropy(net->forward(x), y).backward();
      if (max_norm > 0) {
        ASSERT_GT(torch::nn::utils::clip_grad_norm_(net->parameters(), max_norm), max_norm);  // it clips
      }
      opt->step();
    }
    EXPECT_EQ(a.last_step_copies().during_backward, 4);
    EXPECT_EQ(a.last_step_copies().at_step, max_norm > 0 ? 4 : 0);  // the clipped ones again
    // The first step creates the state, at the step; from then on the backward steps every parameter.
    if (during_options.step_during_backward()) {
      EXPECT_EQ(a.last_step_copies().stepped_during_backward, step == 0 ? 0 : 4);
    }
  }
  for (size_t i = 0; i < during->parameters().size(); ++i)
    EXPECT_TRUE(torch::equal(during->parameters()[i], at_step->parameters()[i])) << i;
}

TEST(CudaOffload, GradientsCopiedOnTheSideStreamDuringTheBackwardGiveTheSameStep) {
  SKIP_WITHOUT_CUDA();
  expect_backward_work_gives_the_same_steps(OffloadOptimizerOptions(1e-3).copy_during_backward(true));
}

TEST(CudaOffload, ParametersSteppedDuringTheBackwardGiveTheSameStep) {
  SKIP_WITHOUT_CUDA();
  // The host thread waits for each gradient's copy, steps, and copies the parameter back on a stream of its
  // own, which the step waits for before the next forward.
  expect_backward_work_gives_the_same_steps(OffloadOptimizerOptions(1e-3).step_during_backward(true));
}

TEST(CudaOffload, FingerprintsOnTheDeviceAreTheCpuFingerprints) {
  SKIP_WITHOUT_CUDA();
  // kernels/fingerprint_cuda.cu against kernels/fingerprint.h over the same bits: one element, four thread
  // blocks' worth, and 10^8 elements, where the grid strides.
  torch::manual_seed(4);
  for (const auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    for (const int64_t n : {int64_t{1}, int64_t{1000}, int64_t{100000007}}) {
      const torch::Tensor g = torch::randn({n}, torch::TensorOptions(kCuda).dtype(dtype));
      torch::Tensor out = torch::full({1}, -1, torch::TensorOptions(kCuda).dtype(torch::kLong));
      kernels::CudaFingerprint f;
      f.data = g.data_ptr();
      f.dtype = dtype == torch::kFloat      ? kernels::DType::kFloat32
                : dtype == torch::kBFloat16 ? kernels::DType::kBFloat16
                                            : kernels::DType::kFloat16;
      f.numel = n;
      f.out = reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>());
      ASSERT_EQ(kernels::launch_fingerprint_cuda(f, at::cuda::getCurrentCUDAStream().stream()), 0);
      const torch::Tensor host = g.cpu();
      EXPECT_EQ(static_cast<uint64_t>(out.cpu().item<int64_t>()),
                kernels::fingerprint(host.data_ptr(), f.dtype, 0, n))
          << dtype << " " << n;
    }
  }
}

TEST(CudaOffload, AClipThroughDataAfterTheBackwardIsCopiedAgain) {
  SKIP_WITHOUT_CUDA();
  // LibTorch's clip_grad_norm_ writes through .data() on the compute stream, while the side stream may
  // still be copying: the fingerprints taken before the copies see it, and the step copies every clipped
  // gradient again.
  expect_backward_work_gives_the_same_steps(OffloadOptimizerOptions(1e-3).copy_during_backward(true),
                                            /*max_norm=*/1e-3);
}

TEST(CudaOffload, TheTrainerStepsDuringTheBackwardOnCuda) {
  SKIP_WITHOUT_CUDA();
  // A Trainer given an optimizer that steps during the backward: its accumulator defers the copies to the
  // last micro-batch, whose backward steps. The same steps as memsave::adamw's (copies during the backward,
  // stepped at the step).
  auto during = cuda_mlp(), at_step = cuda_mlp();
  const Recipe recipe = Recipe().offload(Offload::kOptimizerState).micro_batch(24);  // 24 + 24 + 16
  auto opt = std::make_shared<OffloadOptimizer>(during->parameters(),
                                                OffloadOptimizerOptions(1e-3).step_during_backward(true));
  Trainer a(during, opt, recipe);
  Trainer b(at_step, adamw(1e-3), recipe);
  torch::manual_seed(2);
  for (int step = 0; step < 4; ++step) {
    const auto x = torch::randn({64, 512}, kCuda),
               y = torch::randint(10, {64}, torch::TensorOptions(kCuda).dtype(torch::kLong));
    a.step(x, y, ce);
    b.step(x, y, ce);
    EXPECT_EQ(opt->last_step_copies().stepped_during_backward, step == 0 ? 0 : 4);
  }
  for (size_t i = 0; i < during->parameters().size(); ++i)
    EXPECT_TRUE(torch::equal(during->parameters()[i], at_step->parameters()[i])) << i;
}

TEST(CudaTrainer, SaveAndLoadResumeExactlyOnCuda) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(3);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
  for (int s = 0; s < 4; ++s)
    batches.emplace_back(torch::randn({32, 512}, kCuda),
                         torch::randint(10, {32}, torch::TensorOptions(kCuda).dtype(torch::kLong)));
  const std::string file = (std::filesystem::temp_directory_path() / "memsave_cuda_trainer.pt").string();
  for (const Recipe& recipe : {Recipe().amp(torch::kHalf).state_bits(8), Recipe().amp(torch::kBFloat16),
                               Recipe().offload(Offload::kOptimizerState).state_bits(8).micro_batch(16),
                               Recipe().offload(Offload::kOptimizerState).amp(torch::kHalf)}) {
    SCOPED_TRACE(recipe.label());
    auto straight = cuda_mlp();
    Trainer a(straight, adamw(1e-3), recipe);
    for (int s = 0; s < 2; ++s) a.step(batches[s].first, batches[s].second, ce);
    a.save(file);
    for (int s = 2; s < 4; ++s) a.step(batches[s].first, batches[s].second, ce);
    auto resumed = cuda_mlp();
    Trainer b(resumed, adamw(1e-3), recipe);
    b.load(file);
    for (int s = 2; s < 4; ++s) b.step(batches[s].first, batches[s].second, ce);
    for (size_t i = 0; i < straight->parameters().size(); ++i)
      EXPECT_TRUE(torch::equal(straight->parameters()[i], resumed->parameters()[i])) << i;
    EXPECT_EQ(a.scaler() != nullptr, recipe.scales_gradients());
    if (a.scaler() != nullptr) {
      EXPECT_EQ(a.scaler()->get_scale(), b.scaler()->get_scale());
    }
  }
  std::filesystem::remove(file);
}

TEST(CudaCopyState, ConvertsCudaStateAsItConvertsCpuState) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(4);
  const torch::Tensor start = torch::randn({300, 100});
  const torch::Tensor cpu_param = start.clone().requires_grad_();
  const torch::Tensor cuda_param = start.to(kCuda).requires_grad_();
  torch::optim::AdamW cpu_adamw({cpu_param}, torch::optim::AdamWOptions(1e-2));
  for (int t = 0; t < 3; ++t) {
    cpu_param.mutable_grad() = torch::randn({300, 100});
    cpu_adamw.step();
  }
  torch::optim::AdamW cuda_adamw({cuda_param}, torch::optim::AdamWOptions(1e-2));
  optim::copy_state(cpu_adamw, cuda_adamw);  // across devices, exactly
  const auto& moved = static_cast<const torch::optim::AdamWParamState&>(
      *cuda_adamw.state().at(cuda_param.unsafeGetTensorImpl()));
  ASSERT_TRUE(moved.exp_avg().is_cuda());
  for (const int bits : {8, 4}) {
    SCOPED_TRACE(std::to_string(bits) + "-bit");
    std::unique_ptr<optim::LowBitOptimizer> on_cpu, on_cuda;
    if (bits == 8) {
      on_cpu = std::make_unique<optim::AdamW8bit>(std::vector<torch::Tensor>{cpu_param});
      on_cuda = std::make_unique<optim::AdamW8bit>(std::vector<torch::Tensor>{cuda_param});
    } else {
      on_cpu = std::make_unique<optim::AdamW4bit>(std::vector<torch::Tensor>{cpu_param});
      on_cuda = std::make_unique<optim::AdamW4bit>(std::vector<torch::Tensor>{cuda_param});
    }
    optim::copy_state(cpu_adamw, *on_cpu);
    optim::copy_state(cuda_adamw, *on_cuda);
    const auto& a =
        static_cast<const optim::QuantizedParamState&>(*on_cpu->state().at(cpu_param.unsafeGetTensorImpl()));
    const auto& b = static_cast<const optim::QuantizedParamState&>(
        *on_cuda->state().at(cuda_param.unsafeGetTensorImpl()));
    ASSERT_TRUE(b.m().is_cuda() && b.absmax_v().is_cuda());
    EXPECT_TRUE(torch::equal(a.m(), b.m().cpu()) && torch::equal(a.v(), b.v().cpu()));
    EXPECT_TRUE(torch::equal(a.absmax_m(), b.absmax_m().cpu()) &&
                torch::equal(a.absmax_v(), b.absmax_v().cpu()));
    // Back into fp32 on the device: the dequantized state, on the device.
    torch::optim::AdamW back({cuda_param}, torch::optim::AdamWOptions(1e-2));
    optim::copy_state(*on_cuda, back);
    const auto& s =
        static_cast<const torch::optim::AdamWParamState&>(*back.state().at(cuda_param.unsafeGetTensorImpl()));
    EXPECT_TRUE(s.exp_avg().is_cuda());
    EXPECT_TRUE(torch::equal(s.exp_avg().cpu(), on_cpu->state_fp32(cpu_param)[0]));
  }
}

TEST(CudaCopyState, TheTrainerConvertsAFileReadIntoHostMemory) {
  SKIP_WITHOUT_CUDA();
  const auto [saved, x, y, file] = saved_fp32_run(5, "memsave_cuda_convert.pt");
  auto resumed = cuda_mlp();
  Trainer b(resumed, adamw(1e-3), Recipe().state_bits(8));
  torch::serialize::InputArchive archive;
  archive.load_from(file, torch::kCPU);
  b.load(archive);
  for (size_t i = 0; i < saved->parameters().size(); ++i)
    EXPECT_TRUE(torch::equal(saved->parameters()[i], resumed->parameters()[i])) << i;
  for (const auto& entry : b.optimizer().state()) {
    const auto& s = static_cast<const optim::QuantizedParamState&>(*entry.second);
    EXPECT_TRUE(s.m().is_cuda());
    EXPECT_EQ(s.step(), 1);
  }
  EXPECT_TRUE(b.step(x, y, ce).stepped);
  std::filesystem::remove(file);
}

TEST(CudaCopyState, TheTrainerReadsAFileItConvertsIntoHostMemory) {
  SKIP_WITHOUT_CUDA();
  const auto [saved, x, y, file] = saved_fp32_run(6, "memsave_cuda_convert_path.pt");
  int64_t param_bytes = 0;
  for (const auto& p : saved->parameters()) param_bytes += p.numel() * p.element_size();
  for (const Recipe& recipe : {Recipe().state_bits(8), Recipe().state_bits(4),
                               Recipe().state_bits(8).offload(Offload::kOptimizerState)}) {
    SCOPED_TRACE(recipe.label());
    auto resumed = cuda_mlp();
    Trainer b(resumed, adamw(1e-3), recipe);
    torch::cuda::synchronize();
    const int64_t before = memory_stats(kCuda).current;
    int64_t peak = 0;
    {
      PeakScope scope(kCuda);
      b.load(file);
      torch::cuda::synchronize();
      peak = scope.peak() - before;
    }
    // Read onto the device, the file would bring the model's tensors and two fp32 moments (3 x param_bytes)
    // beside the model; read into host memory, only the converted state (a quarter or an eighth of the
    // moments; none offloaded but the small tensors') reaches it.
    EXPECT_LT(peak, param_bytes) << "peak " << peak << " bytes over the model's " << param_bytes;
    for (size_t i = 0; i < saved->parameters().size(); ++i)
      EXPECT_TRUE(torch::equal(saved->parameters()[i], resumed->parameters()[i])) << i;
    EXPECT_TRUE(b.step(x, y, ce).stepped);
  }
  std::filesystem::remove(file);
}

TEST(CudaCheckpoint, GradientsAreBitIdenticalWithDropoutOnCuda) {
  SKIP_WITHOUT_CUDA();
  auto make = [] {
    torch::manual_seed(0);
    return torch::nn::Sequential(torch::nn::Linear(64, 64), torch::nn::Dropout(0.3), torch::nn::ReLU(),
                                 torch::nn::Linear(64, 64), torch::nn::Dropout(0.3),
                                 torch::nn::Linear(64, 8));
  };
  auto plain = make(), wrapped = make();
  plain->to(kCuda);
  wrapped->to(kCuda);
  auto net = nn::checkpoint_sequential(wrapped, 3, CheckpointOptions().offload_inputs(true));
  const auto x = torch::randn({16, 64}, torch::TensorOptions().device(kCuda));
  torch::manual_seed(1);
  plain->forward(x).square().sum().backward();
  torch::manual_seed(1);
  net->forward(x).square().sum().backward();
  for (size_t i = 0; i < plain->parameters().size(); ++i)
    EXPECT_TRUE(torch::equal(plain->parameters()[i].grad(), wrapped->parameters()[i].grad())) << i;
}

TEST(CudaAmp, FusedUnscaleIsBitIdenticalToTheUnscalePass) {
  SKIP_WITHOUT_CUDA();
  auto run = [](amp::FuseUnscale fuse) {
    torch::manual_seed(0);
    auto net =
        torch::nn::Sequential(torch::nn::Linear(64, 256), torch::nn::Tanh(), torch::nn::Linear(256, 4));
    net->to(kCuda);
    optim::AdamW8bit opt(net->parameters(), optim::AdamW8bitOptions(1e-2).min_8bit_size(1000));
    amp::GradScaler scaler(amp::GradScalerOptions().init_scale(1024).fuse_unscale(fuse));
    for (int s = 0; s < 5; ++s) {
      torch::manual_seed(s);
      const auto x = torch::randn({16, 64}).to(kCuda);
      const auto y = torch::randint(4, {16}).to(kCuda);
      opt.zero_grad();
      scaler.scale(torch::nn::functional::cross_entropy(net->forward(x), y) * (s == 3 ? INFINITY : 1.0f))
          .backward();
      EXPECT_EQ(scaler.step(opt), s != 3);
      scaler.update();
    }
    return net->parameters();
  };
  const auto fused = run(amp::FuseUnscale::kCuda), plain = run(amp::FuseUnscale::kNever);
  for (size_t i = 0; i < fused.size(); ++i) EXPECT_TRUE(torch::equal(fused[i], plain[i])) << i;
}

TEST(CudaRescue, DeviceRoomIsTheFreeMemoryAndTheCache) {
  SKIP_WITHOUT_CUDA();
  torch::cuda::synchronize();
  constexpr int64_t kMiB = int64_t{1} << 20;
  const int64_t total = static_cast<int64_t>(at::cuda::getDeviceProperties(0)->totalGlobalMem);
  const int64_t before = device_room(kCuda);
  EXPECT_GT(before, 0);
  EXPECT_LE(before, total);
  EXPECT_NEAR(static_cast<double>(device_room(torch::kCUDA)), static_cast<double>(before), 4.0 * kMiB);
  const int64_t bytes = 256 * kMiB;
  {
    const torch::Tensor held =
        torch::empty({bytes}, torch::TensorOptions().dtype(torch::kByte).device(kCuda));
    const int64_t during = device_room(kCuda);
    // what the tensor holds is gone from the room, give or take the driver's and allocator's rounding
    EXPECT_NEAR(static_cast<double>(before - during), static_cast<double>(bytes), 4.0 * kMiB);
  }
  // freed into LibTorch's cache: the driver counts it as used, the room counts it as there
  EXPECT_NEAR(static_cast<double>(device_room(kCuda)), static_cast<double>(before), 4.0 * kMiB);
}

TEST(CudaRescue, MixedPrecisionIsBf16FromAmpereOnAndFp16WithAScalerBefore) {
  SKIP_WITHOUT_CUDA();
  const int major = at::cuda::getDeviceProperties(0)->major;
  const c10::ScalarType dtype = mixed_precision_dtype(kCuda);
  EXPECT_EQ(dtype, major >= 8 ? torch::kBFloat16 : torch::kHalf) << "compute capability " << major;
  EXPECT_EQ(mixed_precision_dtype(torch::kCUDA), dtype);  // the current device
  for (const Recipe& r : checklist(8, 4, dtype)) {
    if (r.amp()) {
      EXPECT_EQ(r.scales_gradients(), dtype == torch::kHalf) << r.label();
    }
  }
}

}  // namespace
}  // namespace memsave
