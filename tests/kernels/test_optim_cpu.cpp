#include "optim_cpu.h"
#include "qmap.h"

#include "golden.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace memsave::kernels {
namespace {

using memsave::testing::golden;

constexpr int kN = 256;

template <typename To, typename From>
To bit_cast(From from) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  std::memcpy(&to, &from, sizeof(to));
  return to;
}

/// The gradient of tests/data/golden.txt's trajectories (scripts/golden/make_golden.py, `gradient`).
std::vector<float> golden_gradient(int step) {
  static const float kScale[5] = {1.0f, 0.1f, 0.01f, 0.001f, 0.0001f};
  std::vector<float> g(kN);
  for (int i = 0; i < kN; ++i) {
    const auto ints = static_cast<float>((i * 7919 + step * 104729) % 2001 - 1000);
    g[i] = ints / 1000.0f * kScale[i % 5];
  }
  return g;
}

struct GoldenCase {
  std::string name;
  Rule rule;
  double lr, beta1, beta2, eps, weight_decay;
  bool nesterov;
};

/// Relative error of a vector: max |a - b| / max |b|.
double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return diff / scale;
}

TEST(Step32, MatchesPyTorchOptimizersOver100Steps) {
  const GoldenCase cases[] = {
      {"adam", Rule::kAdam, 1e-2, 0.9, 0.999, 1e-8, 0, false},
      {"adam_l2", Rule::kAdam, 1e-2, 0.9, 0.999, 1e-8, 0.01, false},
      {"adamw", Rule::kAdamW, 1e-2, 0.9, 0.999, 1e-8, 0.01, false},
      {"sgd_momentum", Rule::kSgd, 0.05, 0.9, 0, 0, 1e-3, false},
      {"sgd_nesterov", Rule::kSgd, 0.05, 0.9, 0, 0, 0, true},
  };
  for (const GoldenCase& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<float> p = golden("trajectory.initial"), m(kN, 0.0f), v(kN, 0.0f);
    // one step at step count t with the script's gradient of its step `gradient_step`
    auto step_at = [&](int t, int gradient_step) {
      std::vector<float> g = golden_gradient(gradient_step);
      Step32 step;
      step.param = p.data();
      step.grad = g.data();
      step.m = m.data();
      step.v = v.data();
      step.numel = kN;
      step.rule = c.rule;
      step.scalars = make_step_scalars(c.rule, c.lr, c.beta1, c.beta2, c.eps, c.weight_decay, t, c.nesterov);
      step32_cpu(step, 0, kN);
      return step.scalars;
    };
    for (int t = 1; t <= 100; ++t) {
      step_at(t, t);
      if (t == 1 || t == 10 || t == 100) {
        EXPECT_LE(relative_error(p, golden(c.name + ".params." + std::to_string(t))), 1e-6)
            << c.name << " step " << t;
      }
    }
    if (c.rule == Rule::kSgd) {
      EXPECT_LE(relative_error(m, golden(c.name + ".momentum_buffer.100")), 1e-6);
      continue;
    }
    EXPECT_LE(relative_error(m, golden(c.name + ".exp_avg.100")), 1e-6);
    EXPECT_LE(relative_error(v, golden(c.name + ".exp_avg_sq.100")), 1e-6);
    // Late in training (the script moves the step count to 20000): both bias corrections round to 1.
    for (int t = 20001; t <= 20010; ++t) ASSERT_EQ(step_at(t, 100 + t - 20000).bias2_sqrt, 1.0f);
    EXPECT_LE(relative_error(p, golden(c.name + ".late.params")), 1e-6);
    EXPECT_LE(relative_error(m, golden(c.name + ".late.exp_avg")), 1e-6);
    EXPECT_LE(relative_error(v, golden(c.name + ".late.exp_avg_sq")), 1e-6);
  }
}

/// Brute-force nearest code, ties toward zero: independent of the search tables.
std::uint8_t nearest(const CodeBook& book, float x) {
  int best = 0;
  for (int i = 1; i < book.count; ++i) {
    const double d = std::fabs(static_cast<double>(x) - book.code[i]);
    const double b = std::fabs(static_cast<double>(x) - book.code[best]);
    if (d < b || (d == b && std::fabs(book.code[i]) < std::fabs(book.code[best]))) best = i;
  }
  return static_cast<std::uint8_t>(best);
}

/// Quantized state as the kernels keep it: 8-bit codes one to a byte, 4-bit codes two to a byte (element
/// 2i in the high nibble), starting at the signed book's 0 and the unsigned book's lowest code.
struct QuantizedState {
  int bits;
  std::vector<std::uint8_t> m, v;
  std::vector<float> absmax_m, absmax_v;
  QuantizedState(std::int64_t n, std::int64_t block, int bits = 8)
      : bits(bits),
        m(bits == 4 ? (n + 1) / 2 : n, bits == 4 ? 0x77 : 127),
        v(bits == 4 ? (n + 1) / 2 : n, 0),
        absmax_m((n + block - 1) / block, 0.0f),
        absmax_v((n + block - 1) / block, 0.0f) {}

