// The GradScaler's unscale fused into memsave's 8-bit kernels, against the separate unscale pass (LibTorch's
// _amp_foreach_non_finite_check_and_unscale_ then the kernel) and against LibTorch's AdamW with the same
// scaler, on 2^24 fp32 parameters on the CPU. Each figure is the median over repetitions of one scaler.step
// (with unscale_ where the path needs it), gradients reset outside the timed region. The floor is the bytes
// the path must move over the bandwidth of a large copy measured in the same run.
//   build/bench/memsave_bench_scaler [--reps N]
#include "args.h"
#include "timing.h"

#include <memsave/amp.h>
#include <memsave/optim.h>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <vector>

namespace {

constexpr int64_t kParams = int64_t{1} << 24;

using memsave::bench::median;
using memsave::bench::seconds_since;

/// Bytes per second of a large copy (read + write counted).
double copy_bandwidth(int reps) {
  const auto a = torch::rand({kParams * 4}), b = torch::empty_like(a);
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto start = std::chrono::steady_clock::now();
    b.copy_(a);
    t.push_back(seconds_since(start));
  }
  return 2.0 * static_cast<double>(a.numel()) * 4 / median(t);
}

enum class Path { kFused, kUnscalePass, kLibTorch };

double run(Path path, int reps) {
  torch::manual_seed(0);
  auto p = torch::randn({kParams}).requires_grad_();
  const auto grad = torch::randn({kParams}) * 1024;
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (path == Path::kLibTorch)
    opt = std::make_unique<torch::optim::AdamW>(std::vector<torch::Tensor>{p},
                                                torch::optim::AdamWOptions(1e-3));
  else
    opt = std::make_unique<memsave::optim::AdamW8bit>(std::vector<torch::Tensor>{p},
                                                      memsave::optim::AdamW8bitOptions(1e-3));
  memsave::amp::GradScaler scaler(
      memsave::amp::GradScalerOptions().init_scale(1024).growth_interval(1 << 30));
  scaler.scale(torch::ones({}));
  std::vector<double> times;
  for (int r = 0; r <= reps; ++r) {  // the first creates the state and is not timed
    p.mutable_grad() = grad.clone();
    const auto start = std::chrono::steady_clock::now();
    if (path != Path::kFused) scaler.unscale_(*opt);
    scaler.step(*opt);
    if (r > 0) times.push_back(seconds_since(start));
    scaler.update();
  }
  return median(times);
}

}  // namespace

int main(int argc, char** argv) {
  memsave::bench::Args args(argc, argv);
  const int reps = static_cast<int>(args.integer("--reps", 7, /*min=*/1));
  args.finish();
  const double bandwidth = copy_bandwidth(reps);
  std::printf("2^24 fp32 parameters, %d threads, median of %d steps; copy bandwidth %.1f GB/s\n\n",
              at::get_num_threads(), reps, bandwidth / 1e9);
  std::printf(
      "| path | bytes moved per parameter | step | floor | fraction of floor | vs LibTorch AdamW + scaler |\n"
      "| --- | ---: | ---: | ---: | ---: | ---: |\n");
  const double stock = run(Path::kLibTorch, reps);
  struct Row {
    const char* name;
    Path path;
    double bytes;  // per parameter: the inf check / unscale passes plus the step
  };
  // fused: read g for the check (4) + the 8-bit step (16 + absmax); separate pass: read and write g (8) + the
  // step; LibTorch: read and write g (8) + AdamW's 28.
  const Row rows[] = {{"AdamW8bit, unscale fused (FuseUnscale::kAlways)", Path::kFused, 4 + 16},
                      {"AdamW8bit, unscale_ pass then step", Path::kUnscalePass, 8 + 16},
                      {"LibTorch AdamW, unscale_ pass then step", Path::kLibTorch, 8 + 28}};
  for (const Row& row : rows) {
    const double t = row.path == Path::kLibTorch ? stock : run(row.path, reps);
    const double floor = row.bytes * static_cast<double>(kParams) / bandwidth;
    std::printf("| %s | %.0f | %.2f ms | %.2f ms | %.2f | %.2f× |\n", row.name, row.bytes, 1e3 * t,
                1e3 * floor, floor / t, stock / t);
  }
  return 0;
}
