// memsave's CPU optimizer kernels and their pieces on data that stays in cache (2^16 elements, one thread),
// per element: the quantized AdamW step (8-bit state in blocks of 256, 4-bit in blocks of 128), the
// fp32-state step, and the code-book look-ups alone, for each storage type of the parameters (bf16 also
// rounded stochastically); and the quantized steps of fp32 parameters on 2^24 elements, which stream from
// memory (a look-up that wins in cache can lose there); and the offload's gradient fingerprint beside a plain
// copy. The instruction set is the one the kernels chose at start-up
// (MEMSAVE_CPU_ISA=avx512vbmi|avx512|avx2|baseline caps it); the fingerprint is the header's inline loop,
// compiled as the glue compiles it. bench/RESULTS-optim.md quotes them.
#include "fingerprint.h"
#include "optim_cpu.h"
#include "qmap.h"

#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

namespace k = memsave::kernels;

constexpr std::int64_t kN = std::int64_t{1} << 16;

const char* dtype_name(k::DType dtype) {
  switch (dtype) {
    case k::DType::kFloat32:
      return "fp32";
    case k::DType::kBFloat16:
      return "bf16";
    case k::DType::kFloat16:
      return "fp16";
  }
  return "?";
}

/// Parameters and gradients of one storage type (fp32 values converted exactly as the kernels convert them).
struct Tensors {
  std::vector<float> p32, g32;
  std::vector<std::uint16_t> p16, g16;
  Tensors(k::DType dtype, std::int64_t n) {
    std::mt19937 rng(1);
    std::normal_distribution<float> normal;
    for (std::int64_t i = 0; i < n; ++i) {
      const float p = normal(rng), g = normal(rng) * 1e-2f;
      if (dtype == k::DType::kFloat32) {
        p32.push_back(p), g32.push_back(g);
      } else if (dtype == k::DType::kBFloat16) {
        p16.push_back(k::from_float<k::BFloat16>(p).bits), g16.push_back(k::from_float<k::BFloat16>(g).bits);
      } else {
        p16.push_back(k::from_float<k::Float16>(p).bits), g16.push_back(k::from_float<k::Float16>(g).bits);
      }
    }
  }
  void* param() { return p32.empty() ? static_cast<void*>(p16.data()) : p32.data(); }
  const void* grad() const { return g32.empty() ? static_cast<const void*>(g16.data()) : g32.data(); }
};

