// main() of the Google Benchmark programs over LibTorch: the meter installed first, then
// MEMSAVE_BENCH_THREADS intra-op threads (2 by default), then the benchmarks the command line selects.
//   int main(int argc, char** argv) { return memsave::bench::run_benchmarks(argc, argv); }
#pragma once

#include <memsave/memory.h>

#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include <cstdlib>

namespace memsave::bench {

inline int run_benchmarks(int argc, char** argv) {
  memsave::install_meter();
  const char* threads = std::getenv("MEMSAVE_BENCH_THREADS");
  at::set_num_threads(threads != nullptr ? std::atoi(threads) : 2);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace memsave::bench
