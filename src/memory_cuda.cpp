// The meter's CUDA side: the caching allocator's statistics and memory fraction, and pinned host memory.
#include "memory_internal.h"

#include "compat.h"

#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/PinnedMemoryAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <map>
#include <mutex>

namespace memsave::detail {
namespace {

// NOTE: index 0 of a StatArray is the aggregate over all pools, in every 2.x version.
constexpr size_t kAggregate = 0;

// Pinned blocks come from LibTorch's caching host allocator, whose DataPtr context is not the data pointer;
// the DataPtrs live here, keyed by their data (ordered, to find the block holding a pointer), until the block
// is released.
struct PinnedBlock {
  c10::DataPtr block;
  std::size_t bytes = 0;
};

std::mutex& pinned_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::map<const char*, PinnedBlock>& pinned_blocks() {
  static auto* blocks = new std::map<const char*, PinnedBlock>();
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
  pinned_blocks().emplace(static_cast<const char*>(data), PinnedBlock{std::move(block), bytes});
  return data;
}

void pinned_release(void* ptr) {
  c10::DataPtr block;  // freed after the lock is let go
  {
    std::lock_guard<std::mutex> lock(pinned_mutex());
    auto it = pinned_blocks().find(static_cast<const char*>(ptr));
    if (it == pinned_blocks().end()) return;
    block = std::move(it->second.block);
    pinned_blocks().erase(it);
  }
}

/// Makes LibTorch's caching allocator ready for device `index` (its statistics and memory fraction fail with
/// "did you call init?" in a program that has not used CUDA yet), after checking that the device exists.
void ready(c10::DeviceIndex index) {
  const c10::DeviceIndex count = c10::cuda::device_count();
  TORCH_CHECK(index >= 0 && index < count, "memsave: no CUDA device ", static_cast<int>(index), " (",
              static_cast<int>(count), " present)");
  compat::lazy_init_cuda();
}

}  // namespace

c10::DeviceIndex cuda_current_device() {
  // Without a device, asking for the current one fails with the CUDA runtime's own words (an old driver, no
  // driver); say what is missing.
  TORCH_CHECK(c10::cuda::device_count() > 0, "memsave: no CUDA device (0 present)");
  return c10::cuda::current_device();
}

DeviceCounts cuda_counts(c10::DeviceIndex index) {
  ready(index);
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
  return {stats.allocated_bytes[kAggregate].current, stats.allocated_bytes[kAggregate].peak,
          stats.allocation[kAggregate].current};
}

void cuda_reset_peak(c10::DeviceIndex index) {
  ready(index);
  c10::cuda::CUDACachingAllocator::resetPeakStats(index);
}

void cuda_set_budget(c10::DeviceIndex index, std::optional<int64_t> bytes) {
  ready(index);
  const auto total = static_cast<double>(at::cuda::getDeviceProperties(index)->totalGlobalMem);
  const double fraction = bytes ? std::min(1.0, static_cast<double>(*bytes) / total) : 1.0;
  c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, index);
}

int64_t cuda_room(c10::DeviceIndex index) {
  ready(index);
  const c10::cuda::CUDAGuard guard(index);
  size_t free = 0, total = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
  const int64_t cached = stats.reserved_bytes[kAggregate].current - stats.allocated_bytes[kAggregate].current;
  return static_cast<int64_t>(free) + cached;
}

std::pair<int, int> cuda_compute_capability(c10::DeviceIndex index) {
  const cudaDeviceProp* properties = at::cuda::getDeviceProperties(index);
  return {properties->major, properties->minor};
}

std::optional<kernels::RawMemory> cuda_pinned_memory() {
  if (c10::cuda::device_count() == 0) return std::nullopt;
  return kernels::RawMemory{&pinned_allocate, &pinned_release};
}

c10::Stream cuda_current_stream(c10::DeviceIndex index) { return c10::cuda::getCurrentCUDAStream(index); }

void cuda_record_host_use(const at::Tensor& host, const c10::Stream& stream) {
  const auto* data = static_cast<const char*>(host.storage().data_ptr().get());
  if (data == nullptr) return;
  std::lock_guard<std::mutex> lock(pinned_mutex());
  auto it = pinned_blocks().upper_bound(data);  // the first block starting after `data`
  if (it == pinned_blocks().begin()) return;
  --it;
  if (data >= it->first + it->second.bytes) return;  // not in the pinned arena
  at::getHostAllocator(at::kCUDA)->record_event(const_cast<char*>(it->first), it->second.block.get_context(),
                                                stream);
}

}  // namespace memsave::detail
