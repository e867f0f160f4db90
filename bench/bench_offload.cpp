// CPU offload of optimizer state: device-pool peak, host-arena peak and step time of a training step
// (forward, loss, backward, optimizer step) with the optimizer on the device against offloaded (fp32 and
// 8-bit host state; gradients copied at the step or during the backward, or the parameters stepped during
// the backward), same model, batch and seed, one invocation. On a machine without a GPU the device is the CPU
// device pool ("CPU, simulated device"): the host arena is what a GPU would not have to hold.
//   build/bench/memsave_bench_offload [--model gpt-12l] [--batch 8] [--steps N] [--device cpu|cuda]
#include <memsave/memory.h>
#include <memsave/offload.h>
#include <memsave/optim.h>

#include "args.h"
#include "timing.h"
#include "zoo/zoo.h"

#include <ATen/Parallel.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace {

struct Result {
  int64_t device_peak = 0;
  int64_t host_peak = 0;
  double seconds = 0;  ///< the whole step
  /// Of which zero_grad, forward, loss and backward (the copies made during it included).
  double backward_seconds = 0;
};

/// An optimizer of the comparison; no `offload_bits`: LibTorch's, on the device.
struct Kind {
  const char* name;
  bool fused = false;        ///< LibTorch: at::_fused_adamw_ (the kernel of AdamW(fused=True))
  int64_t offload_bits = 0;  ///< memsave offload: bits of the host state
  bool copy_during_backward = false;
  bool step_during_backward = false;
};

constexpr Kind kKinds[] = {
    {"LibTorch AdamW"},
    {"LibTorch AdamW, fused kernel", /*fused=*/true},
    {"memsave offload fp32", false, 32},
    {"memsave offload fp32, copies during backward", false, 32, true},
    {"memsave offload fp32, steps during backward", false, 32, true, true},
    {"memsave offload 8-bit", false, 8},
    {"memsave offload 8-bit, copies during backward", false, 8, true},
    {"memsave offload 8-bit, steps during backward", false, 8, true, true},
};

std::unique_ptr<torch::optim::Optimizer> make(const Kind& kind, const std::vector<torch::Tensor>& params) {
  if (kind.fused) return nullptr;
  if (kind.offload_bits == 0)
    return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-4));
  return std::make_unique<memsave::OffloadOptimizer>(params,
                                                     memsave::OffloadOptimizerOptions(1e-4)
                                                         .state_bits(kind.offload_bits)
                                                         .copy_during_backward(kind.copy_during_backward)
                                                         .step_during_backward(kind.step_during_backward));
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

Result run(const std::string& model, int64_t batch, torch::Device device, const Kind& kind, int steps) {
  torch::manual_seed(0);
  const memsave::zoo::Workload w = memsave::zoo::workload(model);
  auto net = w.make_model();
  net->to(device);
  const auto data = w.make_batch(batch, device);
  auto opt = make(kind, net->parameters());
  std::unique_ptr<FusedAdamW> fused;
  if (!opt) fused = std::make_unique<FusedAdamW>(net->parameters());
  std::vector<double> times, backward_times;
  Result result;
  for (int s = 0; s <= steps; ++s) {  // step 0 creates the state and is not timed
    if (device.is_cuda()) torch::cuda::synchronize();
    memsave::reset_host_peak();
    memsave::PeakScope scope(device);
    const auto start = std::chrono::steady_clock::now();
    opt ? opt->zero_grad() : fused->zero_grad();
    w.loss(net->forward(data.input), data.target).backward();
    if (device.is_cuda())
      torch::cuda::synchronize();  // side-stream copies too; the step waits for them anyway
    const double backward_seconds = memsave::bench::seconds_since(start);
    opt ? (void)opt->step() : fused->step();
    if (device.is_cuda()) torch::cuda::synchronize();
    const double seconds = memsave::bench::seconds_since(start);
    if (s > 0) {
      times.push_back(seconds);
      backward_times.push_back(backward_seconds);
    }
    result.device_peak = scope.peak();
    result.host_peak = memsave::host_memory_stats().peak;
  }
  result.seconds = memsave::bench::median(times);
  result.backward_seconds = memsave::bench::median(backward_times);
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  memsave::install_meter();
  memsave::bench::Args args(argc, argv);
  const int steps = static_cast<int>(args.integer("--steps", 3, /*min=*/1));
  const int64_t batch = args.integer("--batch", 8, /*min=*/1);
  const std::string model = args.text("--model", "gpt-12l");
  const std::string device_name = args.text("--device", "cpu");
  args.finish();
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
      "| optimizer | device peak | host arena peak | step time | of which forward + backward | device peak "
      "vs "
      "LibTorch | time vs LibTorch | time vs fused |\n"
      "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  // each row as soon as it and the two references (LibTorch's AdamW, the fused kernel) are measured: a run
  // cut short by a time limit keeps what it has
  static_assert(!kKinds[0].fused && kKinds[0].offload_bits == 0 && kKinds[1].fused,
                "LibTorch's AdamW, then the fused kernel");
  std::vector<Result> results;
  auto print_row = [&](size_t row) {
    const Result& r = results[row];
    std::printf("| %s | %s | %s | %.3f s | %.3f s | %.2f× | %.2f× | %.2f× |\n", kKinds[row].name,
                memsave::format_bytes(r.device_peak).c_str(), memsave::format_bytes(r.host_peak).c_str(),
                r.seconds, r.backward_seconds,
                static_cast<double>(r.device_peak) / static_cast<double>(results[0].device_peak),
                r.seconds / results[0].seconds, r.seconds / results[1].seconds);
    std::fflush(stdout);
  };
  for (size_t i = 0; i < std::size(kKinds); ++i) {
    results.push_back(run(model, batch, device, kKinds[i], steps));
    if (i == 1) print_row(0);
    if (i >= 1) print_row(i);
  }
  return 0;
}
