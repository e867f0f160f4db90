// What the rest of memsave needs from the meter (src/memory.cpp) and its CUDA glue (src/memory_cuda.cpp,
// built with MEMSAVE_WITH_CUDA).
#pragma once

#include "../kernels/byte_pool.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

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
/// Bytes CUDA device `index` can still give this process: the driver's free memory and what LibTorch's
/// caching allocator holds reserved but unallocated.
int64_t cuda_room(c10::DeviceIndex index);
/// The compute capability (major, minor) of CUDA device `index`.
std::pair<int, int> cuda_compute_capability(c10::DeviceIndex index);
/// Pinned host memory from the CUDA runtime, or nothing when no CUDA device is usable.
std::optional<kernels::RawMemory> cuda_pinned_memory();
/// The current stream of CUDA device `index`.
c10::Stream cuda_current_stream(c10::DeviceIndex index);
/// After a non_blocking copy between `host` (a tensor of the host arena) and a CUDA device was queued on
/// `stream`: keeps LibTorch's caching host allocator from handing the pinned block under `host` to another
/// allocation before the copy is done, should `host` be freed first. (LibTorch's copy_ does this for its own
/// pinned tensors but cannot find the block under an arena tensor, whose data starts after memsave's block
/// header.) Does nothing for memory outside the pinned arena.
void cuda_record_host_use(const at::Tensor& host, const c10::Stream& stream);
/// cuda_record_host_use for a copy queued on the current stream of `device`; nothing for a CPU device or in a
/// build without CUDA.
void record_host_use(const at::Tensor& host, c10::Device device);

/// host_empty of `t`'s shape and `dtype`, laid out as `t` when `t` fills its memory in some order (a
/// channels_last activation or weight), row-major otherwise. A copy between the two is then one block each
/// way (between layouts, LibTorch's copy off a CUDA device goes through a device buffer), and what comes back
/// is laid out as `t` was.
at::Tensor host_empty_like(const at::Tensor& t, at::ScalarType dtype);

/// memsave::host_memory_available with the files it reads (/proc/meminfo, /proc/self/cgroup, /sys/fs/cgroup)
/// under `root` ("" for the machine's own).
int64_t host_memory_available(const std::string& root);

}  // namespace memsave::detail
