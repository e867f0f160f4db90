// Fused optimizer steps on the CPU: one pass over memory, single-threaded over a range (the caller splits the
// work across threads), built for AVX-512 with and without VBMI, AVX2 and baseline x86-64 and chosen at run
// time (intrinsics for the code-book look-ups, the compiler's vectorizer for the update math).
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

/// A book as the vector kernels look it up. 8-bit books: the 256 codes' bytes as four planes, which AVX-512
/// VBMI's byte permutes read 64 codes at a time from 16 registers (instead of a load per code).
/// 16-code books: the magnitudes at which the code steps up (qmap.h's code_thresholds), for a binary search
/// in one AVX-512 register (instead of a gather from the cell table).
struct VectorBook {
  const CodeBook* book = nullptr;
  alignas(64) std::uint8_t plane[4][kCodes] = {};  ///< plane[k][c]: bits 8k..8k+7 of code[c]
  alignas(64) std::uint32_t step_up[16] = {};      ///< 16-code books: the thresholds, then 0xffffffff
  std::uint32_t lowest = 0;                        ///< the code of magnitude 0: quantize(book, 0)
};
VectorBook make_vector_book(const CodeBook& book);
/// signed_code_book(bits) or unsigned_code_book(bits) as a VectorBook, built once.
const VectorBook& vector_book(bool is_signed, int bits);

/// Updates elements [begin, end).
void step32_cpu(const Step32& step, std::int64_t begin, std::int64_t end);
/// Updates blocks [block_begin, block_end): dequantize, update, new block absmax, requantize, in one pass.
void step_quantized_cpu(const StepQuantized& step, std::int64_t block_begin, std::int64_t block_end);

/// codes[i] = the nearest code of values[i] * scale, as qmap.h's `quantize` gives it, with the vector code of
/// the step kernels (for tests that hold it to the scalar rule on any values, and for benchmarks).
void quantize_cpu(const CodeBook& book, const float* values, float scale, std::uint8_t* codes,
                  std::int64_t n);

/// Blockwise quantization of n fp32 values (one moment), as a quantized step leaves its state: for each block
/// b in [block_begin, block_end) of `block_size` elements, absmax[b] = its largest magnitude (NaN when it
/// holds a NaN) and its codes the nearest of value * block_scale(absmax[b]), stored as code_bytes says for
/// `bits` (8, or 4: two to a byte). `block_size` is a power of two in [kMinBlock, kMaxBlock].
void quantize_blocks_cpu(const CodeBook& book, int bits, const float* values, std::int64_t n,
                         std::int64_t block_size, std::uint8_t* codes, float* absmax,
                         std::int64_t block_begin, std::int64_t block_end);

/// The inverse: for each block b in [block_begin, block_end), out = book.code[its codes] * absmax[b], as the
/// step kernels dequantize (codes stored as code_bytes says for `bits`).
void dequantize_blocks_cpu(const CodeBook& book, int bits, const std::uint8_t* codes, const float* absmax,
                           std::int64_t n, std::int64_t block_size, float* out, std::int64_t block_begin,
                           std::int64_t block_end);

/// out[i] = book.code[codes[i]] * absmax, with the vector code of the step kernels (tests, benchmarks).
void dequantize_cpu(const CodeBook& book, const std::uint8_t* codes, float absmax, float* out,
                    std::int64_t n);

/// The instruction set the CPU kernels run with here: "avx512vbmi", "avx512", "avx2" or "baseline", the best
/// the processor has, capped by the level that MEMSAVE_CPU_ISA names at start-up (unset or empty: no cap).
const char* cpu_kernel_isa();

/// MEMSAVE_CPU_ISA's value when it names none of the levels above (the kernels then run uncapped; the
/// optimizers refuse to start), else nullptr.
const char* unknown_cpu_isa_request();

/// The levels MEMSAVE_CPU_ISA takes, lowest first, comma-separated (for messages).
const char* cpu_isa_levels();

}  // namespace memsave::kernels
