// What the meter costs: an allocate/free pair through memsave's counting CPU allocator against LibTorch's own
// CPU allocator, in the same run, for block sizes from 64 B to 64 MiB, on one thread and on two.
// No tensor bytes are touched, so there is no memory-bandwidth floor here: the figure is time per pair.
#include <memsave/memory.h>

#include <benchmark/benchmark.h>
#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

namespace {

void allocate_free(benchmark::State& state, c10::Allocator* allocator) {
  const auto bytes = static_cast<size_t>(state.range(0));
  for (auto _ : state) {
    c10::DataPtr block = allocator->allocate(bytes);
    benchmark::DoNotOptimize(block.get());
  }
  state.SetItemsProcessed(state.iterations());
}

void BM_LibTorchAllocator(benchmark::State& state) { allocate_free(state, c10::GetDefaultCPUAllocator()); }

void BM_MemsaveCountingAllocator(benchmark::State& state) {
  memsave::install_meter();
  allocate_free(state, c10::GetCPUAllocator());
}

void BM_TorchEmpty(benchmark::State& state) {
  // torch::empty through the dispatcher with the meter installed: what a user's tensor costs end to end.
  memsave::install_meter();
  for (auto _ : state) {
    auto t = torch::empty({state.range(0)}, torch::kByte);
    benchmark::DoNotOptimize(t.data_ptr());
  }
  state.SetItemsProcessed(state.iterations());
}

#define MEMSAVE_SIZES ->Arg(64)->Arg(4096)->Arg(1 << 20)->Arg(64 << 20)
BENCHMARK(BM_LibTorchAllocator) MEMSAVE_SIZES->ThreadRange(1, 2);
BENCHMARK(BM_MemsaveCountingAllocator) MEMSAVE_SIZES->ThreadRange(1, 2);
BENCHMARK(BM_TorchEmpty)->Arg(64)->Arg(1 << 20);
#undef MEMSAVE_SIZES

}  // namespace

BENCHMARK_MAIN();