void per_element(benchmark::State& state, const std::string& label, std::int64_t n = kN) {
  state.counters["per_element"] = benchmark::Counter(
      static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.SetLabel(label + " (" + k::cpu_kernel_isa() + ")");
}

const k::StepScalars kAdamW = k::make_step_scalars(k::Rule::kAdamW, 1e-3, 0.9, 0.999, 1e-8, 0.01, 10);

/// Args: bits of state (8 or 4), storage type, log2 of the elements, stochastic rounding of bf16 (1) or not.
void BM_StepQuantized(benchmark::State& state) {
  const int bits = static_cast<int>(state.range(0));
  const auto dtype = static_cast<k::DType>(state.range(1));
  const std::int64_t n = std::int64_t{1} << state.range(2);
  const bool stochastic = state.range(3) != 0;
  Tensors t(dtype, n);
  const std::int64_t block = bits == 8 ? 256 : 128;
  std::vector<std::uint8_t> m(k::code_bytes(n, bits), bits == 8 ? 127 : 0x77), v(k::code_bytes(n, bits), 0);
  std::vector<float> absmax_m(n / block, 0.0f), absmax_v(n / block, 0.0f);
  k::StepQuantized step;
  step.param = t.param();
  step.grad = t.grad();
  step.dtype = dtype;
  step.m = m.data();
  step.v = v.data();
  step.absmax_m = absmax_m.data();
  step.absmax_v = absmax_v.data();
  step.numel = n;
  step.block_size = block;
  step.rule = k::Rule::kAdamW;
  step.scalars = kAdamW;
  step.scalars.stochastic_round = stochastic ? 1 : 0;
  step.bits = bits;
  for (int i = 0; i < 3; ++i) k::step_quantized_cpu(step, 0, n / block);  // past the all-zero start
  for (auto _ : state) {
    k::step_quantized_cpu(step, 0, n / block);
    benchmark::ClobberMemory();
  }
  per_element(state,
              std::to_string(bits) + "-bit AdamW, " + dtype_name(dtype) + " parameters, 2^" +
                  std::to_string(state.range(2)) + " elements" + (stochastic ? ", stochastic rounding" : ""),
              n);
}
BENCHMARK(BM_StepQuantized)
    ->ArgsProduct({{8, 4}, {0, 1, 2}, {16}, {0}})
    ->Args({8, 1, 16, 1})
    ->Args({4, 1, 16, 1})
    ->Args({8, 0, 24, 0})
    ->Args({4, 0, 24, 0});

/// Args: storage type, stochastic rounding of bf16 (1) or not.
void BM_Step32(benchmark::State& state) {
  const auto dtype = static_cast<k::DType>(state.range(0));
  const bool stochastic = state.range(1) != 0;
  Tensors t(dtype, kN);
  std::vector<float> m(kN, 0.0f), v(kN, 0.0f);
  k::Step32 step{t.param(), t.grad(), dtype, m.data(), v.data(), kN, k::Rule::kAdamW, kAdamW, 1.0f};
  step.scalars.stochastic_round = stochastic ? 1 : 0;
  for (auto _ : state) {
    k::step32_cpu(step, 0, kN);
    benchmark::ClobberMemory();
  }
  per_element(state, std::string("fp32-state AdamW, ") + dtype_name(dtype) + " parameters" +
                         (stochastic ? ", stochastic rounding" : ""));
}
BENCHMARK(BM_Step32)->ArgsProduct({{0, 1, 2}, {0}})->Args({1, 1});

/// Args: bits, signed book (1) or unsigned (0). Values as a block's moments are after scaling by its absmax.
void BM_Quantize(benchmark::State& state) {
  const int bits = static_cast<int>(state.range(0));
  const bool is_signed = state.range(1) != 0;
  const k::CodeBook& book = is_signed ? k::signed_code_book(bits) : k::unsigned_code_book(bits);
  std::mt19937 rng(2);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  std::vector<float> values(kN);
  for (float& x : values) x = std::fmin(1.0f, is_signed ? normal(rng) : std::fabs(normal(rng)));
  std::vector<std::uint8_t> codes(kN);
  for (auto _ : state) {
    k::quantize_cpu(book, values.data(), 1.0f, codes.data(), kN);
    benchmark::ClobberMemory();
  }
  per_element(state, std::to_string(bits) + "-bit " + (is_signed ? "signed" : "unsigned") + " book");
}
BENCHMARK(BM_Quantize)->ArgsProduct({{8, 4}, {1, 0}});

/// Args: bits, signed book (1) or unsigned (0).
void BM_Dequantize(benchmark::State& state) {
  const int bits = static_cast<int>(state.range(0));
  const bool is_signed = state.range(1) != 0;
  const k::CodeBook& book = is_signed ? k::signed_code_book(bits) : k::unsigned_code_book(bits);
  std::mt19937 rng(3);
  std::vector<std::uint8_t> codes(kN);
  for (std::uint8_t& c : codes) c = static_cast<std::uint8_t>(rng() % static_cast<unsigned>(book.count));
  std::vector<float> values(kN);
  for (auto _ : state) {
    k::dequantize_cpu(book, codes.data(), 0.5f, values.data(), kN);
    benchmark::ClobberMemory();
  }
  per_element(state, std::to_string(bits) + "-bit " + (is_signed ? "signed" : "unsigned") + " book");
}
BENCHMARK(BM_Dequantize)->ArgsProduct({{8, 4}, {1, 0}});

/// Args: storage type, log2 of the elements. The offload's gradient fingerprint (kernels/fingerprint.h): one
/// read of the gradient, beside a copy of the same bytes (what copying the gradient again would cost on the
/// CPU; its bytes read and written are the floor's measure of bandwidth).
void BM_Fingerprint(benchmark::State& state) {
  const auto dtype = static_cast<k::DType>(state.range(0));
  const std::int64_t n = std::int64_t{1} << state.range(1);
  const Tensors t(dtype, n);
  std::uint64_t print = 0;
  for (auto _ : state) {
    print += k::fingerprint(t.grad(), dtype, 0, n);
    benchmark::DoNotOptimize(print);
  }
  per_element(state, std::string("fingerprint, ") + dtype_name(dtype) + " gradient", n);
  state.SetBytesProcessed(state.iterations() * n * (dtype == k::DType::kFloat32 ? 4 : 2));
}
BENCHMARK(BM_Fingerprint)->ArgsProduct({{0, 1}, {16, 24}});

/// Arg: log2 of the fp32 elements. A plain copy (bytes processed: read plus written).
void BM_CopyFp32(benchmark::State& state) {
  const std::int64_t n = std::int64_t{1} << state.range(0);
  const Tensors t(k::DType::kFloat32, n);
  std::vector<float> out(static_cast<size_t>(n));
  for (auto _ : state) {
    std::memcpy(out.data(), t.grad(), static_cast<size_t>(n) * 4);
    benchmark::ClobberMemory();
  }
  per_element(state, "memcpy, fp32", n);
  state.SetBytesProcessed(state.iterations() * n * 8);
}
BENCHMARK(BM_CopyFp32)->Arg(16)->Arg(24);

}  // namespace

BENCHMARK_MAIN();
