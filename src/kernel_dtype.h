// The kernels' storage type (kernels/dtypes.h) of a LibTorch scalar type, for all of the glue.
#pragma once

#include "../kernels/dtypes.h"

#include <c10/core/ScalarType.h>

#include <optional>

namespace memsave {

/// fp32, bf16 or fp16 as the kernels name them; none for any other scalar type.
inline std::optional<kernels::DType> kernel_dtype(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float:
      return kernels::DType::kFloat32;
    case c10::ScalarType::BFloat16:
      return kernels::DType::kBFloat16;
    case c10::ScalarType::Half:
      return kernels::DType::kFloat16;
    default:
      return std::nullopt;
  }
}

}  // namespace memsave
