#include "qmap.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace memsave::kernels {
namespace {

/// torch.linspace(0.1, 1, n, dtype=float32) on the CPU: each point is one fused multiply-add from the nearer
/// end, with the step rounded to float.
std::vector<float> linspace_tenth_to_one(int n) {
  const float start = 0.1f, end = 1.0f;
  const float step = (end - start) / static_cast<float>(n - 1);
  std::vector<float> points(n);
  for (int i = 0; i < n; ++i) {
    points[i] = i < n / 2 ? std::fma(step, static_cast<float>(i), start)
                          : std::fma(-step, static_cast<float>(n - 1 - i), end);
  }
  return points;
}

/// The exact nearest of 256 ascending codes, ties toward zero: the reference the tables are built from.
int nearest(const std::array<float, kCodes>& codes, float x) {
  if (std::isnan(x)) return -1;
  int best = 0;
  for (int i = 1; i < kCodes; ++i) {
    // NOTE: x - code is exact in double whenever the two compete (they are then within a factor 2^29).
    const double d = std::fabs(static_cast<double>(x) - codes[i]);
    const double b = std::fabs(static_cast<double>(x) - codes[best]);
    if (d < b || (d == b && std::fabs(codes[i]) < std::fabs(codes[best]))) best = i;
  }
  return best;
}

}  // namespace

std::array<float, kCodes> dynamic_codes(bool is_signed) {
  static const double kDecade[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1e0};
  std::vector<float> values;
  for (int i = 0; i < 7; ++i) {
    const int points = is_signed ? (1 << i) + 1 : (1 << (i + 1)) + 1;
    const std::vector<float> bounds = linspace_tenth_to_one(points);
    const auto scale = static_cast<float>(kDecade[i]);
    for (int j = 0; j + 1 < points; ++j) {
      const float mean = (bounds[j] + bounds[j + 1]) / 2.0f;
      values.push_back(scale * mean);
      if (is_signed) values.push_back(-scale * mean);
    }
  }
  values.push_back(0.0f);
  values.push_back(1.0f);
  std::sort(values.begin(), values.end());
  std::array<float, kCodes> codes{};
  std::copy(values.begin(), values.end(), codes.begin());
  return codes;
}

CodeBook make_code_book(const std::array<float, kCodes>& codes) {
  for (int i = 0; i < kCodes; ++i) {
    if (!std::isfinite(codes[i]) || (i > 0 && !(codes[i - 1] < codes[i]))) {
      throw std::invalid_argument("make_code_book: codes must be finite and strictly ascending (at index " +
                                  std::to_string(i) + ")");
    }
  }
  CodeBook book{};
  std::copy(codes.begin(), codes.end(), book.code);
  for (int i = 0; i + 1 < kCodes; ++i) {
    const double mid = (static_cast<double>(codes[i]) + codes[i + 1]) / 2;  // exact in double
    float t = static_cast<float>(mid);
    if (static_cast<double>(t) > mid) t = std::nextafter(t, -std::numeric_limits<float>::infinity());
    book.threshold[i] = t;
    book.tie_up[i] = static_cast<double>(t) == mid && codes[i + 1] <= 0.0f;
  }
  book.threshold[kCodes - 1] = std::numeric_limits<float>::infinity();

  // Each cell spans [lo, hi) in magnitude; with its sign it spans an interval of values whose lowest and
  // highest nearest codes must differ by at most one.
  const float huge =
      4.0f;  // stands for everything the top cell clamps: beyond ±1 every value takes an end code
  for (std::uint32_t cell = 0; cell < static_cast<std::uint32_t>(kLutSize); ++cell) {
    const std::uint32_t mantissa = cell & ((1u << kLutMantissaBits) - 1u);
    const std::uint32_t slot = cell >> kLutMantissaBits;
    const bool negative = slot >= static_cast<std::uint32_t>(kLutExponentSlots);
    const int exponent_slot = static_cast<int>(slot % kLutExponentSlots);
    float lo = 0.0f, hi_inclusive = 0.0f;
    if (exponent_slot == 0) {
      hi_inclusive = std::nextafter(std::ldexp(1.0f, kLutLowestExponent + 1 - 127), 0.0f);
    } else {
      const int e = kLutLowestExponent + exponent_slot - 127;
      lo = std::ldexp(1.0f + static_cast<float>(mantissa) / (1 << kLutMantissaBits), e);
      const float hi = std::ldexp(1.0f + static_cast<float>(mantissa + 1) / (1 << kLutMantissaBits), e);
      hi_inclusive = exponent_slot == kLutExponentSlots - 1 && mantissa == (1u << kLutMantissaBits) - 1u
                         ? huge
                         : std::nextafter(hi, 0.0f);
    }
    const float low_value = negative ? -hi_inclusive : lo;
    const float high_value = negative ? -lo : hi_inclusive;
    const int first = nearest(codes, low_value), last = nearest(codes, high_value);
    if (last - first > 1) {
      throw std::invalid_argument("make_code_book: codes too dense for the search table near " +
                                  std::to_string(low_value));
    }
    book.lut[cell] = static_cast<std::uint8_t>(first);
  }
  return book;
}

const CodeBook& signed_code_book() {
  static const CodeBook book = make_code_book(dynamic_codes(true));
  return book;
}

const CodeBook& unsigned_code_book() {
  static const CodeBook book = make_code_book(dynamic_codes(false));
  return book;
}

}  // namespace memsave::kernels
