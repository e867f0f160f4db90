// The 8-bit code books and the exact nearest-code search, shared by the CPU and CUDA kernels.
//
// A code book holds 256 sorted float values in [-1, 1]. A value x (already divided by its block's absmax)
// gets the code whose value is nearest to x in exact arithmetic. Ties (x exactly halfway between two codes)
// go to the code nearer zero. NaN and values beyond ±1 are clamped to the ends of the book: a block holding a
// NaN or an infinity has a non-finite absmax, so it dequantizes to non-finite values and the fault stays
// visible.
//
// The search is one table look-up and one comparison: the float's sign, exponent and top 7 mantissa bits
// index a table that gives the lowest code any value in that cell can round to; the book is built so that
// every cell needs at most one step further up, decided against the exact midpoint to the next code.
#pragma once

#include "host_device.h"

#include <array>
#include <cstdint>
#include <cstring>

namespace memsave::kernels {

inline constexpr int kCodes = 256;
inline constexpr int kLutMantissaBits = 7;
/// Exponent slots: slot 0 holds every |x| < 2^-25 (nearer zero than to any code of the books used here),
/// slots 1..26 the binades [2^-25, 2^-24) ... [1, 2), the last one also everything larger, infinities and
/// NaN.
inline constexpr int kLutLowestExponent = 101;  // biased exponent of slot 0
inline constexpr int kLutExponentSlots = 27;
inline constexpr int kLutSize = 2 * kLutExponentSlots << kLutMantissaBits;

struct CodeBook {
  float code[kCodes];           ///< ascending
  float threshold[kCodes];      ///< [i]: the largest float not above the midpoint of code[i] and code[i+1];
                                ///< [255]: +inf
  std::uint8_t tie_up[kCodes];  ///< [i]: 1 when that midpoint is a float and its tie goes to code[i+1]
  std::uint8_t lut[kLutSize];   ///< lowest code of each cell of (sign, exponent slot, top mantissa bits)
  std::uint8_t padding[3];      ///< lets vector code read lut and tie_up as 32-bit words at any byte offset
};

MEMSAVE_HD std::uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
#endif
}

/// The table cell of x.
MEMSAVE_HD std::uint32_t lut_cell(float x) {
  const std::uint32_t bits = float_bits(x);
  const std::uint32_t sign = bits >> 31;
  std::int32_t exponent = static_cast<std::int32_t>((bits >> 23) & 0xffu);
  std::uint32_t mantissa = (bits >> (23 - kLutMantissaBits)) & ((1u << kLutMantissaBits) - 1u);
  const std::int32_t top = kLutLowestExponent + kLutExponentSlots - 1;
  mantissa = exponent > top ? (1u << kLutMantissaBits) - 1u : mantissa;
  exponent = exponent < kLutLowestExponent ? kLutLowestExponent : (exponent > top ? top : exponent);
  const std::uint32_t slot =
      sign * kLutExponentSlots + static_cast<std::uint32_t>(exponent - kLutLowestExponent);
  return (slot << kLutMantissaBits) | mantissa;
}

/// The exact nearest code of x (see the file comment for ties, NaN and range).
MEMSAVE_HD std::uint8_t quantize(const CodeBook& book, float x) {
  const std::uint32_t low = book.lut[lut_cell(x)];
  const float t = book.threshold[low];
  const std::uint32_t up =
      static_cast<std::uint32_t>(x > t) | (static_cast<std::uint32_t>(x == t) & book.tie_up[low]);
  return static_cast<std::uint8_t>(low + up);
}

MEMSAVE_HD float dequantize(const CodeBook& book, std::uint8_t code) { return book.code[code]; }

/// The dynamic-exponent code books of the 8-bit optimizers paper (Dettmers et al., 2022), bit for bit as
/// bitsandbytes' create_dynamic_map builds them in float32: for each decade 10^-6 ... 10^0, the midpoints of
/// evenly spaced points on [0.1, 1] scaled by the decade, then 0 and 1.
/// Signed: 127 negative values, 0, 127 positive values and 1 (range [-0.99296875, 1]).
/// Unsigned: 0, 254 positive values from 3.25e-7, and 1.
std::array<float, kCodes> dynamic_codes(bool is_signed);

/// Builds the search tables for 256 ascending values. Throws std::invalid_argument when the values are not
/// strictly ascending, not finite, or too dense for a one-comparison search.
CodeBook make_code_book(const std::array<float, kCodes>& codes);

/// The two books the optimizers use, built once.
const CodeBook& signed_code_book();
const CodeBook& unsigned_code_book();

/// Elements per quantization block (one absmax each): a power of two in [kMinBlock, kMaxBlock].
inline constexpr std::int64_t kMinBlock = 64;
inline constexpr std::int64_t kMaxBlock = 4096;

/// Version of the code books and block layout, recorded in saved optimizer state.
inline constexpr std::int64_t kCodeBookVersion = 1;

}  // namespace memsave::kernels