  /// Element i's code, read as the layout above says (independently of qmap.h's code_at).
  int get(const std::vector<std::uint8_t>& codes, std::int64_t i) const {
    if (bits == 8) return codes[i];
    return i % 2 == 0 ? codes[i / 2] / 16 : codes[i / 2] % 16;
  }
  /// A step of this state over n fp32 parameters.
  StepQuantized step(float* p, const float* g, std::int64_t n, std::int64_t block, Rule rule,
                     const StepScalars& k) {
    StepQuantized q;
    q.param = p;
    q.grad = g;
    q.m = m.data();
    q.v = has_second_moment(rule) ? v.data() : nullptr;
    q.absmax_m = absmax_m.data();
    q.absmax_v = has_second_moment(rule) ? absmax_v.data() : nullptr;
    q.numel = n;
    q.block_size = block;
    q.rule = rule;
    q.scalars = k;
    q.bits = bits;
    return q;
  }
  void set(std::vector<std::uint8_t>& codes, std::int64_t i, int code) const {
    if (bits == 8) {
      codes[i] = static_cast<std::uint8_t>(code);
    } else if (i % 2 == 0) {
      codes[i / 2] = static_cast<std::uint8_t>(code * 16 + codes[i / 2] % 16);
    } else {
      codes[i / 2] = static_cast<std::uint8_t>(codes[i / 2] / 16 * 16 + code);
    }
  }
};

/// The blockwise quantized step written plainly: the specification the fused kernel must meet bit for bit.
template <Rule R>
void reference_step(std::vector<float>& p, const std::vector<float>& g, QuantizedState& s, std::int64_t block,
                    const StepScalars& k) {
  const CodeBook& sb = signed_code_book(s.bits);
  const CodeBook& ub = unsigned_code_book(s.bits);
  const auto n = static_cast<std::int64_t>(p.size());
  for (std::int64_t b = 0; b * block < n; ++b) {
    const std::int64_t end = std::min(n, (b + 1) * block);
    std::vector<float> m, v;
    for (std::int64_t i = b * block; i < end; ++i) {
      float mi = sb.code[s.get(s.m, i)] * s.absmax_m[b];
      float vi = ub.code[s.get(s.v, i)] * s.absmax_v[b];
      update<R>(p[i], g[i], mi, vi, k);
      m.push_back(mi);
      v.push_back(vi);
    }
    float am = 0, av = 0;
    bool nan = false;
    for (float x : m) am = std::max(am, std::fabs(x)), nan |= std::isnan(x);
    for (float x : v) av = std::max(av, std::fabs(x)), nan |= std::isnan(x);
    ASSERT_FALSE(nan);
    s.absmax_m[b] = am;
    s.absmax_v[b] = av;
    for (std::int64_t i = b * block; i < end; ++i) {
      s.set(s.m, i, nearest(sb, m[i - b * block] * (am > 0 ? 1.0f / am : 1.0f)));
      if (has_second_moment(R)) s.set(s.v, i, nearest(ub, v[i - b * block] * (av > 0 ? 1.0f / av : 1.0f)));
    }
    if (s.bits == 4 && end == n && n % 2 != 0) {  // the last byte's unused low nibble is written as 0
      s.m[n / 2] &= 0xf0u;
      if (has_second_moment(R)) s.v[n / 2] &= 0xf0u;
    }
  }
}

template <Rule R>
void expect_fused_equals_reference(std::int64_t n, std::int64_t block, int bits) {
  SCOPED_TRACE("rule " + std::to_string(static_cast<int>(R)) + ", n " + std::to_string(n) + ", block " +
               std::to_string(block) + ", bits " + std::to_string(bits));
  std::mt19937 rng(static_cast<unsigned>(n * 31 + block));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> p(n), q;
  for (float& x : p) x = normal(rng);
  q = p;
  QuantizedState fused(n, block, bits), reference(n, block, bits);
  for (int t = 1; t <= 5; ++t) {
    std::vector<float> g(n);
    for (std::int64_t i = 0; i < n; ++i) g[i] = normal(rng) * (i % 7 == 0 ? 1e-4f : 1.0f);
    const StepScalars k = make_step_scalars(R, 1e-3, 0.9, 0.999, 1e-8, 0.01, t);
    const StepQuantized step = fused.step(p.data(), g.data(), n, block, R, k);
    const std::int64_t blocks = (n + block - 1) / block;
    step_quantized_cpu(step, 0, blocks / 2);  // two ranges, as two threads would take them
    step_quantized_cpu(step, blocks / 2, blocks);
    reference_step<R>(q, g, reference, block, k);
    ASSERT_EQ(std::memcmp(p.data(), q.data(), n * sizeof(float)), 0) << "parameters differ at step " << t;
    ASSERT_EQ(fused.m, reference.m) << "first-moment codes differ at step " << t;
    ASSERT_EQ(fused.absmax_m, reference.absmax_m);
    if (has_second_moment(R)) {
      ASSERT_EQ(fused.v, reference.v) << "second-moment codes differ at step " << t;
      ASSERT_EQ(fused.absmax_v, reference.absmax_v);
    }
  }
}

TEST(StepQuantized, FusedKernelEqualsThePlainSpecificationBitForBit) {
  for (const int bits : {8, 4}) {
    for (const std::int64_t block : {64, 128, 256, 4096}) {
      for (const std::int64_t n : {std::int64_t{1}, std::int64_t{37}, block, 3 * block + 17}) {
        expect_fused_equals_reference<Rule::kAdamW>(n, block, bits);
        expect_fused_equals_reference<Rule::kAdam>(n, block, bits);
        expect_fused_equals_reference<Rule::kLion>(n, block, bits);
        expect_fused_equals_reference<Rule::kSgd>(n, block, bits);
      }
    }
  }
  std::printf("CPU kernels ran with %s\n", cpu_kernel_isa());
}

/// Quantized and fp32 Adam from the same start on sum_i c_i (x_i - 1)^2, curvatures over two decades in every
/// block. NOTE: a block whose second moments span more than the 8-bit book's seven decades loses its smallest
/// ones to zero, and Adam then divides by eps alone: keep curvatures within a block comparable in such tests.
struct QuadraticRun {
  double initial = 0, loss32_at_100 = 0, loss_at_100 = 0, loss32 = 0, loss = 0, worst = 0;
  std::vector<float> params_at_100, params;  ///< of the quantized run
};

