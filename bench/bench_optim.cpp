// One optimizer step on 2^24 fp32 parameters (one tensor) with the threads LibTorch is given (2 by default):
// LibTorch's torch::optim::Adam (what C++ users have), LibTorch's fused CPU AdamW kernel (at::_fused_adamw_),
// memsave's fused fp32 AdamW, its 8-bit AdamW and its 4-bit AdamW; SGD with momentum, LibTorch's against
// memsave's with fp32, 8-bit and 4-bit state; AdamW on bf16 parameters, LibTorch's against memsave's 8-bit
// AdamW rounding to nearest and stochastically; AdamW on a convolution weight in channels_last; and the
// machine's memory bandwidth, for the floor. Each row also reports the bytes a step allocates for the moment
// (its peak above what was live before it), per parameter.
// bench/run_optim_bench.sh runs this beside the Python peers and writes bench/RESULTS-optim.md.
#include "benchmark_main.h"

#include <memsave/memory.h>
#include <memsave/optim.h>

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <thread>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kParams = int64_t{1} << 24;

struct Problem {
  torch::Tensor param, grad;
  explicit Problem(torch::ScalarType dtype = torch::kFloat)
      : Problem(torch::randn({kParams}).to(dtype), (torch::randn({kParams}) * 1e-2).to(dtype)) {}
  /// A convolution's weight of 2^24 elements in channels_last, with its gradient laid out alike (what
  /// autograd gives such a parameter).
  static Problem channels_last() {
    const auto layout = torch::MemoryFormat::ChannelsLast;
    return Problem(torch::randn({1024, 256, 8, 8}).contiguous(layout),
                   (torch::randn({1024, 256, 8, 8}) * 1e-2).contiguous(layout));
  }

 private:
  Problem(torch::Tensor p, torch::Tensor g) : param(std::move(p)), grad(std::move(g)) {
    param.requires_grad_();
    param.mutable_grad() = grad;
  }
};

/// Runs `step` as the benchmark body and reports the state's bytes per parameter as the meter counted them.
template <typename Step>
void run(benchmark::State& state, Step&& step, int64_t floor_bytes_per_param) {
  const int64_t before = memsave::memory_stats(torch::kCPU).current;
  step();  // the first step creates the state
  const int64_t state_total = memsave::memory_stats(torch::kCPU).current - before;
  // What a step allocates beyond the state it keeps (temporaries, copies): its peak above what was live.
  const int64_t live = memsave::memory_stats(torch::kCPU).current;
  memsave::reset_peak(torch::kCPU);
  step();
  const int64_t transient = memsave::memory_stats(torch::kCPU).peak - live;
  for (auto _ : state) step();
  state.counters["state_bytes_per_param"] = static_cast<double>(state_total) / kParams;
  state.counters["transient_bytes_per_param"] = static_cast<double>(transient) / kParams;
  state.counters["floor_bytes_per_param"] = static_cast<double>(floor_bytes_per_param);
  state.counters["params"] = static_cast<double>(kParams);
}

/// Memory-bandwidth probes with LibTorch's own kernels on the same threads, over 256 MiB arrays (and one of
/// the step's pattern below); the report takes the best of them as the bandwidth the floor divides by.
/// `bytes` per element as counted (no write-allocate).
template <typename Op>
void bandwidth(benchmark::State& state, int64_t bytes_per_element, Op&& op) {
  torch::Tensor a = torch::rand({kParams * 4});
  const torch::Tensor b = torch::rand({kParams * 4});
  for (auto _ : state) {
    op(a, b);
    benchmark::ClobberMemory();
  }
  state.counters["bytes_moved"] = static_cast<double>(bytes_per_element * a.numel());
}
void BM_BandwidthRead(benchmark::State& state) {  // a.sum(): reads a
  bandwidth(state, 4,
            [](torch::Tensor& a, const torch::Tensor&) { benchmark::DoNotOptimize(a.sum().item<float>()); });
}
void BM_BandwidthCopy(benchmark::State& state) {  // a.copy_(b): reads b, writes a
  bandwidth(state, 8, [](torch::Tensor& a, const torch::Tensor& b) { a.copy_(b); });
}
void BM_BandwidthInPlace(
    benchmark::State& state) {  // a.add_(b): reads a and b, writes a, as an optimizer step
  bandwidth(state, 12, [](torch::Tensor& a, const torch::Tensor& b) { a.add_(b); });
}

