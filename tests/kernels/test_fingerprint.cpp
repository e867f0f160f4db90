// kernels/fingerprint.h on the CPU, and its CUDA kernel (kernels/fingerprint_cuda.cuh) on the emulation of
// CUDA threads, against an independent sum of the elements' bits and against the edits the offload must see.
#include "simt.h"  // first: the CUDA primitives the kernel is written against

#include "fingerprint.h"
#include "fingerprint_cuda.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace memsave::kernels {
namespace {

/// The reference: the elements' bits as signed integers, summed in 64-bit signed arithmetic (no overflow for
/// these sizes), then taken modulo 2^64.
std::uint64_t reference(const std::vector<float>& v) {
  std::int64_t sum = 0;
  for (const float x : v) {
    std::int32_t i;
    std::memcpy(&i, &x, 4);
    sum += i;
  }
  return static_cast<std::uint64_t>(sum);
}

std::uint64_t reference(const std::vector<std::uint16_t>& v) {
  std::int64_t sum = 0;
  for (const std::uint16_t b : v) sum += static_cast<std::int16_t>(b);
  return static_cast<std::uint64_t>(sum);
}

std::vector<float> gradient(std::mt19937& rng, std::int64_t n) {
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> decades(-9, 3);
  std::vector<float> g(static_cast<size_t>(n));
  const float scale = std::pow(10.0f, decades(rng));
  for (float& x : g) x = normal(rng) * scale;
  for (std::int64_t i = 0; i < n; i += 7) g[static_cast<size_t>(i)] = 0;  // dead units
  return g;
}

std::vector<std::uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<std::uint16_t> out;
  for (const float x : v) out.push_back(from_float<BFloat16>(x).bits);
  return out;
}

std::vector<std::uint16_t> to_fp16(const std::vector<float>& v) {
  std::vector<std::uint16_t> out;
  for (const float x : v) out.push_back(from_float<Float16>(x).bits);
  return out;
}

template <typename T>
std::uint64_t fingerprint_of(const std::vector<T>& v, DType dtype) {
  return fingerprint(v.data(), dtype, 0, static_cast<std::int64_t>(v.size()));
}

TEST(Fingerprint, IsTheSumOfTheElementsBitsAsSignedIntegers) {
  // by hand: 1.0f is 0x3f800000 = 1065353216; -2.0f is 0xc0000000 = -1073741824 as int32
  const std::vector<float> pair = {1.0f, -2.0f};
  EXPECT_EQ(fingerprint_of(pair, DType::kFloat32), static_cast<std::uint64_t>(1065353216LL - 1073741824LL));
  std::mt19937 rng(3);
  for (const std::int64_t n : {0, 1, 2, 15, 16, 17, 1000, 65537}) {
    std::vector<float> v = gradient(rng, n);
    if (n > 3) {
      v[1] = -0.0f;
      v[2] = std::numeric_limits<float>::quiet_NaN();
      v[3] = -std::numeric_limits<float>::infinity();
    }
    EXPECT_EQ(fingerprint_of(v, DType::kFloat32), reference(v)) << n;
    EXPECT_EQ(fingerprint_of(to_bf16(v), DType::kBFloat16), reference(to_bf16(v))) << n;
    EXPECT_EQ(fingerprint_of(to_fp16(v), DType::kFloat16), reference(to_fp16(v))) << n;
    // adjacent ranges add up, as the threads' shares do
    const std::int64_t cut = n / 3;
    EXPECT_EQ(fingerprint(v.data(), DType::kFloat32, 0, cut) + fingerprint(v.data(), DType::kFloat32, cut, n),
              reference(v));
  }
}