QuadraticRun run_quadratic(int bits, std::int64_t block) {
  constexpr std::int64_t n = 4096;
  std::vector<float> curvature(n), pq(n), p32(n), m32(n, 0.0f), v32(n, 0.0f);
  for (std::int64_t i = 0; i < n; ++i) {
    curvature[i] = std::pow(10.0f, static_cast<float>(i % 5) * 0.5f - 1.0f);
    pq[i] = p32[i] = static_cast<float>((i * 37) % 101) / 25.0f - 2.0f;
  }
  QuantizedState s(n, block, bits);
  auto loss = [&](const std::vector<float>& p) {
    double total = 0;
    for (std::int64_t i = 0; i < n; ++i) total += curvature[i] * std::pow(p[i] - 1.0, 2);
    return total;
  };
  QuadraticRun run;
  run.initial = loss(p32);
  for (int t = 1; t <= 300; ++t) {
    std::vector<float> gq(n), g32(n);
    for (std::int64_t i = 0; i < n; ++i) {
      gq[i] = 2 * curvature[i] * (pq[i] - 1.0f);
      g32[i] = 2 * curvature[i] * (p32[i] - 1.0f);
    }
    const StepScalars k = make_step_scalars(Rule::kAdam, 5e-2, 0.9, 0.999, 1e-8, 0, t);
    const StepQuantized step = s.step(pq.data(), gq.data(), n, block, Rule::kAdam, k);
    step_quantized_cpu(step, 0, n / block);
    Step32 step32{p32.data(), g32.data(), DType::kFloat32, m32.data(), v32.data(), n, Rule::kAdam, k, 1.0f};
    step32_cpu(step32, 0, n);
    if (t == 100) run.loss_at_100 = loss(pq), run.loss32_at_100 = loss(p32), run.params_at_100 = pq;
  }
  run.params = pq;
  run.loss32 = loss(p32);
  run.loss = loss(pq);
  for (std::int64_t i = 0; i < n; ++i)
    run.worst = std::max(run.worst, std::fabs(static_cast<double>(pq[i]) - p32[i]));
  return run;
}

TEST(StepQuantized, TracksFp32AdamOnAQuadratic) {
  const QuadraticRun r = run_quadratic(8, 256);
  // mid-way the 8-bit run is behind, but by a bounded amount
  EXPECT_LE(r.loss_at_100, 5 * r.loss32_at_100) << "step 100";
  // The stated bound: after 300 steps both runs have reduced the loss below 1e-10 of its start, and no 8-bit
  // parameter is more than 1e-4 from its fp32 counterpart.
  EXPECT_LT(r.loss32, 1e-10 * r.initial);
  EXPECT_LT(r.loss, 1e-10 * r.initial);
  EXPECT_LE(r.worst, 1e-4);
}

TEST(StepQuantized, FourBitAdamFollowsTorchaosAdam4bitOnAQuadratic) {
  // The same quadratic with torchao's Adam4bit (block 128) as the reference (scripts/golden/make_golden.py,
  // every 8th parameter after 100 and 300 steps). 4-bit state cannot follow fp32 Adam down to 1e-10 here:
  // once a parameter's gradient is small against its block's largest, its first moment rounds to 0 and it
  // stops (both implementations end near a loss of 413 of 28150, fp32 Adam near 2e-9). What is asserted is
  // that memsave's 4-bit step is the same algorithm as torchao's: torchao divides by the absmax instead of
  // multiplying by its inverse, rounds ties up and lets torch.compile order the float operations, so a few
  // codes differ, and the bound is on the parameters, not their bits.
  const QuadraticRun r = run_quadratic(4, 128);
  for (const auto& [t, params] : {std::make_pair(100, &r.params_at_100), std::make_pair(300, &r.params)}) {
    const std::vector<float>& expected = golden("torchao_adam4bit.quadratic.params." + std::to_string(t));
    ASSERT_EQ(expected.size() * 8, params->size());
    double worst = 0, total = 0;
    for (std::size_t j = 0; j < expected.size(); ++j) {
      const double d = std::fabs(static_cast<double>((*params)[8 * j]) - expected[j]);
      worst = std::max(worst, d);
      total += d;
    }
    // measured: worst 1.0e-5 and mean 2.5e-6 after 100 steps; worst 1.8e-3 (one parameter) and mean 1.1e-5
    // after 300 (printed)
    std::printf("against torchao's Adam4bit after %d steps: worst %.2g, mean %.2g\n", t, worst,
                total / static_cast<double>(expected.size()));
    EXPECT_LE(worst, t == 100 ? 1e-4 : 1e-2) << "step " << t;
    EXPECT_LE(total / static_cast<double>(expected.size()), 1e-4) << "step " << t;
  }
  EXPECT_LT(r.loss_at_100, 0.1 * r.initial);
  EXPECT_LT(r.loss, 0.5 * r.loss_at_100);
}

TEST(StepQuantized, ANonFiniteGradientPoisonsOnlyItsBlock) {
  constexpr std::int64_t n = 512, block = 256;
  std::vector<float> p(n, 1.0f), g(n, 0.5f);
  g[10] = NAN;
  QuantizedState s(n, block);
  const StepQuantized step = s.step(p.data(), g.data(), n, block, Rule::kAdamW,
                                    make_step_scalars(Rule::kAdamW, 1e-3, 0.9, 0.999, 1e-8, 0, 1));
  step_quantized_cpu(step, 0, 2);
  EXPECT_TRUE(std::isnan(s.absmax_m[0]));
  EXPECT_TRUE(std::isnan(s.absmax_v[0]));
  EXPECT_TRUE(std::isfinite(s.absmax_m[1]));
  EXPECT_TRUE(std::isfinite(p[300]));
}

