#include "qmap.h"

#include "golden.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace memsave::kernels {
namespace {

using memsave::testing::golden;

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

/// The exact nearest code by brute force over all codes, ties toward zero, computed in long double.
int brute_force(const CodeBook& book, float x) {
  if (std::isnan(x)) return -1;
  int best = 0;
  for (int i = 1; i < book.count; ++i) {
    const long double d = std::fabs(static_cast<long double>(x) - book.code[i]);
    const long double b = std::fabs(static_cast<long double>(x) - book.code[best]);
    if (d < b || (d == b && std::fabs(book.code[i]) < std::fabs(book.code[best]))) best = i;
  }
  return best;
}

void expect_same_codes(const std::vector<float>& codes, const std::vector<float>& expected,
                       const char* name) {
  ASSERT_EQ(codes.size(), expected.size()) << name;
  for (std::size_t i = 0; i < codes.size(); ++i) {
    EXPECT_TRUE(same_bits(codes[i], expected[i]))
        << name << " code " << i << ": " << codes[i] << " vs " << expected[i];
  }
}

TEST(CodeBook, MatchesBitsandbytesBitForBit) {
  expect_same_codes(dynamic_codes(true), golden("codebook.signed"), "signed");
  expect_same_codes(dynamic_codes(false), golden("codebook.unsigned"), "unsigned");
}

TEST(CodeBook, FourBitBooksMatchTorchaoBitForBit) {
  expect_same_codes(dynamic_codes(true, 4), golden("codebook4.signed"), "4-bit signed");
  expect_same_codes(linear_codes_without_zero(), golden("codebook4.unsigned"), "4-bit unsigned");
  for (const int bits : {4, 8}) {
    EXPECT_EQ(signed_code_book(bits).count, 1 << bits);
    EXPECT_EQ(unsigned_code_book(bits).count, 1 << bits);
  }
  const CodeBook& s = signed_code_book(4);
  EXPECT_EQ(s.code[0], -0.8875f);
  EXPECT_EQ(s.code[7], 0.0f);
  EXPECT_EQ(s.code[15], 1.0f);
  for (int k = 1; k < 8; ++k) EXPECT_EQ(s.code[7 - k], -s.code[7 + k]) << k;
  const CodeBook& u = unsigned_code_book(4);
  for (int k = 1; k <= 16; ++k) EXPECT_EQ(u.code[k - 1], static_cast<float>(k) / 16) << k;  // no zero
}

TEST(CodeBook, HasTheDocumentedShape) {
  const std::vector<float> s = dynamic_codes(true);
  const std::vector<float> u = dynamic_codes(false);
  ASSERT_EQ(s.size(), 256u);
  ASSERT_EQ(u.size(), 256u);
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
  std::vector<float> codes = dynamic_codes(true);
  std::swap(codes[10], codes[11]);
  EXPECT_THROW(make_code_book(codes), std::invalid_argument);
  codes = dynamic_codes(true);
  codes[255] = std::numeric_limits<float>::infinity();
  EXPECT_THROW(make_code_book(codes), std::invalid_argument);
  std::vector<float> dense(kCodes);
  for (int i = 0; i < kCodes; ++i) dense[i] = 0.5f + static_cast<float>(i) * 1e-6f;
  EXPECT_THROW(make_code_book(dense), std::invalid_argument);
  EXPECT_THROW(make_code_book(std::vector<float>(dense.begin(), dense.begin() + 100)), std::invalid_argument);
  std::vector<float> lopsided = dynamic_codes(true, 4);
  lopsided[3] = -0.2f;  // no longer the mirror of code 11
  EXPECT_THROW(make_code_book(lopsided), std::invalid_argument);
}

/// The four books the optimizers use.
std::vector<const CodeBook*> all_books() {
  return {&signed_code_book(8), &unsigned_code_book(8), &signed_code_book(4), &unsigned_code_book(4)};
}

void expect_nearest(const CodeBook& book, float x) {
  ASSERT_EQ(static_cast<int>(quantize(book, x)), brute_force(book, x))
      << "x = " << x << " (" << std::hexfloat << x << ")";
}

TEST(Quantize, IsTheExactNearestAtEveryMidpointAndCode) {
  for (const CodeBook* book : all_books()) {
    for (int i = 0; i < book->count; ++i) {
      const float next = i + 1 < book->count ? book->code[i + 1] : book->code[i];
      float around[] = {book->code[i], static_cast<float>((static_cast<double>(book->code[i]) + next) / 2)};
      for (float x : around) {
        float y = x;
        for (int k = 0; k < 3; ++k) y = std::nextafter(y, -2.0f);
        for (int k = 0; k < 7; ++k, y = std::nextafter(y, 2.0f)) expect_nearest(*book, y);
      }
    }
  }
}

TEST(CodeBook, ThresholdsAreWhereTheNearestCodeStepsUp) {
  for (const CodeBook* book : all_books()) {
    SCOPED_TRACE(std::string(book->is_signed ? "signed" : "unsigned") + " book of " +
                 std::to_string(book->count));
    const std::vector<std::uint32_t> thresholds = code_thresholds(*book);
    const int lowest = brute_force(*book, 0.0f);
    ASSERT_EQ(static_cast<int>(thresholds.size()), book->count - 1 - lowest);
    const auto magnitude = [](std::uint32_t bits) {
      float x;
      std::memcpy(&x, &bits, sizeof(x));
      return x;
    };
    for (std::size_t j = 0; j < thresholds.size(); ++j) {
      ASSERT_GT(thresholds[j], 0u);
      if (j > 0) {
        ASSERT_GT(thresholds[j], thresholds[j - 1]);
      }
      EXPECT_EQ(brute_force(*book, magnitude(thresholds[j] - 1)), lowest + static_cast<int>(j));
      EXPECT_EQ(brute_force(*book, magnitude(thresholds[j])), lowest + static_cast<int>(j) + 1);
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
  const CodeBook& s4 = signed_code_book(4);
  const CodeBook& u4 = unsigned_code_book(4);
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
    ASSERT_EQ(static_cast<int>(quantize(s4, x)), brute_force(s4, x)) << std::hexfloat << x;
    ASSERT_EQ(static_cast<int>(quantize(u4, m)), brute_force(u4, m)) << std::hexfloat << m;
  }
}

TEST(Quantize, FourBitBooksHandleZerosTiesEndsAndNonFiniteValues) {
  const CodeBook& s = signed_code_book(4);
  const CodeBook& u = unsigned_code_book(4);
  EXPECT_EQ(quantize(s, 0.0f), 7);
  EXPECT_EQ(quantize(s, -0.0f), 7);
  EXPECT_EQ(quantize(s, 1.0f), 15);
  EXPECT_EQ(quantize(s, -1.0f), 0);
  EXPECT_EQ(quantize(s, -std::numeric_limits<float>::infinity()), 0);
  EXPECT_EQ(quantize(s, 5.0f), 15);
  EXPECT_EQ(quantize(s, s.code[8] / 2), 7);  // a tie between 0 and the smallest positive code: to 0
  EXPECT_EQ(quantize(s, -s.code[8] / 2), 7);
  // The unsigned book has no 0: everything up to the midpoint of 1/16 and 2/16 (a tie, to 1/16) is 1/16.
  EXPECT_EQ(quantize(u, 0.0f), 0);
  EXPECT_EQ(quantize(u, 1e-30f), 0);
  EXPECT_EQ(quantize(u, 3.0f / 32), 0);
  EXPECT_EQ(quantize(u, std::nextafter(3.0f / 32, 1.0f)), 1);
  EXPECT_EQ(quantize(u, -0.5f), 0);
  EXPECT_EQ(quantize(u, 1.0f), 15);
  EXPECT_EQ(quantize(u, std::numeric_limits<float>::infinity()), 15);
}

TEST(Quantize, FourBitCodesTakeHalfAByteRoundedUp) {
  EXPECT_EQ(code_bytes(3, 4), 2);
  EXPECT_EQ(code_bytes(4, 4), 2);
  EXPECT_EQ(code_bytes(3, 8), 3);
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
  for (const CodeBook* book : all_books()) {
    const CodeBook& s = *book;
    const int top = s.count - 1;
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> uniform(s.code[0], 1.0f);
    for (int i = 0; i < 100000; ++i) {
      const float x = uniform(rng);
      const std::uint8_t c = quantize(s, x);
      const float back = dequantize(s, c);
      const float gap = x >= back ? (c < top ? s.code[c + 1] - s.code[c] : 0.0f) : s.code[c] - s.code[c - 1];
      ASSERT_LE(std::fabs(x - back), gap / 2 + 1e-9f) << x << " in the book of " << s.count;
    }
  }
  const CodeBook& s = signed_code_book();
  // Below the lowest signed code (-0.99296875) values clamp to it: -1 comes back 0.7% small.
  EXPECT_EQ(dequantize(s, quantize(s, -1.0f)), -0.99296875f);
}

}  // namespace
}  // namespace memsave::kernels
