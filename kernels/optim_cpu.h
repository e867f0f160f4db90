// Fused optimizer steps on the CPU: one pass over memory, single-threaded over a range (the caller splits the
// work across threads), built for AVX-512, AVX2 and baseline x86-64 and chosen at run time (intrinsics for
// the code-book look-ups, the compiler's vectorizer for the update math).
#pragma once

#include "dtypes.h"
#include "qmap.h"
#include "update_math.h"

#include <cstdint>

namespace memsave::kernels {

/// One tensor's step with fp32 state.
struct Step32 {
  void* param = nullptr;
  const void* grad = nullptr;
  DType dtype = DType::kFloat32;  ///< of param and grad
  float* m = nullptr;             ///< first moment (SGD: momentum buffer)
  float* v = nullptr;             ///< second moment, Adam rules only
  std::int64_t numel = 0;
  Rule rule = Rule::kAdamW;
  StepScalars scalars;
  float grad_scale = 1;  ///< the gradient is multiplied by this first (a GradScaler's 1/scale)
};

/// One tensor's step with blockwise 8-bit or 4-bit state: codes of the signed book for m, of the unsigned
/// book for v (qmap.h's books of `bits`), one float absmax per block of each.
struct StepQuantized {
  void* param = nullptr;
  const void* grad = nullptr;
  DType dtype = DType::kFloat32;
  std::uint8_t* m = nullptr;  ///< code_bytes(numel, bits) bytes
  std::uint8_t* v = nullptr;  ///< as m; Adam rules only
  float* absmax_m = nullptr;  ///< one per block
  float* absmax_v = nullptr;
  std::int64_t numel = 0;
  std::int64_t block_size = 256;  ///< a power of two in [64, 4096]
  Rule rule = Rule::kAdamW;
  StepScalars scalars;
  float grad_scale = 1;
  int bits = 8;  ///< 8, or 4 (two codes to a byte, qmap.h's code_bytes)
};

/// Updates elements [begin, end).
void step32_cpu(const Step32& step, std::int64_t begin, std::int64_t end);
/// Updates blocks [block_begin, block_end): dequantize, update, new block absmax, requantize, in one pass.
void step_quantized_cpu(const StepQuantized& step, std::int64_t block_begin, std::int64_t block_end);

/// codes[i] = the nearest code of values[i] * scale, as qmap.h's `quantize` gives it, with the vector code of
/// the step kernels (for tests that hold it to the scalar rule on any values).
void quantize_cpu(const CodeBook& book, const float* values, float scale, std::uint8_t* codes,
                  std::int64_t n);

/// The instruction set the CPU kernels run with here: "avx512", "avx2" or "baseline".
const char* cpu_kernel_isa();

}  // namespace memsave::kernels
