// A read-only inf/NaN check over a range of fp32, bf16 or fp16 values: the exponent field all ones. Integer
// compares only, so the loop vectorizes and runs at memory bandwidth; a GradScaler uses it to decide whether
// to step without rewriting the gradients.
#pragma once

#include "dtypes.h"

#include <cstdint>
#include <cstring>

namespace memsave::kernels {

template <typename Bits, Bits kExponent>
bool all_finite_bits(const void* data, std::int64_t begin, std::int64_t end) {
  const Bits* values = static_cast<const Bits*>(data);
  Bits highest = 0;  // the largest exponent field in the range: a max reduction, which compilers vectorize
  for (std::int64_t i = begin; i < end; ++i) {
    const Bits exponent = values[i] & kExponent;
    highest = exponent > highest ? exponent : highest;
  }
  return highest != kExponent;
}

/// True when no element in [begin, end) is inf or NaN.
inline bool all_finite(const void* data, DType dtype, std::int64_t begin, std::int64_t end) {
  switch (dtype) {
    case DType::kFloat32:
      return all_finite_bits<std::uint32_t, 0x7f800000u>(data, begin, end);
    case DType::kBFloat16:
      return all_finite_bits<std::uint16_t, 0x7f80u>(data, begin, end);
    case DType::kFloat16:
      return all_finite_bits<std::uint16_t, 0x7c00u>(data, begin, end);
  }
  return false;
}

}  // namespace memsave::kernels
