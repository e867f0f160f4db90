#include "qmap.h"

#include "golden.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace memsave::kernels {
namespace {

using memsave::testing::golden;

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

/// The exact nearest code by brute force over all 256 codes, ties toward zero, computed in long double.
int brute_force(const CodeBook& book, float x) {
  if (std::isnan(x)) return -1;
  int best = 0;
  for (int i = 1; i < kCodes; ++i) {
    const long double d = std::fabs(static_cast<long double>(x) - book.code[i]);
    const long double b = std::fabs(static_cast<long double>(x) - book.code[best]);
    if (d < b || (d == b && std::fabs(book.code[i]) < std::fabs(book.code[best]))) best = i;
  }
  return best;
}

TEST(CodeBook, MatchesBitsandbytesBitForBit) {
  for (const bool is_signed : {true, false}) {
    const std::vector<float>& expected = golden(is_signed ? "codebook.signed" : "codebook.unsigned");
    ASSERT_EQ(expected.size(), 256u);
    const std::array<float, kCodes> codes = dynamic_codes(is_signed);
    for (int i = 0; i < kCodes; ++i) {
      EXPECT_TRUE(same_bits(codes[i], expected[i])) << (is_signed ? "signed" : "unsigned") << " code " << i
                                                    << ": " << codes[i] << " vs " << expected[i];
    }
  }
}

TEST(CodeBook, HasTheDocumentedShape) {
  const std::array<float, kCodes> s = dynamic_codes(true);
  const std::array<float, kCodes> u = dynamic_codes(false);
  for (int i = 1; i < kCodes; ++i) {
    EXPECT_LT(s[i - 1], s[i]);
    EXPECT_LT(u[i - 1], u[i]);
  }
  EXPECT_EQ(s[0], -0.99296875f);
  EXPECT_EQ(s[127], 0.0f);
  EXPECT_EQ(s[255], 1.0f);
  for (int k = 1; k < 128; ++k) EXPECT_EQ(s[127 - k], -s[127 + k]) << k;  // symmetric but for the final 1.0
  EXPECT_EQ(u[0], 0.0f);
  EXPECT_NEAR(u[1], 3.25e-7f, 1e-12f);
  EXPECT_EQ(u[255], 1.0f);
}

TEST(CodeBook, RejectsUnsortedOrNonFiniteCodes) {
  std::array<float, kCodes> codes = dynamic_codes(true);
  std::swap(codes[10], codes[11]);
  EXPECT_THROW(make_code_book(codes), std::invalid_argument);
  codes = dynamic_codes(true);
  codes[255] = std::numeric_limits<float>::infinity();
  EXPECT_THROW(make_code_book(codes), std::invalid_argument);
  std::array<float, kCodes> dense{};
  for (int i = 0; i < kCodes; ++i) dense[i] = 0.5f + static_cast<float>(i) * 1e-6f;
  EXPECT_THROW(make_code_book(dense), std::invalid_argument);
}

void expect_nearest(const CodeBook& book, float x) {
  ASSERT_EQ(static_cast<int>(quantize(book, x)), brute_force(book, x))
      << "x = " << x << " (" << std::hexfloat << x << ")";
}

TEST(Quantize, IsTheExactNearestAtEveryMidpointAndCode) {
  for (const CodeBook* book : {&signed_code_book(), &unsigned_code_book()}) {
    for (int i = 0; i < kCodes; ++i) {
      const float next = i + 1 < kCodes ? book->code[i + 1] : book->code[i];
      float around[] = {book->code[i], static_cast<float>((static_cast<double>(book->code[i]) + next) / 2)};
      for (float x : around) {
        float y = x;
        for (int k = 0; k < 3; ++k) y = std::nextafter(y, -2.0f);
        for (int k = 0; k < 7; ++k, y = std::nextafter(y, 2.0f)) expect_nearest(*book, y);
      }
    }
  }
}

TEST(Quantize, TiesGoTowardZero) {
  const CodeBook& u = unsigned_code_book();
  const CodeBook& s = signed_code_book();
  // 0 and the smallest unsigned code: their midpoint is a float, and it rounds down to 0.
  const float mid = u.code[1] / 2;
  EXPECT_EQ(quantize(u, mid), 0);
  EXPECT_EQ(quantize(u, std::nextafter(mid, 1.0f)), 1);
  EXPECT_EQ(quantize(s, -s.code[128] / 2), 127);  // between the smallest negative code and 0: to 0
  EXPECT_EQ(quantize(s, s.code[128] / 2), 127);
}

TEST(Quantize, MatchesBruteForceOnAMillionValues) {
  std::mt19937 rng(42);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-40, 0);
  std::uniform_int_distribution<std::uint32_t> bits(0, 0x7fffffu);
  const CodeBook& s = signed_code_book();
  const CodeBook& u = unsigned_code_book();
  for (int i = 0; i < (1 << 20); ++i) {
    float x = 0;
    switch (i % 4) {
      case 0:
        x = std::clamp(normal(rng), -1.0f, 1.0f);
        break;
      case 1:
        x = uniform(rng);
        break;
      case 2:
        x = std::ldexp(uniform(rng), exponent(rng));
        break;  // tiny magnitudes, down to subnormal
      case 3: {
        const std::uint32_t b = bits(rng);  // subnormals
        std::memcpy(&x, &b, sizeof(x));
        break;
      }
    }
    ASSERT_EQ(static_cast<int>(quantize(s, x)), brute_force(s, x)) << std::hexfloat << x;
    const float m = std::fabs(x);
    ASSERT_EQ(static_cast<int>(quantize(u, m)), brute_force(u, m)) << std::hexfloat << m;
  }
}

TEST(Quantize, HandlesZerosEndsAndNonFiniteValues) {
  const CodeBook& s = signed_code_book();
  const CodeBook& u = unsigned_code_book();
  EXPECT_EQ(quantize(s, 0.0f), 127);
  EXPECT_EQ(quantize(s, -0.0f), 127);
  EXPECT_EQ(quantize(s, 1.0f), 255);
  EXPECT_EQ(quantize(s, -1.0f), 0);
  EXPECT_EQ(quantize(u, 0.0f), 0);
  EXPECT_EQ(quantize(u, 1.0f), 255);
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(quantize(s, inf), 255);
  EXPECT_EQ(quantize(s, -inf), 0);
  EXPECT_EQ(quantize(s, 3.0f), 255);
  const std::uint8_t nan_code = quantize(s, std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(nan_code == 0 || nan_code == 255);
}

TEST(Quantize, RoundTripErrorIsAtMostHalfTheLocalGap) {
  const CodeBook& s = signed_code_book();
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uniform(s.code[0], 1.0f);
  for (int i = 0; i < 100000; ++i) {
    const float x = uniform(rng);
    const std::uint8_t c = quantize(s, x);
    const float back = dequantize(s, c);
    const float gap = x >= back ? (c < 255 ? s.code[c + 1] - s.code[c] : 0.0f) : s.code[c] - s.code[c - 1];
    ASSERT_LE(std::fabs(x - back), gap / 2 + 1e-9f) << x;
  }
  // Below the lowest signed code (-0.99296875) values clamp to it: -1 comes back 0.7% small.
  EXPECT_EQ(dequantize(s, quantize(s, -1.0f)), -0.99296875f);
}

}  // namespace
}  // namespace memsave::kernels
