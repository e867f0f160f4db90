#include "finite.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace memsave::kernels {
namespace {

std::uint32_t bits_of(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

TEST(AllFinite, FindsAnInfOrNaNAnywhereInFp32) {
  const float bad[] = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                       std::numeric_limits<float>::quiet_NaN()};
  for (const float value : bad) {
    for (const std::int64_t where : {0, 1, 15, 16, 999}) {
      std::vector<float> v(1000, 3.0e38f);  // large but finite
      v[where] = value;
      EXPECT_FALSE(all_finite(v.data(), DType::kFloat32, 0, 1000)) << value << " at " << where;
      EXPECT_EQ(all_finite(v.data(), DType::kFloat32, where + 1, 1000), true);  // outside the range
    }
  }
  std::vector<float> fine = {0.0f, -0.0f, std::numeric_limits<float>::denorm_min(), -3.4e38f};
  EXPECT_TRUE(all_finite(fine.data(), DType::kFloat32, 0, 4));
}

TEST(AllFinite, ReadsTheExponentOfBf16AndFp16) {
  // bf16 is the high half of an fp32; fp16 inf is 0x7c00 and its largest finite value 0x7bff.
  std::vector<std::uint16_t> bf16 = {static_cast<std::uint16_t>(bits_of(1.5f) >> 16),
                                     static_cast<std::uint16_t>(bits_of(-3.0e38f) >> 16)};
  EXPECT_TRUE(all_finite(bf16.data(), DType::kBFloat16, 0, 2));
  bf16.push_back(static_cast<std::uint16_t>(bits_of(std::numeric_limits<float>::quiet_NaN()) >> 16));
  EXPECT_FALSE(all_finite(bf16.data(), DType::kBFloat16, 0, 3));
  std::vector<std::uint16_t> fp16 = {0x3c00, 0x7bff, 0xfbff};
  EXPECT_TRUE(all_finite(fp16.data(), DType::kFloat16, 0, 3));
  fp16.push_back(0xfc00);  // -inf
  EXPECT_FALSE(all_finite(fp16.data(), DType::kFloat16, 0, 4));
}

}  // namespace
}  // namespace memsave::kernels