TEST(StepQuantized, VectorQuantizeIsTheScalarRuleOnAnyValue) {
  // Every bit pattern is fair game here (NaN, infinities, magnitudes beyond 1 and 2, subnormals, negative
  // values for the unsigned book), plus the values a block really holds, through every vector width and tail.
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-30, 1);
  constexpr std::int64_t n = (1 << 20) + 13;
  std::vector<float> values(n);
  for (std::int64_t i = 0; i < n; ++i) {
    values[i] = i % 2 == 0 ? bit_cast<float>(any_bits(rng)) : std::ldexp(unit(rng), exponent(rng));
  }
  const float specials[] = {0.0f,
                            -0.0f,
                            1.0f,
                            -1.0f,
                            2.0f,
                            -2.0f,
                            INFINITY,
                            -INFINITY,
                            NAN,
                            -NAN,
                            std::nextafter(1.0f, 2.0f),
                            std::nextafter(2.0f, 0.0f),
                            1e-45f,
                            -1e-45f,
                            0x1p-25f,
                            std::nextafter(0x1p-25f, 0.0f)};
  for (std::size_t k = 0; k < sizeof(specials) / sizeof(float); ++k) values[k] = specials[k];
  // Around every magnitude where a book's code steps up (the 4-bit books' vector search compares with these).
  std::int64_t next = sizeof(specials) / sizeof(float);
  for (const CodeBook* book :
       {&signed_code_book(8), &unsigned_code_book(8), &signed_code_book(4), &unsigned_code_book(4)}) {
    for (const std::uint32_t t : code_thresholds(*book)) {
      for (const std::uint32_t bits : {t - 1, t, t + 1, t - 1 + 0x80000000u, t + 0x80000000u}) {
        values[next++] = bit_cast<float>(bits);
      }
    }
  }
  std::vector<std::uint8_t> vector_codes(n), scalar_codes(n);
  for (const CodeBook* book :
       {&signed_code_book(8), &unsigned_code_book(8), &signed_code_book(4), &unsigned_code_book(4)}) {
    for (const float scale : {1.0f, 0.75f, 3.0f, 1e30f}) {
      SCOPED_TRACE(std::string(book->is_signed ? "signed" : "unsigned") + " book of " +
                   std::to_string(book->count) + ", scale " + std::to_string(scale));
      quantize_cpu(*book, values.data(), scale, vector_codes.data(), n);
      for (std::int64_t i = 0; i < n; ++i) scalar_codes[i] = quantize(*book, values[i] * scale);
      for (std::int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(vector_codes[i], scalar_codes[i]) << "value " << std::hexfloat << values[i] << " at "
                                                    << std::dec << i << " (" << cpu_kernel_isa() << ")";
      }
    }
  }
}

TEST(StepQuantized, VectorDequantizeIsTheTableLookUp) {
  // Every code at every position of a vector, through every width and tail, and a non-finite absmax.
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> any_code(0, 255);
  for (const CodeBook* book :
       {&signed_code_book(8), &unsigned_code_book(8), &signed_code_book(4), &unsigned_code_book(4)}) {
    for (const std::int64_t n :
         {std::int64_t{1}, std::int64_t{15}, std::int64_t{64}, std::int64_t{1000} * 64 + 63}) {
      std::vector<std::uint8_t> codes(n);
      for (std::int64_t i = 0; i < n; ++i)
        codes[i] = static_cast<std::uint8_t>((any_code(rng) + i) % book->count);
      for (const float absmax : {1.0f, 0.0123f, 3e38f, INFINITY, NAN}) {
        std::vector<float> out(n);
        dequantize_cpu(*book, codes.data(), absmax, out.data(), n);
        for (std::int64_t i = 0; i < n; ++i) {
          const float expected = book->code[codes[i]] * absmax;
          ASSERT_EQ(bit_cast<std::uint32_t>(out[i]), bit_cast<std::uint32_t>(expected))
              << "code " << int{codes[i]} << " at " << i << " of " << n << ", book of " << book->count
              << ", absmax " << absmax << " (" << cpu_kernel_isa() << ")";
        }
      }
    }
  }
}