TEST(Fingerprint, SeesEveryClipScaleOrZeroingOfAGradient) {
  // What LibTorch's clip_grad_norm_ (x * coef, coef < 1), clip_grad_value_ (a clamp), an unscale and zero_()
  // write: whenever one changes any element, the fingerprint changes. Coefficients down to one ulp from 1,
  // which change only some elements.
  const float coefficients[] = {0.5f, 0.9f, 0.999f, 1.0f - 0x1p-24f, 1e-3f, 1e-30f, 0.0f, 1.0f + 0x1p-23f,
                                3.0f};
  std::mt19937 rng(11);
  int changed = 0, seen = 0;
  for (int trial = 0; trial < 20; ++trial) {
    for (const std::int64_t n : {1, 7, 1000, 65536}) {
      const std::vector<float> g = gradient(rng, n);
      std::vector<std::vector<float>> edits;
      for (const float c : coefficients) {
        std::vector<float> e = g;
        for (float& x : e) x *= c;
        edits.push_back(e);
      }
      std::vector<float> magnitudes;
      for (const float x : g) magnitudes.push_back(std::fabs(x));
      std::sort(magnitudes.begin(), magnitudes.end());
      const float limit = magnitudes[magnitudes.size() * 9 / 10];
      std::vector<float> clamped = g;
      for (float& x : clamped) x = std::min(std::max(x, -limit), limit);
      edits.push_back(clamped);
      const std::uint64_t print = fingerprint_of(g, DType::kFloat32);
      const std::vector<std::uint16_t> g_bf16 = to_bf16(g), g_fp16 = to_fp16(g);
      const std::uint64_t print_bf16 = fingerprint_of(g_bf16, DType::kBFloat16);
      const std::uint64_t print_fp16 = fingerprint_of(g_fp16, DType::kFloat16);
      for (const std::vector<float>& e : edits) {
        const bool differs = std::memcmp(e.data(), g.data(), g.size() * 4) != 0;
        changed += differs;
        seen += differs && fingerprint_of(e, DType::kFloat32) != print;
        const std::vector<std::uint16_t> e_bf16 = to_bf16(e), e_fp16 = to_fp16(e);
        if (e_bf16 != g_bf16) {
          EXPECT_NE(fingerprint_of(e_bf16, DType::kBFloat16), print_bf16);
        }
        if (e_fp16 != g_fp16) {
          EXPECT_NE(fingerprint_of(e_fp16, DType::kFloat16), print_fp16);
        }
      }
    }
  }
  EXPECT_GT(changed, 500);  // the edits do change gradients: the test is not vacuous
  EXPECT_EQ(seen, changed);
}

TEST(Fingerprint, DoesNotSeeAPermutation) {
  // The stated limit: the sum does not depend on where each element is.
  std::vector<float> g = {1.0f, -2.5f, 3.0f};
  const std::uint64_t before = fingerprint_of(g, DType::kFloat32);
  std::swap(g[0], g[2]);
  EXPECT_EQ(fingerprint_of(g, DType::kFloat32), before);
}

/// The CUDA kernel over the emulation, with a grid of at most `most` thread blocks (so its threads stride).
template <typename Bits>
std::uint64_t emulated(const std::vector<Bits>& v, std::int64_t most) {
  std::uint64_t out = 0;
  const auto n = static_cast<std::int64_t>(v.size());
  simt::run(fingerprint_kernel<Bits>, fingerprint_grid(n, most), kFingerprintThreads, v.data(), n, &out);
  return out;
}

TEST(EmulatedCudaFingerprint, IsTheCpuFingerprint) {
  std::mt19937 rng(5);
  for (const std::int64_t n : {0, 1, 31, 32, 257, 768, 100003}) {
    const std::vector<float> g = gradient(rng, n);
    std::vector<std::uint32_t> bits;
    for (const float x : g) bits.push_back(to_bits(x));
    for (const std::int64_t most : {1, 3}) {
      EXPECT_EQ(emulated(bits, most), fingerprint_of(g, DType::kFloat32)) << n << " elements, " << most;
      EXPECT_EQ(emulated(to_bf16(g), most), fingerprint_of(to_bf16(g), DType::kBFloat16)) << n;
    }
  }
}

TEST(EmulatedCudaFingerprint, TheGridCoversEveryElementOnce) {
  EXPECT_EQ(fingerprint_grid(0, 8), 1);
  EXPECT_EQ(fingerprint_grid(1, 8), 1);
  EXPECT_EQ(fingerprint_grid(kFingerprintThreads, 8), 1);
  EXPECT_EQ(fingerprint_grid(kFingerprintThreads + 1, 8), 2);
  EXPECT_EQ(fingerprint_grid(std::int64_t{1} << 40, 528), 528);  // 10^12 elements: the grid strides
}

}  // namespace
}  // namespace memsave::kernels
