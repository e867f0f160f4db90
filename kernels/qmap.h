// The 8-bit and 4-bit code books and the exact nearest-code search, shared by the CPU and CUDA kernels.
//
// A code book holds 256 (8-bit) or 16 (4-bit) sorted float values in [-1, 1]. A value x (already scaled by 1
// / its block's absmax, see block_scale) gets the code whose value is nearest to x in exact arithmetic. Ties
// (x exactly halfway between two codes) go to the code nearer zero. NaN and values beyond ±1 are clamped to
// the ends of the book: a block holding a NaN or an infinity has a non-finite absmax, so it dequantizes to
// non-finite values and the fault stays visible.
//
// The search is one table look-up and one integer addition. The magnitude's exponent and top 7 mantissa
// bits index a table (one cell per 1/128 of a binade); each entry holds the lowest code any magnitude in its
// cell rounds to and, when the cell holds the boundary to the next code, the low 16 mantissa bits of the
// smallest magnitude that rounds up (the exact midpoint with its tie rule), encoded so that adding the
// magnitude's own low 16 bits carries into the code exactly when it rounds up. Negative values use the mirror
// image: a signed book is symmetric around 0 (code 127 of 256, 7 of 16) but for its final 1.0, and an
// unsigned book takes them to its lowest code.
#pragma once

#include "dtypes.h"
#include "host_device.h"

#include <cstdint>
#include <vector>

namespace memsave::kernels {

/// The most codes a book holds (8 bits).
inline constexpr int kCodes = 256;
inline constexpr int kLutMantissaBits = 7;
/// Exponent slots: slot 0 holds every |x| < 2^-25 (nearer zero than to any code of the books used here; its
/// cells are all alike, and smaller magnitudes use its first), slots 1..26 the binades [2^-25, 2^-24) ... [1,
/// 2), the last one also everything larger, infinities and NaN.
inline constexpr int kLutLowestExponent = 101;  // biased exponent of slot 0
inline constexpr int kLutExponentSlots = 27;
inline constexpr int kLutCells = kLutExponentSlots << kLutMantissaBits;
/// The cell index is the magnitude's bits above its low 16 (exponent and top 7 mantissa bits), less this.
inline constexpr std::int32_t kLutFirstCell = kLutLowestExponent << kLutMantissaBits;
/// Magnitudes above this (2 and beyond, infinities, NaN) are searched as this one: the top cell's end.
inline constexpr std::uint32_t kLutTopMagnitude =
    (static_cast<std::uint32_t>(kLutLowestExponent + kLutExponentSlots - 1) << 23) | 0x7fffffu;
static_assert(23 - kLutMantissaBits == 16, "a cell is a magnitude's bits above its low 16");

struct CodeBook {
  float code[kCodes];  ///< ascending; the first `count` are the book
  /// Per cell: (lowest code << 16) + (0x10000 - t), where t is the low 16 bits of the smallest magnitude in
  /// the cell that rounds to the next code, or 0x10000 when every magnitude of the cell rounds to the lowest.
  /// A magnitude's code is then (entry + its low 16 bits) >> 16.
  std::uint32_t cell[kLutCells];
  std::int32_t count;      ///< 256 (8-bit codes) or 16 (4-bit codes)
  std::int32_t is_signed;  ///< 1: symmetric signed book; 0: unsigned book (all codes >= 0)
  /// Signed books: twice the index of the code 0 (254 of 256, 14 of 16), so code[mirror - i] == -code[i].
  std::int32_t mirror;
};

/// The exact nearest code of x (see the file comment for ties, NaN and range).
MEMSAVE_HD std::uint8_t quantize(const CodeBook& book, float x) {
  const std::uint32_t bits = to_bits(x);
  std::uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > kLutTopMagnitude) magnitude = kLutTopMagnitude;
  const std::int32_t cell = static_cast<std::int32_t>(magnitude >> 16) - kLutFirstCell;  // < 0: slot 0
  const std::uint32_t up = (book.cell[cell < 0 ? 0 : cell] + (magnitude & 0xffffu)) >> 16;
  // A negative value takes the mirror code (beyond the lowest: the lowest), or 0 in an unsigned book.
  // Selected without branches: signs are random in a block, and a mispredicted branch costs more than the
  // search.
  const std::uint32_t mirror = static_cast<std::uint32_t>(book.mirror);
  const std::uint32_t mirrored = book.is_signed != 0 && up <= mirror ? mirror - up : 0u;
  return static_cast<std::uint8_t>((bits >> 31) == 0u ? up : mirrored);
}