TEST(QuantizeBlocks, AreTheScalarRuleAndWhatAStepLeaves) {
  // Blocks of normal values, tiny ones, zeros, a NaN and an infinity; an odd tail for the 4-bit packing.
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const int bits : {8, 4}) {
    for (const std::int64_t block : {64, 256, 4096}) {
      const std::int64_t n = 5 * block + 37;
      std::vector<float> values(n);
      for (std::int64_t i = 0; i < n; ++i) values[i] = normal(rng) * (i < block ? 1.0f : 1e-3f);
      for (std::int64_t i = block; i < 2 * block; ++i) values[i] *= 1e-30f;  // subnormal products
      for (std::int64_t i = 2 * block; i < 3 * block; ++i) values[i] = 0.0f;
      values[3 * block + 5] = NAN;
      values[4 * block + 1] = -INFINITY;
      const std::int64_t blocks = (n + block - 1) / block;
      for (const CodeBook* book : {&signed_code_book(bits), &unsigned_code_book(bits)}) {
        SCOPED_TRACE(std::to_string(bits) + "-bit " + (book->is_signed ? "signed" : "unsigned") +
                     " book, block " + std::to_string(block));
        std::vector<float> input = values;
        if (!book->is_signed)
          for (float& x : input) x = std::fabs(x);
        QuantizedState out(n, block, bits);
        quantize_blocks_cpu(*book, bits, input.data(), n, block, out.m.data(), out.absmax_m.data(), 0,
                            blocks);
        for (std::int64_t b = 0; b < blocks; ++b) {
          float largest = 0;
          bool nan = false;
          for (std::int64_t i = b * block; i < std::min(n, (b + 1) * block); ++i) {
            nan = nan || std::isnan(input[i]);
            largest = std::max(largest, std::fabs(input[i]));
          }
          if (nan) {
            ASSERT_TRUE(std::isnan(out.absmax_m[b])) << "block " << b;
          } else {
            ASSERT_EQ(out.absmax_m[b], largest) << "block " << b;
          }
          const float scale = block_scale(out.absmax_m[b]);
          for (std::int64_t i = b * block; i < std::min(n, (b + 1) * block); ++i) {
            ASSERT_EQ(out.get(out.m, i), quantize(*book, input[i] * scale)) << "element " << i;
          }
        }
        // And back: each code's value times its block's absmax.
        std::vector<float> back(n);
        dequantize_blocks_cpu(*book, bits, out.m.data(), out.absmax_m.data(), n, block, back.data(), 0,
                              blocks);
        for (std::int64_t i = 0; i < n; ++i) {
          const float expected = book->code[out.get(out.m, i)] * out.absmax_m[i / block];
          ASSERT_EQ(bit_cast<std::uint32_t>(back[i]), bit_cast<std::uint32_t>(expected)) << "element " << i;
        }
      }
      // SGD's first step sets the momentum buffer to the gradient: the step's state is the gradient
      // quantized.
      std::vector<float> grad = values, param(n, 0.0f);
      grad[3 * block + 5] = 1.0f, grad[4 * block + 1] = -2.0f;  // finite, so that the step is defined
      QuantizedState stepped(n, block, bits);
      const StepScalars k = make_step_scalars(Rule::kSgd, 0.1, 0.9, 0, 0, 0, 1);
      step_quantized_cpu(stepped.step(param.data(), grad.data(), n, block, Rule::kSgd, k), 0, blocks);
      QuantizedState direct(n, block, bits);
      quantize_blocks_cpu(signed_code_book(bits), bits, grad.data(), n, block, direct.m.data(),
                          direct.absmax_m.data(), 0, blocks);
      EXPECT_EQ(direct.m, stepped.m);
      EXPECT_EQ(direct.absmax_m, stepped.absmax_m);
    }
  }
}

/// Storage values of type T (bf16 or fp16 bits): mostly N(0, scale), and every special kind of value.
template <typename T>
std::vector<T> storage_values(std::int64_t n, float scale, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<T> out(n);
  for (std::int64_t i = 0; i < n; ++i) out[i] = from_float<T>(normal(rng));
  const bool half = std::is_same_v<T, Float16>;
  const std::uint16_t specials[] = {0x0000,
                                    0x8000,
                                    0x0001,
                                    0x8001,
                                    0x03ff,
                                    0x0400,  // zeros, subnormals
                                    half ? std::uint16_t{0x7bff} : std::uint16_t{0x7f7f},   // largest finite
                                    half ? std::uint16_t{0x7c00} : std::uint16_t{0x7f80},   // infinity
                                    half ? std::uint16_t{0xfc00} : std::uint16_t{0xff80},   // -infinity
                                    half ? std::uint16_t{0x7e01} : std::uint16_t{0x7fc1},   // quiet NaN
                                    half ? std::uint16_t{0x7d01} : std::uint16_t{0x7f81}};  // signaling NaN
  for (std::size_t k = 0; k < sizeof(specials) / sizeof(specials[0]); ++k) {
    out[(k * 97 + seed) % n] = T{specials[k]};
  }
  return out;
}

