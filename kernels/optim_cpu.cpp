#include "optim_cpu.h"

#include <cstdlib>
#include <cstring>

namespace memsave::kernels {

#define MEMSAVE_DECLARE_ISA(isa)                                                                    \
  namespace isa {                                                                                   \
  void step32(const Step32& step, std::int64_t begin, std::int64_t end);                            \
  void step_quantized(const StepQuantized& step, std::int64_t block_begin, std::int64_t block_end); \
  void quantize(const CodeBook& book, const float* values, float scale, std::uint8_t* codes,        \
                std::int64_t n);                                                                    \
  }
MEMSAVE_DECLARE_ISA(baseline)
#if defined(__x86_64__)
MEMSAVE_DECLARE_ISA(avx2)
MEMSAVE_DECLARE_ISA(avx512)
#endif
#undef MEMSAVE_DECLARE_ISA

namespace {

enum class Isa { kBaseline, kAvx2, kAvx512 };

/// The best the processor has, capped by MEMSAVE_CPU_ISA=baseline|avx2 (for tests and comparisons).
Isa detect() {
  const char* cap = std::getenv("MEMSAVE_CPU_ISA");
  if (cap != nullptr && std::strcmp(cap, "baseline") == 0) return Isa::kBaseline;
  const bool avx2_at_most = cap != nullptr && std::strcmp(cap, "avx2") == 0;
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (!avx2_at_most && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq")) {
    return Isa::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kBaseline;
}

const Isa kIsa = detect();

}  // namespace

void step32_cpu(const Step32& step, std::int64_t begin, std::int64_t end) {
#if defined(__x86_64__)
  if (kIsa == Isa::kAvx512) return avx512::step32(step, begin, end);
  if (kIsa == Isa::kAvx2) return avx2::step32(step, begin, end);
#endif
  baseline::step32(step, begin, end);
}

void step_quantized_cpu(const StepQuantized& step, std::int64_t block_begin, std::int64_t block_end) {
#if defined(__x86_64__)
  if (kIsa == Isa::kAvx512) return avx512::step_quantized(step, block_begin, block_end);
  if (kIsa == Isa::kAvx2) return avx2::step_quantized(step, block_begin, block_end);
#endif
  baseline::step_quantized(step, block_begin, block_end);
}

void quantize_cpu(const CodeBook& book, const float* values, float scale, std::uint8_t* codes,
                  std::int64_t n) {
#if defined(__x86_64__)
  if (kIsa == Isa::kAvx512) return avx512::quantize(book, values, scale, codes, n);
  if (kIsa == Isa::kAvx2) return avx2::quantize(book, values, scale, codes, n);
#endif
  baseline::quantize(book, values, scale, codes, n);
}

const char* cpu_kernel_isa() {
  switch (kIsa) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kBaseline:
      break;
  }
  return "baseline";
}

}  // namespace memsave::kernels
