// Converting the AdamW state of 2^24 fp32 parameters (one tensor) with memsave::optim::copy_state, with the
// threads LibTorch is given (2 by default), against what LibTorch offers for moving one optimizer's state
// into another: saving it to an archive in memory and loading that. And the machine's copy bandwidth, for the
// floor. bench/run_convert_bench.sh runs it and writes the table of bench/RESULTS-convert.md.
#include "benchmark_main.h"

#include <memsave/memory.h>
#include <memsave/optim.h>

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <memory>
#include <sstream>

namespace {

constexpr int64_t kParams = int64_t{1} << 24;

/// An optimizer over its own 2^24 parameters, stepped once (its state created) when `step`.
template <typename Optimizer, typename Options>
struct Stepped {
  torch::Tensor param = torch::randn({kParams}).requires_grad_();
  std::unique_ptr<Optimizer> opt;
  explicit Stepped(Options options, bool step = true)
      : opt(std::make_unique<Optimizer>(std::vector<torch::Tensor>{param}, options)) {
    if (!step) return;
    param.mutable_grad() = torch::randn({kParams}) * 1e-2;
    opt->step();
  }
};

using TorchAdamW = Stepped<torch::optim::AdamW, torch::optim::AdamWOptions>;
using AdamW8bit = Stepped<memsave::optim::AdamW8bit, memsave::optim::AdamW8bitOptions>;
using AdamW4bit = Stepped<memsave::optim::AdamW4bit, memsave::optim::AdamW4bitOptions>;

void counters(benchmark::State& state, double floor_bytes_per_param) {
  state.counters["floor_bytes_per_param"] = floor_bytes_per_param;
  state.counters["params"] = static_cast<double>(kParams);
}

void BM_BandwidthCopy(benchmark::State& state) {  // a.copy_(b) over 256 MiB: reads b, writes a
  constexpr int64_t n = int64_t{1} << 26;
  torch::Tensor a = torch::zeros({n}), b = torch::ones({n});
  for (auto _ : state) a.copy_(b);
  state.counters["bytes_per_element"] = 8;
  state.counters["elements"] = static_cast<double>(n);
}

void BM_TorchSaveLoad(benchmark::State& state) {
  // The stock way: the source's archive, written to memory, loaded into the target.
  TorchAdamW from(torch::optim::AdamWOptions(1e-3)), to(torch::optim::AdamWOptions(1e-3), false);
  for (auto _ : state) {
    torch::serialize::OutputArchive out;
    from.opt->save(out);
    std::stringstream bytes;
    out.save_to(bytes);
    torch::serialize::InputArchive in;
    in.load_from(bytes);
    to.opt->load(in);
  }
  counters(state, 16);  // read 8 bytes of moments per parameter, write 8
}

void BM_CopyStateFp32ToFp32(benchmark::State& state) {
  TorchAdamW from(torch::optim::AdamWOptions(1e-3)), to(torch::optim::AdamWOptions(1e-3), false);
  for (auto _ : state) memsave::optim::copy_state(*from.opt, *to.opt);
  counters(state, 16);
}

void BM_CopyStateFp32To8bit(benchmark::State& state) {
  TorchAdamW from(torch::optim::AdamWOptions(1e-3));
  AdamW8bit to(memsave::optim::AdamW8bitOptions(1e-3), false);
  for (auto _ : state) memsave::optim::copy_state(*from.opt, *to.opt);
  counters(state, 8 + 2 + 8.0 / 256);  // read the fp32 moments, write codes and absmaxes
}

void BM_CopyStateFp32To4bit(benchmark::State& state) {
  TorchAdamW from(torch::optim::AdamWOptions(1e-3));
  AdamW4bit to(memsave::optim::AdamW4bitOptions(1e-3), false);
  for (auto _ : state) memsave::optim::copy_state(*from.opt, *to.opt);
  counters(state, 8 + 1 + 8.0 / 128);
}

void BM_CopyState8bitToFp32(benchmark::State& state) {
  AdamW8bit from(memsave::optim::AdamW8bitOptions(1e-3));
  TorchAdamW to(torch::optim::AdamWOptions(1e-3), false);
  for (auto _ : state) memsave::optim::copy_state(*from.opt, *to.opt);
  counters(state, 2 + 8.0 / 256 + 8);
}

BENCHMARK(BM_BandwidthCopy)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_TorchSaveLoad)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CopyStateFp32ToFp32)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CopyStateFp32To8bit)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CopyStateFp32To4bit)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CopyState8bitToFp32)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

int main(int argc, char** argv) { return memsave::bench::run_benchmarks(argc, argv); }
