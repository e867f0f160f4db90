#include "optim_cpu.h"

#include <cstdlib>
#include <optional>
#include <string>

namespace memsave::kernels {

#define MEMSAVE_DECLARE_ISA(isa)                                                                           \
  namespace isa {                                                                                          \
  void step32(const Step32& step, std::int64_t begin, std::int64_t end);                                   \
  void step_quantized(const StepQuantized& step, std::int64_t block_begin, std::int64_t block_end);        \
  void quantize(const VectorBook& book, const float* values, float scale, std::uint8_t* codes,             \
                std::int64_t n);                                                                           \
  void dequantize(const VectorBook& book, const std::uint8_t* codes, float absmax, float* out,             \
                  std::int64_t n);                                                                         \
  void quantize_blocks(const VectorBook& book, int bits, const float* values, std::int64_t n,              \
                       std::int64_t block_size, std::uint8_t* codes, float* absmax,                        \
                       std::int64_t block_begin, std::int64_t block_end);                                  \
  void dequantize_blocks(const VectorBook& book, int bits, const std::uint8_t* codes, const float* absmax, \
                         std::int64_t n, std::int64_t block_size, float* out, std::int64_t block_begin,    \
                         std::int64_t block_end);                                                          \
  }
MEMSAVE_DECLARE_ISA(baseline)
#if defined(__x86_64__)
MEMSAVE_DECLARE_ISA(avx2)
MEMSAVE_DECLARE_ISA(avx512)
MEMSAVE_DECLARE_ISA(avx512vbmi)
#endif
#undef MEMSAVE_DECLARE_ISA

namespace {

enum class Isa { kBaseline, kAvx2, kAvx512, kAvx512Vbmi };
/// Their names, in Isa's order: what cpu_kernel_isa() says and MEMSAVE_CPU_ISA takes.
constexpr const char* kIsaNames[] = {"baseline", "avx2", "avx512", "avx512vbmi"};

/// MEMSAVE_CPU_ISA as it was at start-up ("" when unset); a function's static, so that it is read before the
/// first use whatever the order of static initialization.
const std::string& request() {
  static const std::string value = [] {
    const char* v = std::getenv("MEMSAVE_CPU_ISA");
    return std::string(v != nullptr ? v : "");
  }();
  return value;
}

/// The level request() names (an empty request names the highest); nothing when it names none.
std::optional<Isa> requested_cap() {
  if (request().empty()) return Isa::kAvx512Vbmi;
  for (int level = 0; level < 4; ++level) {
    if (request() == kIsaNames[level]) return static_cast<Isa>(level);
  }
  return std::nullopt;
}

/// The best the processor has, capped by MEMSAVE_CPU_ISA (for tests and comparisons).
Isa detect() {
  const Isa cap = requested_cap().value_or(Isa::kAvx512Vbmi);
  Isa best = Isa::kBaseline;
#if defined(__x86_64__)
  __builtin_cpu_init();
  // Every level above the baseline is also built with FMA and F16C, so it needs them too.
  const bool fma_f16c = __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (fma_f16c && __builtin_cpu_supports("avx2")) best = Isa::kAvx2;
  if (fma_f16c && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    best = __builtin_cpu_supports("avx512vbmi") ? Isa::kAvx512Vbmi : Isa::kAvx512;
  }
#endif
  return best < cap ? best : cap;
}

const Isa kIsa = detect();

}  // namespace

/// Calls the kernel `name` of the instruction set chosen at start-up.
#if defined(__x86_64__)
#define MEMSAVE_DISPATCH(name, ...)         \
  switch (kIsa) {                           \
    case Isa::kAvx512Vbmi:                  \
      return avx512vbmi::name(__VA_ARGS__); \
    case Isa::kAvx512:                      \
      return avx512::name(__VA_ARGS__);     \
    case Isa::kAvx2:                        \
      return avx2::name(__VA_ARGS__);       \
    case Isa::kBaseline:                    \
      break;                                \
  }                                         \
  return baseline::name(__VA_ARGS__)
#else
#define MEMSAVE_DISPATCH(name, ...) return baseline::name(__VA_ARGS__)
#endif

void step32_cpu(const Step32& step, std::int64_t begin, std::int64_t end) {
  MEMSAVE_DISPATCH(step32, step, begin, end);
}

void step_quantized_cpu(const StepQuantized& step, std::int64_t block_begin, std::int64_t block_end) {
  MEMSAVE_DISPATCH(step_quantized, step, block_begin, block_end);
}

namespace {

/// The optimizers' books as they are kept; any other book is built into `scratch`.
const VectorBook& vector_of(const CodeBook& book, VectorBook& scratch) {
  for (const int bits : {4, 8}) {
    if (&book == &signed_code_book(bits)) return vector_book(true, bits);
    if (&book == &unsigned_code_book(bits)) return vector_book(false, bits);
  }
  scratch = make_vector_book(book);
  return scratch;
}

}  // namespace

void quantize_cpu(const CodeBook& book, const float* values, float scale, std::uint8_t* codes,
                  std::int64_t n) {
  VectorBook scratch;
  MEMSAVE_DISPATCH(quantize, vector_of(book, scratch), values, scale, codes, n);
}

void dequantize_cpu(const CodeBook& book, const std::uint8_t* codes, float absmax, float* out,
                    std::int64_t n) {
  VectorBook scratch;
  MEMSAVE_DISPATCH(dequantize, vector_of(book, scratch), codes, absmax, out, n);
}

void quantize_blocks_cpu(const CodeBook& book, int bits, const float* values, std::int64_t n,
                         std::int64_t block_size, std::uint8_t* codes, float* absmax,
                         std::int64_t block_begin, std::int64_t block_end) {
  VectorBook scratch;
  MEMSAVE_DISPATCH(quantize_blocks, vector_of(book, scratch), bits, values, n, block_size, codes, absmax,
                   block_begin, block_end);
}

void dequantize_blocks_cpu(const CodeBook& book, int bits, const std::uint8_t* codes, const float* absmax,
                           std::int64_t n, std::int64_t block_size, float* out, std::int64_t block_begin,
                           std::int64_t block_end) {
  VectorBook scratch;
  MEMSAVE_DISPATCH(dequantize_blocks, vector_of(book, scratch), bits, codes, absmax, n, block_size, out,
                   block_begin, block_end);
}

#undef MEMSAVE_DISPATCH

VectorBook make_vector_book(const CodeBook& book) {
  VectorBook vector;
  vector.book = &book;
  for (int c = 0; c < book.count; ++c) {
    const std::uint32_t bits = to_bits(book.code[c]);
    for (int k = 0; k < 4; ++k) vector.plane[k][c] = static_cast<std::uint8_t>(bits >> (8 * k));
  }
  vector.lowest = quantize(book, 0.0f);
  if (book.count == 16) {
    const std::vector<std::uint32_t> thresholds = code_thresholds(book);
    for (int j = 0; j < 16; ++j) {
      vector.step_up[j] = j < static_cast<int>(thresholds.size()) ? thresholds[j] : 0xffffffffu;
    }
  }
  return vector;
}

const VectorBook& vector_book(bool is_signed, int bits) {
  static const VectorBook books[2][2] = {
      {make_vector_book(unsigned_code_book(4)), make_vector_book(unsigned_code_book(8))},
      {make_vector_book(signed_code_book(4)), make_vector_book(signed_code_book(8))}};
  return books[is_signed ? 1 : 0][bits == 4 ? 0 : 1];
}

const char* unknown_cpu_isa_request() { return requested_cap() ? nullptr : request().c_str(); }

const char* cpu_kernel_isa() { return kIsaNames[static_cast<int>(kIsa)]; }

const char* cpu_isa_levels() {
  static const std::string levels = [] {
    std::string out;
    for (const char* name : kIsaNames) out += (out.empty() ? "" : ", ") + std::string(name);
    return out;
  }();
  return levels.c_str();
}

}  // namespace memsave::kernels
