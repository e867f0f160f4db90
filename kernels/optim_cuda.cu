#include "optim_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>

#include "optim_cuda_kernels.cuh"

namespace memsave::kernels {
namespace {

static_assert(kInvalidValue == static_cast<int>(cudaErrorInvalidValue));

std::atomic<std::int64_t> launches{0};

/// Launches kernels on one stream, with no more thread blocks than the device holds at once.
struct StreamLaunch {
  cudaStream_t stream;

  template <typename Kernel>
  int operator()(Kernel kernel, std::int64_t units, int groups, const LaunchArgs& args) const {
    int device = 0, multiprocessors = 0, resident = 0;
    cudaError_t error = cudaGetDevice(&device);
    if (error == cudaSuccess)
      error = cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
    if (error == cudaSuccess)
      error = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, kThreads, 0);
    if (error != cudaSuccess) return static_cast<int>(error);
    const std::int64_t most = static_cast<std::int64_t>(std::max(resident, 1)) * std::max(multiprocessors, 1);
    launches.fetch_add(1, std::memory_order_relaxed);
    kernel<<<grid_blocks(units, groups, most), kThreads, 0, stream>>>(args);
    return static_cast<int>(cudaGetLastError());
  }
};

}  // namespace

std::int64_t cuda_step_launches() { return launches.load(std::memory_order_relaxed); }

int launch_step_cuda(const CudaStep& step, void* stream) {
  StreamLaunch launch{static_cast<cudaStream_t>(stream)};
  return step_with(step, launch);
}

}  // namespace memsave::kernels
