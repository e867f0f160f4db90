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

/// The exact nearest of ascending codes, ties toward zero: the reference the tables are built from.
int nearest(const std::vector<float>& codes, float x) {
  if (std::isnan(x)) return -1;
  int best = 0;
  for (int i = 1; i < static_cast<int>(codes.size()); ++i) {
    // NOTE: x - code is exact in double whenever the two compete (they are then within a factor 2^29).
    const double d = std::fabs(static_cast<double>(x) - codes[i]);
    const double b = std::fabs(static_cast<double>(x) - codes[best]);
    if (d < b || (d == b && std::fabs(codes[i]) < std::fabs(codes[best]))) best = i;
  }
  return best;
}

}  // namespace

std::vector<float> dynamic_codes(bool is_signed, int bits) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("dynamic_codes: bits must be 4 or 8");
  static const double kDecade[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1e0};
  const int decades = bits - 1;  // one per exponent bit
  std::vector<float> values;
  for (int i = 0; i < decades; ++i) {
    const int points = is_signed ? (1 << i) + 1 : (1 << (i + 1)) + 1;
    const std::vector<float> bounds = linspace_tenth_to_one(points);
    const auto scale = static_cast<float>(kDecade[7 - decades + i]);
    for (int j = 0; j + 1 < points; ++j) {
      const float mean = (bounds[j] + bounds[j + 1]) / 2.0f;
      values.push_back(scale * mean);
      if (is_signed) values.push_back(-scale * mean);
    }
  }
  values.push_back(0.0f);
  values.push_back(1.0f);
  std::sort(values.begin(), values.end());
  return values;
}

std::vector<float> linear_codes_without_zero() {
  std::vector<float> codes(16);
  for (int k = 1; k <= 16; ++k) codes[k - 1] = static_cast<float>(k) / 16.0f;  // exact
  return codes;
}

CodeBook make_code_book(const std::vector<float>& codes) {
  const int count = static_cast<int>(codes.size());
  if (count != 16 && count != kCodes) {
    throw std::invalid_argument("make_code_book: a book holds 16 or 256 codes, got " + std::to_string(count));
  }
  for (int i = 0; i < count; ++i) {
    if (!std::isfinite(codes[i]) || (i > 0 && !(codes[i - 1] < codes[i]))) {
      throw std::invalid_argument("make_code_book: codes must be finite and strictly ascending (at index " +
                                  std::to_string(i) + ")");
    }
  }
  CodeBook book{};
  std::copy(codes.begin(), codes.end(), book.code);
  book.count = count;
  book.is_signed = codes[0] < 0.0f ? 1 : 0;
  if (book.is_signed) {
    const int zero = count / 2 - 1;
    bool symmetric = codes[zero] == 0.0f;
    for (int k = 1; k <= zero; ++k) symmetric = symmetric && codes[zero - k] == -codes[zero + k];
    if (!symmetric) {
      throw std::invalid_argument("make_code_book: a signed book must be symmetric around code " +
                                  std::to_string(zero) + " = 0");
    }
    book.mirror = 2 * zero;
  }

  // Each cell holds the magnitudes [lo, hi]; their nearest codes may differ by at most one.
  const float inf = std::numeric_limits<float>::infinity();
  for (std::uint32_t cell = 0; cell < static_cast<std::uint32_t>(kLutCells); ++cell) {
    const std::uint32_t mantissa = cell & ((1u << kLutMantissaBits) - 1u);
    const int slot = static_cast<int>(cell >> kLutMantissaBits);
    float lo = 0.0f, hi = 0.0f;
    if (slot == 0) {
      hi = std::nextafter(std::ldexp(1.0f, kLutLowestExponent + 1 - 127), 0.0f);
    } else {
      const int e = kLutLowestExponent + slot - 127;
      lo = std::ldexp(1.0f + static_cast<float>(mantissa) / (1 << kLutMantissaBits), e);
      const float end = std::ldexp(1.0f + static_cast<float>(mantissa + 1) / (1 << kLutMantissaBits), e);
      hi = slot == kLutExponentSlots - 1 && mantissa == (1u << kLutMantissaBits) - 1u
               ? 4.0f
               : std::nextafter(end, 0.0f);
    }
    const int first = nearest(codes, lo), last = nearest(codes, hi);
    std::uint32_t threshold = 0x10000u;  // no boundary in the cell
    if (last == first + 1) {
      // the smallest float in the cell whose nearest code is `last`
      const double mid = (static_cast<double>(codes[first]) + codes[last]) / 2;  // exact in double
      float below = static_cast<float>(mid);
      if (static_cast<double>(below) > mid) below = std::nextafter(below, -inf);
      const float up_from =
          static_cast<double>(below) == mid && codes[last] <= 0.0f ? below : std::nextafter(below, inf);
      if (slot == 0 || up_from < lo || up_from > hi) {
        throw std::invalid_argument("make_code_book: a code boundary falls outside its search cell");
      }
      threshold = to_bits(up_from) & 0xffffu;
    } else if (last != first) {
      throw std::invalid_argument("make_code_book: codes too dense for the search table near " +
                                  std::to_string(lo));
    }
    book.cell[cell] = (static_cast<std::uint32_t>(first) << 16) + (0x10000u - threshold);
  }
  return book;
}

std::vector<std::uint32_t> code_thresholds(const CodeBook& book) {
  // `quantize` of a non-negative magnitude never decreases with its bits: bisect for each step.
  const auto code_of = [&book](std::uint32_t bits) { return quantize(book, bits_to_float(bits)); };
  std::vector<std::uint32_t> thresholds;
  for (std::uint32_t code = code_of(0) + 1u; code <= code_of(0x7fffffffu); ++code) {
    std::uint32_t lo = 0, hi = 0x7fffffffu;  // code_of(hi) >= code
    while (lo < hi) {
      const std::uint32_t mid = lo + (hi - lo) / 2;
      if (code_of(mid) >= code) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    thresholds.push_back(lo);
  }
  return thresholds;
}

const CodeBook& signed_code_book(int bits) {
  static const CodeBook book8 = make_code_book(dynamic_codes(true, 8));
  static const CodeBook book4 = make_code_book(dynamic_codes(true, 4));
  return bits == 4 ? book4 : book8;
}

const CodeBook& unsigned_code_book(int bits) {
  static const CodeBook book8 = make_code_book(dynamic_codes(false, 8));
  static const CodeBook book4 = make_code_book(linear_codes_without_zero());
  return bits == 4 ? book4 : book8;
}

}  // namespace memsave::kernels
