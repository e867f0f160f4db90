// CPU offload of optimizer state: device-pool peak, host-arena peak and step time of a training step
// (forward, loss, backward, optimizer step) with the optimizer on the device against offloaded (fp32 and
// 8-bit host state), same model, batch and seed, one invocation. On a machine without a GPU the device is the
// CPU device pool
// ("CPU, simulated device"): the host arena is what a GPU would not have to hold.
//   build/bench/memsave_bench_offload [--model gpt-12l] [--batch 8] [--steps N] [--device cpu|cuda]
#include <memsave/memory.h>
#include <memsave/offload.h>
#include <memsave/optim.h>

#include "timing.h"
#include "zoo/zoo.h"

#include <ATen/Parallel.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace {

struct Result {
  int64_t device_peak = 0;
  int64_t host_peak = 0;
  double seconds = 0;
};

std::unique_ptr<torch::optim::Optimizer> make(const std::string& kind,
                                              const std::vector<torch::Tensor>& params) {
  if (kind == "LibTorch AdamW")
    return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-4));
  if (kind == "LibTorch AdamW, fused kernel")  // at::_fused_adamw_ (the kernel of AdamW(fused=True))
    return nullptr;
  if (kind == "memsave offload fp32")
    return std::make_unique<memsave::OffloadOptimizer>(params, memsave::OffloadOptimizerOptions(1e-4));
  return std::make_unique<memsave::OffloadOptimizer>(params,
                                                     memsave::OffloadOptimizerOptions(1e-4).state_bits(8));
}

/// LibTorch's fused AdamW kernel over all parameters, with its state (what torch.optim.AdamW(fused=True)
/// runs).
struct FusedAdamW {
  explicit FusedAdamW(std::vector<torch::Tensor> params) : params(std::move(params)) {
    for (const auto& p : this->params) {
      m.push_back(torch::zeros_like(p));
      v.push_back(torch::zeros_like(p));
      steps.push_back(torch::zeros({}, p.options()));
    }
  }
  void step() {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> grads;
    for (const auto& p : params) grads.push_back(p.grad());
    for (auto& s : steps) s.add_(1);
    at::_fused_adamw_(params, grads, m, v, {}, steps, 1e-4, 0.9, 0.999, 1e-2, 1e-8, false, false);
  }
  void zero_grad() {
    for (auto& p : params) p.mutable_grad() = torch::Tensor();
  }
  std::vector<torch::Tensor> params, m, v, steps;
};

Result run(const std::string& model, int64_t batch, torch::Device device, const std::string& kind,
           int steps) {
  torch::manual_seed(0);
  const memsave::zoo::Workload w = memsave::zoo::workload(model);
  auto net = w.make_model();
  net->to(device);
  const auto data = w.make_batch(batch, device);
  auto opt = make(kind, net->parameters());
  std::unique_ptr<FusedAdamW> fused;
  if (!opt) fused = std::make_unique<FusedAdamW>(net->parameters());
  std::vector<double> times;
  Result result;
  for (int s = 0; s <= steps; ++s) {  // step 0 creates the state and is not timed
    if (device.is_cuda()) torch::cuda::synchronize();
    memsave::reset_host_peak();
    memsave::PeakScope scope(device);
    const auto start = std::chrono::steady_clock::now();
    opt ? opt->zero_grad() : fused->zero_grad();
    w.loss(net->forward(data.input), data.target).backward();
    opt ? (void)opt->step() : fused->step();
    if (device.is_cuda()) torch::cuda::synchronize();
    const double seconds = memsave::bench::seconds_since(start);
    if (s > 0) times.push_back(seconds);
    result.device_peak = scope.peak();
    result.host_peak = memsave::host_memory_stats().peak;
  }
  result.seconds = memsave::bench::median(times);
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  memsave::install_meter();
  int steps = 3;
  int64_t batch = 8;
  std::string model = "gpt-12l", device_name = "cpu";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--steps") == 0) steps = std::max(1, std::atoi(argv[i + 1]));
    if (std::strcmp(argv[i], "--batch") == 0) batch = std::max(1, std::atoi(argv[i + 1]));
    if (std::strcmp(argv[i], "--model") == 0) model = argv[i + 1];
    if (std::strcmp(argv[i], "--device") == 0) device_name = argv[i + 1];
  }
  const torch::Device device(device_name);
  if (device.is_cuda() && !torch::cuda::is_available()) {
    std::fprintf(stderr, "bench_offload: --device cuda but no CUDA device\n");
    return 2;
  }
  std::printf(
      "%s, %s (%lld parameters), batch %lld, threads %d, median of %d timed steps after one untimed\n\n",
      device.is_cpu() ? "CPU, simulated device" : "CUDA", model.c_str(),
      static_cast<long long>(memsave::zoo::parameter_count(*memsave::zoo::workload(model).make_model())),
      static_cast<long long>(batch), at::get_num_threads(), steps);
  std::printf(
      "| optimizer | device peak | host arena peak | step time | device peak vs LibTorch | time vs LibTorch "
      "|\n"
      "| --- | ---: | ---: | ---: | ---: | ---: |\n");
  const char* kinds[] = {"LibTorch AdamW", "LibTorch AdamW, fused kernel", "memsave offload fp32",
                         "memsave offload 8-bit"};
  Result base;
  for (const char* kind : kinds) {
    const Result r = run(model, batch, device, kind, steps);
    if (kind == kinds[0]) base = r;
    std::printf("| %s | %s | %s | %.3f s | %.2f× | %.2f× |\n", kind,
                memsave::format_bytes(r.device_peak).c_str(), memsave::format_bytes(r.host_peak).c_str(),
                r.seconds, static_cast<double>(r.device_peak) / static_cast<double>(base.device_peak),
                r.seconds / base.seconds);
    std::fflush(stdout);
  }
  return 0;
}