MEMSAVE_HD float dequantize(const CodeBook& book, std::uint8_t code) { return book.code[code]; }

/// What a block's values are multiplied by before `quantize`: 1 / absmax, or 1 for an all-zero block (and for
/// a NaN absmax, whose block dequantizes to NaN whatever its codes).
MEMSAVE_HD float block_scale(float absmax) { return absmax > 0.0f ? 1.0f / absmax : 1.0f; }

/// The dynamic-exponent code books of the 8-bit optimizers paper (Dettmers et al., 2022), bit for bit as
/// bitsandbytes' and torchao's create_dynamic_map build them in float32 with bits - 1 exponent bits: for each
/// decade 10^-(bits-2) ... 10^0, the midpoints of evenly spaced points on [0.1, 1] scaled by the decade, then
/// 0 and 1. 2^bits values, bits 4 or 8.
/// 8-bit signed: 127 negative values, 0, 127 positive values and 1 (range [-0.99296875, 1]).
/// 8-bit unsigned: 0, 254 positive values from 3.25e-7, and 1.
/// 4-bit signed: 7 negative values, 0, 7 positive values from 0.0055, and 1 (range [-0.8875, 1]).
std::vector<float> dynamic_codes(bool is_signed, int bits = 8);

/// k / 16 for k = 1 ... 16: the 4-bit optimizers' book for the second moment (Li et al., 2023; torchao's
/// AdamW4bit), linear and without 0, so that no small second moment dequantizes to 0 and blows up an update.
std::vector<float> linear_codes_without_zero();

/// Builds the search table for 256 or 16 ascending values: a signed book (0 at index count / 2 - 1, values
/// symmetric around it, then a final one) or an unsigned one (all values >= 0). Throws
/// std::invalid_argument for anything else, or values too dense for a one-comparison search.
CodeBook make_code_book(const std::vector<float>& codes);

/// The magnitudes at which a book's code steps up, as IEEE bit patterns, ascending: a magnitude whose bits
/// are u (0 <= u <= 0x7fffffff, NaN included) gets the code quantize(book, 0) + (number of thresholds <= u),
/// the same as `quantize` gives it. `count - 1 - quantize(book, 0)` thresholds (8 and 15 for the 4-bit
/// books).
std::vector<std::uint32_t> code_thresholds(const CodeBook& book);

/// The books the optimizers use, built once: for the first moment (signed, dynamic) and for the second
/// (unsigned: dynamic for 8 bits, linear without 0 for 4), of `bits` 8 or 4.
const CodeBook& signed_code_book(int bits = 8);
const CodeBook& unsigned_code_book(int bits = 8);

/// Bytes holding the codes of n elements: 4-bit codes go two to a byte, element 2i in the high nibble and
/// 2i + 1 in the low one (torchao's layout); an odd last element leaves the low nibble 0.
MEMSAVE_HD std::int64_t code_bytes(std::int64_t n, int bits) { return bits == 4 ? (n + 1) / 2 : n; }

/// Elements per quantization block (one absmax each): a power of two in [kMinBlock, kMaxBlock].
inline constexpr std::int64_t kMinBlock = 64;
inline constexpr std::int64_t kMaxBlock = 4096;

/// Version of the code books and block layout, recorded in saved optimizer state.
inline constexpr std::int64_t kCodeBookVersion = 1;

}  // namespace memsave::kernels
