// The meter's CUDA side: the caching allocator's statistics and memory fraction, and pinned host memory.
#include "memory_internal.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/PinnedMemoryAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>

namespace memsave::detail {
namespace {

// NOTE: index 0 of a StatArray is the aggregate over all pools, in every 2.x version.
constexpr size_t kAggregate = 0;

// Pinned blocks come from LibTorch's caching host allocator, whose DataPtr context is not the data pointer;
// the DataPtrs live here, keyed by their data, until the block is released.
std::mutex& pinned_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::unordered_map<void*, c10::DataPtr>& pinned_blocks() {
  static auto* blocks = new std::unordered_map<void*, c10::DataPtr>();
  return *blocks;
}

void* pinned_allocate(std::size_t bytes) {
  c10::DataPtr block;
  try {
    block = at::cuda::getPinnedMemoryAllocator()->allocate(bytes);
  } catch (const c10::Error&) {
    return nullptr;
  }
  void* data = block.get();
  if (data == nullptr) return nullptr;
  std::lock_guard<std::mutex> lock(pinned_mutex());
  pinned_blocks().emplace(data, std::move(block));
  return data;
}

void pinned_release(void* ptr) {
  c10::DataPtr block;
  {
    std::lock_guard<std::mutex> lock(pinned_mutex());
    auto it = pinned_blocks().find(ptr);
    if (it == pinned_blocks().end()) return;
    block = std::move(it->second);
    pinned_blocks().erase(it);
  }
}

}  // namespace

c10::DeviceIndex cuda_current_device() { return c10::cuda::current_device(); }

DeviceCounts cuda_counts(c10::DeviceIndex index) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
  return {stats.allocated_bytes[kAggregate].current, stats.allocated_bytes[kAggregate].peak,
          stats.allocation[kAggregate].current};
}

void cuda_reset_peak(c10::DeviceIndex index) { c10::cuda::CUDACachingAllocator::resetPeakStats(index); }

void cuda_set_budget(c10::DeviceIndex index, std::optional<int64_t> bytes) {
  const auto total = static_cast<double>(at::cuda::getDeviceProperties(index)->totalGlobalMem);
  const double fraction = bytes ? std::min(1.0, static_cast<double>(*bytes) / total) : 1.0;
  c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, index);
}

std::optional<kernels::RawMemory> cuda_pinned_memory() {
  if (c10::cuda::device_count() == 0) return std::nullopt;
  return kernels::RawMemory{&pinned_allocate, &pinned_release};
}

}  // namespace memsave::detail
