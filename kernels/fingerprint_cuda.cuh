// The CUDA kernel of fingerprint.h, included by fingerprint_cuda.cu. Written against the CUDA primitives that
// tests/kernels/simt.h emulates (threadIdx, blockIdx, blockDim, gridDim, __shfl_xor_sync, atomicAdd), so the
// kernel tests also run it, as host C++, on a machine without a GPU.
#pragma once

#include "fingerprint.h"

#include <cstdint>

namespace memsave::kernels {
namespace {

constexpr int kFingerprintThreads = 256;

/// Adds the fingerprint of `numel` elements at `data` to *out (zeroed before): each thread sums a
/// grid-strided share, each warp reduces its threads' sums with shuffles, and its first lane adds the result
/// atomically.
template <typename Bits>
__global__ void __launch_bounds__(kFingerprintThreads)
    fingerprint_kernel(const Bits* data, std::int64_t numel, std::uint64_t* out) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  std::uint64_t sum = 0;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += stride)
    sum += fingerprint_term(data[i]);
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (threadIdx.x % 32 == 0)
    atomicAdd(reinterpret_cast<unsigned long long*>(out), static_cast<unsigned long long>(sum));
}

/// Thread blocks for `numel` elements: one per kFingerprintThreads elements, at most `most` (what the device
/// runs at once; the threads then stride).
inline int fingerprint_grid(std::int64_t numel, std::int64_t most) {
  const std::int64_t blocks = (numel + kFingerprintThreads - 1) / kFingerprintThreads;
  return static_cast<int>(blocks < most ? (blocks < 1 ? 1 : blocks) : most);
}

}  // namespace
}  // namespace memsave::kernels