/// A half-precision step (state of `bits`, 32 for fp32 state; blocks of `block`) against the fp32-storage
/// step on the same values, which the other tests hold to the specification: the parameters must be those
/// values rounded (to nearest, or with `stochastic` as from_float_stochastic rounds them with each element's
/// rounding_bits, which the fp32 step ignores), the state the same bits. With `stochastic` the half-precision
/// step runs in two calls split inside a block (as threads split it), so each element's bits must follow
/// its index in the tensor, not in the call.
template <typename T, Rule R>
void expect_storage_steps_as_floats(int bits, std::int64_t block, bool stochastic = false) {
  SCOPED_TRACE(std::string(std::is_same_v<T, Float16> ? "fp16" : "bf16") + ", rule " +
               std::to_string(static_cast<int>(R)) + ", state bits " + std::to_string(bits) + ", blocks of " +
               std::to_string(block) + (stochastic ? ", stochastic rounding" : ""));
  const DType dtype = std::is_same_v<T, Float16> ? DType::kFloat16 : DType::kBFloat16;
  constexpr std::int64_t n = 3 * 256 + 37;  // past a 256-element staging chunk, with tails
  std::vector<T> p16 = storage_values<T>(n, 1.0f, 5);
  std::vector<float> p32(n);
  for (std::int64_t i = 0; i < n; ++i) p32[i] = to_float(p16[i]);
  std::vector<float> m16(n, 0.0f), v16(n, 0.0f), m32(n, 0.0f), v32(n, 0.0f);
  QuantizedState q16(n, block, bits == 32 ? 8 : bits), q32(n, block, bits == 32 ? 8 : bits);
  for (int t = 1; t <= 3; ++t) {
    const std::vector<T> g16 = storage_values<T>(n, 1e-2f, 10u + static_cast<unsigned>(t));
    std::vector<float> g32(n);
    for (std::int64_t i = 0; i < n; ++i) g32[i] = to_float(g16[i]);
    StepScalars k = make_step_scalars(R, 1e-3, 0.9, 0.999, 1e-8, 0.01, t);
    k.stochastic_round = stochastic ? 1 : 0;
    k.round_seed = stochastic_round_seed(t, 3);
    const std::int64_t blocks = (n + block - 1) / block, split = stochastic ? blocks / 2 : blocks;
    if (bits == 32) {
      const Step32 s16{p16.data(), g16.data(), dtype, m16.data(), v16.data(), n, R, k, 0.5f};
      const std::int64_t cut = stochastic ? split * block - 13 : n;
      step32_cpu(s16, 0, cut);
      step32_cpu(s16, cut, n);
      step32_cpu(Step32{p32.data(), g32.data(), DType::kFloat32, m32.data(), v32.data(), n, R, k, 0.5f}, 0,
                 n);
      ASSERT_EQ(std::memcmp(m16.data(), m32.data(), n * sizeof(float)), 0) << "first moments, step " << t;
      ASSERT_EQ(std::memcmp(v16.data(), v32.data(), n * sizeof(float)), 0) << "second moments, step " << t;
    } else {
      StepQuantized s16 = q16.step(nullptr, nullptr, n, block, R, k);
      s16.param = p16.data();
      s16.grad = g16.data();
      s16.dtype = dtype;
      const StepQuantized s32 = q32.step(p32.data(), g32.data(), n, block, R, k);
      step_quantized_cpu(s16, 0, split);
      step_quantized_cpu(s16, split, blocks);
      step_quantized_cpu(s32, 0, blocks);
      ASSERT_EQ(q16.m, q32.m) << "first-moment codes, step " << t;
      ASSERT_EQ(q16.v, q32.v) << "second-moment codes, step " << t;
      ASSERT_EQ(std::memcmp(q16.absmax_m.data(), q32.absmax_m.data(), q16.absmax_m.size() * sizeof(float)),
                0);
      ASSERT_EQ(std::memcmp(q16.absmax_v.data(), q32.absmax_v.data(), q16.absmax_v.size() * sizeof(float)),
                0);
    }
    for (std::int64_t i = 0; i < n; ++i) {
      std::uint16_t expected = from_float<T>(p32[i]).bits;
      if constexpr (std::is_same_v<T, BFloat16>) {
        if (stochastic) expected = from_float_stochastic(p32[i], rounding_bits(k.round_seed, i)).bits;
      }
      ASSERT_EQ(p16[i].bits, expected)
          << "parameter " << i << " at step " << t << " (" << cpu_kernel_isa() << ")";
      p32[i] = to_float(p16[i]);  // both runs go on from the stored value
    }
  }
}

template <typename T>
void expect_storage_steps_as_floats_for_every_rule(int bits, std::int64_t block, bool stochastic = false) {
  expect_storage_steps_as_floats<T, Rule::kAdamW>(bits, block, stochastic);
  expect_storage_steps_as_floats<T, Rule::kAdam>(bits, block, stochastic);
  expect_storage_steps_as_floats<T, Rule::kLion>(bits, block, stochastic);
  expect_storage_steps_as_floats<T, Rule::kSgd>(bits, block, stochastic);
}

TEST(StepKernels, HalfAndBFloat16StorageStepsAsItsFloatValues) {
  for (const int bits : {32, 8, 4}) {
    expect_storage_steps_as_floats_for_every_rule<Float16>(bits, 128);
    expect_storage_steps_as_floats_for_every_rule<BFloat16>(bits, 128);
  }
  // A block over four of the fp16 path's 256-element staging chunks: its absmax is kept across them.
  for (const int bits : {8, 4}) {
    expect_storage_steps_as_floats_for_every_rule<Float16>(bits, 1024);
    expect_storage_steps_as_floats_for_every_rule<BFloat16>(bits, 1024);
  }
}

TEST(StepKernels, BFloat16StochasticRoundingRoundsTheFloatStepWithEachElementsBits) {
  for (const int bits : {32, 8, 4}) {
    expect_storage_steps_as_floats_for_every_rule<BFloat16>(bits, 128, /*stochastic=*/true);
  }
  expect_storage_steps_as_floats_for_every_rule<BFloat16>(8, 1024, /*stochastic=*/true);
  // fp16 has no stochastic rounding: the flag leaves it rounding to nearest
  expect_storage_steps_as_floats_for_every_rule<Float16>(32, 128, /*stochastic=*/true);
  expect_storage_steps_as_floats_for_every_rule<Float16>(8, 128, /*stochastic=*/true);
}

