// A tensor's fingerprint: the sum, modulo 2^64, of its elements' bit patterns read as signed integers of
// their width (int32 for fp32, int16 for bf16 and fp16). The offload uses it to see a gradient changed
// without its version counter knowing (written through `.data()`, as LibTorch's clip_grad_norm_ writes).
//
// Why a plain sum is enough: read as a signed integer, an IEEE value's bits are its magnitude bits, less 2^31
// (2^15) when the sign is set, and magnitude bits order as magnitudes do. So a change that moves no magnitude
// up and at least one down (clipping by norm or by value, a scale below 1, zeroing), or the reverse (a scale
// above 1), changes the sum strictly, by less than 2^64 in total for tensors under 2^32 elements: it is
// always seen. A change of mixed direction is missed only when its integer changes cancel exactly; a
// permutation of the elements is not seen. Integer addition is associative, so any split over threads or CUDA
// blocks gives the same value, and the CPU and the CUDA kernel agree.
#pragma once

#include "dtypes.h"
#include "host_device.h"

#include <cstdint>

namespace memsave::kernels {

/// An element's term of the fingerprint: its bits sign-extended from their width, as an unsigned 64-bit value
/// (unsigned, so that the sum wraps instead of overflowing).
MEMSAVE_HD std::uint64_t fingerprint_term(std::uint32_t bits) {
  return static_cast<std::uint64_t>(static_cast<std::int64_t>(static_cast<std::int32_t>(bits)));
}
MEMSAVE_HD std::uint64_t fingerprint_term(std::uint16_t bits) {
  return static_cast<std::uint64_t>(static_cast<std::int64_t>(static_cast<std::int16_t>(bits)));
}

template <typename Bits>
std::uint64_t fingerprint_bits(const void* data, std::int64_t begin, std::int64_t end) {
  const Bits* values = static_cast<const Bits*>(data);
  std::uint64_t sum = 0;  // a sum of sign-extended integers: compilers vectorize it
  for (std::int64_t i = begin; i < end; ++i) sum += fingerprint_term(values[i]);
  return sum;
}

/// The fingerprint of elements [begin, end) of `data`; the fingerprints of adjacent ranges add up (mod 2^64)
/// to the fingerprint of their union.
inline std::uint64_t fingerprint(const void* data, DType dtype, std::int64_t begin, std::int64_t end) {
  if (dtype == DType::kFloat32) return fingerprint_bits<std::uint32_t>(data, begin, end);
  return fingerprint_bits<std::uint16_t>(data, begin, end);
}

/// The fingerprint on CUDA: `*out` (device memory) is set to the fingerprint of `numel` elements at `data`
/// (device), by kernels queued on `stream` (a cudaStream_t of the current device). Returns the cudaError_t of
/// the launch (0 on success). Defined in fingerprint_cuda.cu, built only with CUDA.
struct CudaFingerprint {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  std::int64_t numel = 0;
  std::uint64_t* out = nullptr;
};
int launch_fingerprint_cuda(const CudaFingerprint& f, void* stream);

}  // namespace memsave::kernels
