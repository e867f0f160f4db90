#include "fingerprint.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "fingerprint_cuda.cuh"

namespace memsave::kernels {
namespace {

template <typename Bits>
cudaError_t launch(const CudaFingerprint& f, cudaStream_t stream) {
  int device = 0, multiprocessors = 0, resident = 0;
  cudaError_t error = cudaGetDevice(&device);
  if (error == cudaSuccess)
    error = cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
  if (error == cudaSuccess)
    error = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, fingerprint_kernel<Bits>,
                                                          kFingerprintThreads, 0);
  if (error != cudaSuccess) return error;
  const std::int64_t most = static_cast<std::int64_t>(std::max(resident, 1)) * std::max(multiprocessors, 1);
  fingerprint_kernel<Bits><<<fingerprint_grid(f.numel, most), kFingerprintThreads, 0, stream>>>(
      static_cast<const Bits*>(f.data), f.numel, f.out);
  return cudaGetLastError();
}

}  // namespace

int launch_fingerprint_cuda(const CudaFingerprint& f, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  cudaError_t error = cudaMemsetAsync(f.out, 0, sizeof(std::uint64_t), s);
  if (error != cudaSuccess || f.numel == 0) return static_cast<int>(error);
  error = f.dtype == DType::kFloat32 ? launch<std::uint32_t>(f, s) : launch<std::uint16_t>(f, s);
  return static_cast<int>(error);
}

}  // namespace memsave::kernels