TEST(StepKernels, BFloat16StochasticRoundingKeysEachElementByItsWholeIndex) {
  // Elements 2^32 - 300 ... 2^32 + 299 of a tensor of over 2^32 elements, stepped as a thread steps its
  // range: the bits must follow the 64-bit index across the 2^32 boundary, where the kernel changes its key.
  // (The tensor's other elements do not exist: the step gets a base pointer that only this range is read
  // through.)
  const std::int64_t first = (std::int64_t{1} << 32) - 300, n = 600;
  std::vector<BFloat16> p16 = storage_values<BFloat16>(n, 1.0f, 7),
                        g16 = storage_values<BFloat16>(n, 1e-2f, 8);
  for (std::int64_t i = 0; i < n; ++i) {  // finite values only: each is then stepped to a finite one
    if (!std::isfinite(to_float(p16[i]))) p16[i] = from_float<BFloat16>(0.5f);
    if (!std::isfinite(to_float(g16[i]))) g16[i] = from_float<BFloat16>(0.25f);
  }
  std::vector<float> p32(n), g32(n), m16(n, 0.0f), v16(n, 0.0f), m32(n, 0.0f), v32(n, 0.0f);
  for (std::int64_t i = 0; i < n; ++i) p32[i] = to_float(p16[i]), g32[i] = to_float(g16[i]);
  StepScalars k = make_step_scalars(Rule::kAdamW, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1);
  k.stochastic_round = 1;
  k.round_seed = stochastic_round_seed(1, 0);
  const auto base = reinterpret_cast<std::uintptr_t>(p16.data()) - first * sizeof(BFloat16);
  const auto grad_base = reinterpret_cast<std::uintptr_t>(g16.data()) - first * sizeof(BFloat16);
  const auto m_base = reinterpret_cast<std::uintptr_t>(m16.data()) - first * sizeof(float);
  const auto v_base = reinterpret_cast<std::uintptr_t>(v16.data()) - first * sizeof(float);
  const Step32 s16{reinterpret_cast<void*>(base),
                   reinterpret_cast<const void*>(grad_base),
                   DType::kBFloat16,
                   reinterpret_cast<float*>(m_base),
                   reinterpret_cast<float*>(v_base),
                   first + n,
                   Rule::kAdamW,
                   k,
                   1.0f};
  step32_cpu(s16, first, first + n);
  step32_cpu(
      Step32{p32.data(), g32.data(), DType::kFloat32, m32.data(), v32.data(), n, Rule::kAdamW, k, 1.0f}, 0,
      n);
  int rounded_up = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(p16[i].bits, from_float_stochastic(p32[i], rounding_bits(k.round_seed, first + i)).bits)
        << "element " << first + i << " (" << cpu_kernel_isa() << ")";
    rounded_up += p16[i].bits != (bit_cast<std::uint32_t>(p32[i]) >> 16) ? 1 : 0;
  }
  EXPECT_GT(rounded_up, 0);
  EXPECT_LT(rounded_up, n);
}

TEST(Step32, GradScaleMultipliesTheGradientFirst) {
  std::vector<float> p1(64, 0.5f), p2(64, 0.5f), g(64), gs(64), m1(64, 0.0f), v1(64, 0.0f), m2(64, 0.0f),
      v2(64, 0.0f);
  for (int i = 0; i < 64; ++i) g[i] = 0.01f * static_cast<float>(i - 32), gs[i] = g[i] * 1024.0f;
  const StepScalars k = make_step_scalars(Rule::kAdamW, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1);
  step32_cpu(Step32{p1.data(), g.data(), DType::kFloat32, m1.data(), v1.data(), 64, Rule::kAdamW, k, 1.0f}, 0,
             64);
  step32_cpu(
      Step32{p2.data(), gs.data(), DType::kFloat32, m2.data(), v2.data(), 64, Rule::kAdamW, k, 1.0f / 1024},
      0, 64);
  EXPECT_EQ(p1, p2);  // scaling by a power of two is exact
  EXPECT_EQ(m1, m2);
}

/// The compiler's own IEEE half type, the conversions' reference (GCC 12 has no _Float16 in C++ on Arm).
#if defined(__aarch64__)
using CompilerHalf = __fp16;
#else
using CompilerHalf = _Float16;
#endif

TEST(Conversions, HalfAndBFloat16RoundToNearestEven) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const Float16 half{static_cast<std::uint16_t>(h)};
    const float x = to_float(half);
    const CompilerHalf reference = bit_cast<CompilerHalf>(static_cast<std::uint16_t>(h));
    if (std::isnan(x)) {
      EXPECT_TRUE(std::isnan(static_cast<float>(reference)));
      continue;
    }
    ASSERT_EQ(x, static_cast<float>(reference)) << h;
    ASSERT_EQ(from_float<Float16>(x).bits, h) << h;
    const BFloat16 b{static_cast<std::uint16_t>(h)};
    if (!std::isnan(to_float(b))) {
      ASSERT_EQ(from_float<BFloat16>(to_float(b)).bits, h);
    }
  }
  std::mt19937 rng(3);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 1000000; ++i) {
    const std::uint32_t u = bits(rng);
    float x;
    std::memcpy(&x, &u, sizeof(x));
    if (std::isnan(x)) continue;
    const auto reference = static_cast<CompilerHalf>(x);  // the compiler's conversion rounds to nearest even
    ASSERT_EQ(from_float<Float16>(x).bits, bit_cast<std::uint16_t>(reference)) << std::hexfloat << x;
    // bf16: the nearer of the two neighbours, ties to the even one
    const std::uint32_t down = u & 0xffff0000u, up = down + 0x10000u;
    float fd, fu;
    std::memcpy(&fd, &down, 4);
    std::memcpy(&fu, &up, 4);
    // past the largest finite value the next one up is infinity, which rounding treats as 2^128
    const double fu_d = std::isinf(fu) ? std::copysign(std::ldexp(1.0, 128), fu) : fu;
    const double dd = std::fabs(static_cast<double>(x) - fd), du = std::fabs(fu_d - x);
    const std::uint32_t expected = (du < dd || (du == dd && ((down >> 16) & 1u))) ? up : down;
    ASSERT_EQ(from_float<BFloat16>(x).bits, static_cast<std::uint16_t>(expected >> 16)) << std::hexfloat << x;
  }
}