/// The fused Adam step's access pattern without its arithmetic: p, g, m and v read, p, m and v written (28 B
/// per element, seven streams at once over 256 MiB), on the same threads, compiled for each vector width the
/// processor may have (as wide as the kernels it bounds). LibTorch's one- and two-stream probes above read
/// less than kernels streaming seven arrays get (the fused fp32 steps ran at 1.1-1.7 of the floor with only
/// those), so the best probe includes this one.
#if defined(__x86_64__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void step_pattern(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v,
                  int64_t n) {
  for (int64_t i = 0; i < n; ++i) {  // every load before the stores, as a step does
    const float gi = g[i], pi = p[i], mi = m[i], vi = v[i];
    p[i] = pi + gi;
    m[i] = mi + gi;
    v[i] = vi + gi;
  }
}
void BM_BandwidthStep(benchmark::State& state) {
  torch::Tensor p = torch::rand({kParams}), m = torch::rand({kParams}), v = torch::rand({kParams});
  const torch::Tensor g = torch::rand({kParams});
  // NOTE: std::thread, not at::parallel_for: that one is inline, and without -fopenmp here it runs on one
  // thread.
  const int64_t threads = at::get_num_threads(), chunk = kParams / threads;
  for (auto _ : state) {
    std::vector<std::thread> workers;
    for (int64_t t = 0; t < threads; ++t) {
      const int64_t begin = t * chunk, end = t + 1 == threads ? kParams : begin + chunk;
      workers.emplace_back([&, begin, end] {
        step_pattern(p.data_ptr<float>() + begin, g.data_ptr<float>() + begin, m.data_ptr<float>() + begin,
                     v.data_ptr<float>() + begin, end - begin);
      });
    }
    for (std::thread& w : workers) w.join();
    benchmark::ClobberMemory();
  }
  state.counters["bytes_moved"] = static_cast<double>(28 * kParams);
}

void BM_TorchOptimAdam(benchmark::State& state) {
  Problem problem;
  torch::optim::Adam opt(std::vector<torch::Tensor>{problem.param}, torch::optim::AdamOptions(1e-3));
  run(
      state, [&] { opt.step(); }, 28);
}

void BM_TorchFusedAdamW(benchmark::State& state) {
  Problem problem;
  const int64_t before = memsave::memory_stats(torch::kCPU).current;
  torch::Tensor m = torch::zeros_like(problem.param), v = torch::zeros_like(problem.param);
  torch::Tensor step = torch::zeros({}, torch::kFloat);
  const int64_t state_total = memsave::memory_stats(torch::kCPU).current - before;
  torch::NoGradGuard no_grad;
  auto param = problem.param.detach();
  const auto one_step = [&] {
    step.add_(1);
    at::_fused_adamw_({param}, {problem.grad}, {m}, {v}, {}, {step}, 1e-3, 0.9, 0.999, 1e-2, 1e-8, false,
                      false);
  };
  const int64_t live = memsave::memory_stats(torch::kCPU).current;
  memsave::reset_peak(torch::kCPU);
  one_step();
  const int64_t transient = memsave::memory_stats(torch::kCPU).peak - live;
  for (auto _ : state) one_step();
  state.counters["state_bytes_per_param"] = static_cast<double>(state_total) / kParams;
  state.counters["transient_bytes_per_param"] = static_cast<double>(transient) / kParams;
  state.counters["floor_bytes_per_param"] = 28;
  state.counters["params"] = static_cast<double>(kParams);
}

void BM_MemsaveAdamW32(benchmark::State& state) {
  Problem problem;
  memsave::optim::AdamW8bit opt(std::vector<torch::Tensor>{problem.param},
                                memsave::optim::AdamW8bitOptions(1e-3).min_8bit_size(kParams + 1));
  run(
      state, [&] { opt.step(); }, 28);
}

void BM_MemsaveAdamW8bit(benchmark::State& state) {
  Problem problem;
  memsave::optim::AdamW8bit opt(std::vector<torch::Tensor>{problem.param},
                                memsave::optim::AdamW8bitOptions(1e-3));
  run(
      state, [&] { opt.step(); }, 16);
}

void BM_MemsaveAdamW4bit(benchmark::State& state) {
  Problem problem;
  memsave::optim::AdamW4bit opt(std::vector<torch::Tensor>{problem.param},
                                memsave::optim::AdamW4bitOptions(1e-3));
  run(
      state, [&] { opt.step(); }, 14);
}

