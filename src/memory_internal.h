// What src/memory.cpp needs from the CUDA glue (src/memory_cuda.cpp, built with MEMSAVE_WITH_CUDA).
#pragma once

#include "../kernels/byte_pool.h"

#include <c10/core/Device.h>

#include <cstdint>
#include <optional>

namespace memsave::detail {

struct DeviceCounts {
  int64_t current = 0;
  int64_t peak = 0;
  int64_t blocks = 0;
};

c10::DeviceIndex cuda_current_device();
DeviceCounts cuda_counts(c10::DeviceIndex index);
void cuda_reset_peak(c10::DeviceIndex index);
void cuda_set_budget(c10::DeviceIndex index, std::optional<int64_t> bytes);
/// Pinned host memory from the CUDA runtime, or nothing when no CUDA device is usable.
std::optional<kernels::RawMemory> cuda_pinned_memory();

}  // namespace memsave::detail