TEST(Conversions, BFloat16StochasticRoundingIsUnbiasedBetweenTheTwoNeighbours) {
  // Over all 2^16 values of the random bits, x must round to the neighbour above it in magnitude exactly
  // (its dropped 16 bits) times, to the one below otherwise: the mean of the results is x itself.
  std::mt19937 rng(11);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  std::vector<float> values = {1.0f,     -1.0f,  0.999f,  -0.999f, 1e-3f, 3.0e38f,
                               -3.3e38f, 1e-40f, -1e-45f, 0.0f,    -0.0f};
  for (int i = 0; i < 200; ++i) {
    float x;
    const std::uint32_t u = any_bits(rng);
    std::memcpy(&x, &u, sizeof(x));
    if (std::isfinite(x)) values.push_back(x);
  }
  for (const float x : values) {
    const std::uint32_t u = bit_cast<std::uint32_t>(x);
    const std::uint32_t below = u >> 16, above = below + 1, dropped = u & 0xffffu;
    std::uint32_t ups = 0;
    double sum = 0;
    for (std::uint32_t r = 0; r < 65536; ++r) {
      const std::uint16_t b = from_float_stochastic(x, r * 0x10001u).bits;  // only the low 16 bits count
      ASSERT_TRUE(b == below || b == above) << std::hexfloat << x << " gave " << b;
      ups += b == above ? 1 : 0;
      sum += to_float(BFloat16{b});
    }
    ASSERT_EQ(ups, dropped) << std::hexfloat << x;
    if (std::isfinite(to_float(BFloat16{static_cast<std::uint16_t>(above)}))) {
      EXPECT_EQ(sum, 65536.0 * x) << std::hexfloat << x;  // exact: 2^16 bf16 values of two neighbours
    }
  }
  // NaN and infinity as to nearest
  for (const std::uint32_t u : {0x7f800000u, 0xff800000u, 0x7fc00001u, 0xffa00000u, 0x7f800001u}) {
    const float x = bit_cast<float>(u);
    for (const std::uint32_t r : {0u, 0xffffu, 0x8000u}) {
      ASSERT_EQ(from_float_stochastic(x, r).bits, from_float<BFloat16>(x).bits) << std::hex << u;
    }
  }
}

TEST(Conversions, RoundingBitsAreUniformAndDifferWithSeedAndIndex) {
  // The 16 bits a rounding uses, over 2^20 consecutive elements: uniform in 256 bins (chi-square under its
  // 99.9% point for 255 degrees of freedom, 330.5); for several seeds and a run of indices past 2^32.
  for (const auto& [seed, first] : std::vector<std::pair<std::uint32_t, std::int64_t>>{
           {0u, 0},
           {stochastic_round_seed(1, 0), 0},
           {stochastic_round_seed(2, 0), 0},
           {stochastic_round_seed(1, 1), (std::int64_t{1} << 32) - 1000}}) {
    constexpr int kCount = 1 << 20;
    std::vector<int> bins(256, 0);
    for (std::int64_t i = first; i < first + kCount; ++i) ++bins[(rounding_bits(seed, i) & 0xffffu) >> 8];
    double chi2 = 0;
    for (const int c : bins) chi2 += (c - kCount / 256.0) * (c - kCount / 256.0) / (kCount / 256.0);
    EXPECT_LT(chi2, 330.5) << "seed " << seed << " from index " << first;
  }
  // another step, another tensor, or the same index 2^32 further: other bits (equal 16-bit draws by chance:
  // about 1 in 65536)
  int same_step = 0, same_tensor = 0, same_low_word = 0;
  for (std::int64_t i = 0; i < 65536; ++i) {
    const std::uint32_t a = rounding_bits(stochastic_round_seed(7, 2), i) & 0xffffu;
    same_step += a == (rounding_bits(stochastic_round_seed(8, 2), i) & 0xffffu) ? 1 : 0;
    same_tensor += a == (rounding_bits(stochastic_round_seed(7, 3), i) & 0xffffu) ? 1 : 0;
    same_low_word +=
        a == (rounding_bits(stochastic_round_seed(7, 2), i + (std::int64_t{1} << 32)) & 0xffffu) ? 1 : 0;
  }
  EXPECT_LT(same_step, 8);
  EXPECT_LT(same_tensor, 8);
  EXPECT_LT(same_low_word, 8);
}

/// 0..3 for the levels baseline, avx2, avx512, avx512vbmi; -1 for any other name.
int level_index(const std::string& name) {
  const char* const names[] = {"baseline", "avx2", "avx512", "avx512vbmi"};
  for (int level = 0; level < 4; ++level) {
    if (name == names[level]) return level;
  }
  return -1;
}

/// Whether the processor reports what a level's kernels are built with (its own report, not the kernels'
/// detection).
bool processor_has(int level) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool avx2 =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool has[] = {true, avx2, avx512, avx512 && __builtin_cpu_supports("avx512vbmi")};
  return has[level];
#else
  return level == 0;
#endif
}

// Runs also under each MEMSAVE_CPU_ISA of tests/kernels/CMakeLists.txt (".avx2", ...), so the Step tests
// there do run the level their name says, and under a misspelt one (".unknown").
TEST(StepKernels, RunTheLevelThatMemsaveCpuIsaNames) {
  const char* value = std::getenv("MEMSAVE_CPU_ISA");
  const std::string request = value != nullptr ? value : "";
  const int running = level_index(cpu_kernel_isa());
  ASSERT_GE(running, 0) << cpu_kernel_isa();
  EXPECT_TRUE(processor_has(running)) << cpu_kernel_isa();
  const int asked = request.empty() ? 3 : level_index(request);
  if (asked < 0) {  // a name of no level: refused by the optimizers, and no cap
    ASSERT_NE(unknown_cpu_isa_request(), nullptr);
    EXPECT_EQ(std::string(unknown_cpu_isa_request()), request);
  } else {
    EXPECT_EQ(unknown_cpu_isa_request(), nullptr);
  }
  // The highest level the processor has, at most the one asked for.
  int expected = asked < 0 ? 3 : asked;
  while (!processor_has(expected)) --expected;
  EXPECT_EQ(running, expected) << "runs " << cpu_kernel_isa() << " for MEMSAVE_CPU_ISA=\"" << request << "\"";
}

}  // namespace
}  // namespace memsave::kernels