// SGD with momentum 0.9: an ideal step reads p, g and the buffer and writes p and the buffer (fp32: 20 B per
// parameter; 8-bit codes: 4 + 4 + 1 read, 4 + 1 written, 14 B; 4-bit: 13 B; absmax aside).
void BM_TorchOptimSGD(benchmark::State& state) {
  Problem problem;
  torch::optim::SGD opt(std::vector<torch::Tensor>{problem.param},
                        torch::optim::SGDOptions(1e-2).momentum(0.9));
  run(
      state, [&] { opt.step(); }, 20);
}

void BM_MemsaveSGD32(benchmark::State& state) {
  Problem problem;
  memsave::optim::SGD8bit opt(std::vector<torch::Tensor>{problem.param},
                              memsave::optim::SGD8bitOptions(1e-2).min_8bit_size(kParams + 1));
  run(
      state, [&] { opt.step(); }, 20);
}

void BM_MemsaveSGD8bit(benchmark::State& state) {
  Problem problem;
  memsave::optim::SGD8bit opt(std::vector<torch::Tensor>{problem.param},
                              memsave::optim::SGD8bitOptions(1e-2));
  run(
      state, [&] { opt.step(); }, 14);
}

void BM_MemsaveSGD4bit(benchmark::State& state) {
  Problem problem;
  memsave::optim::SGD4bit opt(std::vector<torch::Tensor>{problem.param},
                              memsave::optim::SGD4bitOptions(1e-2));
  run(
      state, [&] { opt.step(); }, 13);
}

// bf16 parameters and gradients (no fp32 copy): LibTorch's AdamW keeps bf16 state and reads p, g, m, v and
// writes p, m, v, 14 B per parameter; memsave's 8-bit AdamW reads 2 + 2 + 1 + 1 and writes 2 + 1 + 1, 10 B,
// rounding new weights to nearest or stochastically (bf16_stochastic_round).
void BM_TorchOptimAdamWBf16(benchmark::State& state) {
  Problem problem(torch::kBFloat16);
  torch::optim::AdamW opt(std::vector<torch::Tensor>{problem.param}, torch::optim::AdamWOptions(1e-3));
  run(
      state, [&] { opt.step(); }, 14);
}

void BM_MemsaveAdamW8bitBf16(benchmark::State& state) {
  Problem problem(torch::kBFloat16);
  memsave::optim::AdamW8bit opt(std::vector<torch::Tensor>{problem.param},
                                memsave::optim::AdamW8bitOptions(1e-3));
  run(
      state, [&] { opt.step(); }, 10);
}

void BM_MemsaveAdamW8bitBf16Stochastic(benchmark::State& state) {
  Problem problem(torch::kBFloat16);
  memsave::optim::AdamW8bit opt(std::vector<torch::Tensor>{problem.param},
                                memsave::optim::AdamW8bitOptions(1e-3).bf16_stochastic_round(true));
  run(
      state, [&] { opt.step(); }, 10);
}

// A convolution's weight in channels_last (the layout convolutions prefer on GPUs and with oneDNN), with
// LibTorch's AdamW (element-wise in any layout) against memsave's 8-bit AdamW.
void BM_TorchOptimAdamWChannelsLast(benchmark::State& state) {
  Problem problem = Problem::channels_last();
  torch::optim::AdamW opt(std::vector<torch::Tensor>{problem.param}, torch::optim::AdamWOptions(1e-3));
  run(
      state, [&] { opt.step(); }, 28);
}

void BM_MemsaveAdamW8bitChannelsLast(benchmark::State& state) {
  Problem problem = Problem::channels_last();
  memsave::optim::AdamW8bit opt(std::vector<torch::Tensor>{problem.param},
                                memsave::optim::AdamW8bitOptions(1e-3));
  run(
      state, [&] { opt.step(); }, 16);
}

BENCHMARK(BM_BandwidthRead)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_BandwidthCopy)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_BandwidthInPlace)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_BandwidthStep)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_TorchOptimAdam)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_TorchFusedAdamW)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MemsaveAdamW32)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MemsaveAdamW8bit)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MemsaveAdamW4bit)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_TorchOptimSGD)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MemsaveSGD32)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MemsaveSGD8bit)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MemsaveSGD4bit)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_TorchOptimAdamWBf16)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MemsaveAdamW8bitBf16)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MemsaveAdamW8bitBf16Stochastic)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_TorchOptimAdamWChannelsLast)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MemsaveAdamW8bitChannelsLast)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

int main(int argc, char** argv) { return memsave::bench::run_benchmarks(argc, argv); }
