// The GPU step benchmark (run by scripts/gpu-check.sh): one optimizer step on N fp32 parameters (default
// 10^9) on the current CUDA device: LibTorch's torch::optim::AdamW and its fused AdamW kernel
// (at::_fused_adamw_) against memsave's AdamW8bit with fp32 and with 8-bit state and its AdamW4bit, AdamW8bit
// on bf16 weights rounded to nearest and stochastically, and the device's copy bandwidth for the memory
// floor. State bytes per parameter from the meter.
// Medians of 10 timed steps after 3 warm-up steps. No Google Benchmark: the GPU machine does not have it.
#include "timing.h"

#include <memsave/memory.h>
#include <memsave/optim.h>

#include <ATen/cuda/CUDAContext.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

namespace {

double median_seconds(const std::function<void()>& step) {
  for (int i = 0; i < 3; ++i) step();
  std::vector<double> times;
  for (int i = 0; i < 10; ++i) {
    torch::cuda::synchronize();
    const auto start = std::chrono::steady_clock::now();
    step();
    torch::cuda::synchronize();
    times.push_back(memsave::bench::seconds_since(start));
  }
  return memsave::bench::median(times);
}

}  // namespace

int main(int argc, char** argv) {
  if (!torch::cuda::is_available()) {
    std::printf("bench_optim_cuda: no CUDA device\n");
    return 0;
  }
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 1000000000;
  const auto on = torch::TensorOptions().device(torch::kCUDA);
  const torch::Device device(torch::kCUDA, 0);
  std::printf("device: %s, %lld fp32 parameters\n", at::cuda::getCurrentDeviceProperties()->name,
              static_cast<long long>(n));

  double bandwidth = 0;
  {
    // in place, as an optimizer step: a.add_(b) reads a and b and writes a (12 bytes per element)
    auto a = torch::rand({n}, on);
    const auto b = torch::rand({n}, on);
    const double seconds = median_seconds([&] { a.add_(b); });
    bandwidth = 12.0 * static_cast<double>(n) / seconds;
    std::printf("in-place a.add_(b): %.3f ms, %.0f GB/s\n", seconds * 1e3, bandwidth / 1e9);
  }
  // Ratios against LibTorch's fused kernel (what torch.optim.AdamW(fused=True) runs) and against
  // torch::optim::AdamW, the optimizer a C++ user has; `stock` is 0 until that one is measured.
  double fused = 0, stock = 0;
  auto report = [&](const char* name, double seconds, double floor_bytes, double state_bytes) {
    const double floor = floor_bytes * static_cast<double>(n) / bandwidth;
    std::printf(
        "%-34s %9.3f ms  %5.2fx vs fused AdamW  %5.2fx vs torch::optim::AdamW  %3.0f%% of measured "
        "bandwidth  state %.4f B/param\n",
        name, seconds * 1e3, fused / seconds, stock / seconds, 100 * floor / seconds, state_bytes);
  };

  // State bytes per parameter: what the meter counts as kept on the device by `make_state`.
  auto state_per_param = [&](const std::function<void()>& make_state) {
    const int64_t before = memsave::memory_stats(device).current;
    make_state();
    return static_cast<double>(memsave::memory_stats(device).current - before) / static_cast<double>(n);
  };
  double stock_state = 0, fused_state = 0;
  {
    // torch::optim::AdamW: one operation at a time per parameter; its first step makes the state
    auto p = torch::randn({n}, on).requires_grad_();
    p.mutable_grad() = torch::randn({n}, on) * 1e-2;
    torch::optim::AdamW opt(std::vector<torch::Tensor>{p}, torch::optim::AdamWOptions(1e-3));
    stock_state = state_per_param([&] { opt.step(); });
    stock = median_seconds([&] { opt.step(); });
  }
  {
    auto p = torch::randn({n}, on), g = torch::randn({n}, on) * 1e-2;
    torch::Tensor m, v, step;
    fused_state = state_per_param([&] {
      m = torch::zeros_like(p);
      v = torch::zeros_like(p);
      step = torch::zeros({}, on);
    });
    torch::NoGradGuard no_grad;
    fused = median_seconds([&] {
      step.add_(1);
      at::_fused_adamw_({p}, {g}, {m}, {v}, {}, {step}, 1e-3, 0.9, 0.999, 1e-2, 1e-8, false, false);
    });
  }
  report("LibTorch torch::optim::AdamW", stock, 28, stock_state);
  report("LibTorch at::_fused_adamw_", fused, 28, fused_state);
  // A memsave optimizer on a fresh parameter: its state from the meter after the first step, then the timing.
  auto time_memsave = [&](const char* name, double floor_bytes, auto make_optimizer,
                          torch::ScalarType dtype = torch::kFloat) {
    auto p = torch::randn({n}, on.dtype(dtype)).requires_grad_();
    p.mutable_grad() = torch::randn({n}, on.dtype(dtype)) * 1e-2;
    auto opt = make_optimizer(std::vector<torch::Tensor>{p});
    const double state = state_per_param([&] { opt.step(); });
    report(name, median_seconds([&] { opt.step(); }), floor_bytes, state);
  };
  using memsave::optim::AdamW4bit, memsave::optim::AdamW4bitOptions;
  using memsave::optim::AdamW8bit, memsave::optim::AdamW8bitOptions;
  time_memsave("memsave AdamW8bit, fp32 state", 28, [&](std::vector<torch::Tensor> params) {
    return AdamW8bit(std::move(params), AdamW8bitOptions(1e-3).min_8bit_size(n + 1));
  });
  time_memsave("memsave AdamW8bit, 8-bit state", 16, [](std::vector<torch::Tensor> params) {
    return AdamW8bit(std::move(params), AdamW8bitOptions(1e-3));
  });
  time_memsave("memsave AdamW4bit, 4-bit state", 14, [](std::vector<torch::Tensor> params) {
    return AdamW4bit(std::move(params), AdamW4bitOptions(1e-3));
  });
  // bf16 weights and gradients (reads 2 + 2 + 1 + 1 B, writes 2 + 1 + 1 B), rounded to nearest and
  // stochastically; the ratios are still to the fp32-weight steps above
  time_memsave(
      "memsave AdamW8bit, bf16 weights", 10,
      [](std::vector<torch::Tensor> params) { return AdamW8bit(std::move(params), AdamW8bitOptions(1e-3)); },
      torch::kBFloat16);
  time_memsave(
      "  bf16_stochastic_round", 10,
      [](std::vector<torch::Tensor> params) {
        return AdamW8bit(std::move(params), AdamW8bitOptions(1e-3).bf16_stochastic_round(true));
      },
      torch::kBFloat16);
  return 0;
}
