// The CPU kernels' bodies, compiled once per instruction set (optim_cpu_*.cpp) and chosen at run time.
// NOTE: include only from those files, with MEMSAVE_CPU_ISA naming the namespace.
#pragma once

#include "optim_cpu.h"
#include "qmap.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace memsave::kernels::MEMSAVE_CPU_ISA {

/// The largest magnitudes of the moments an update wrote, as magnitude_bits.
struct MomentMax {
  std::uint32_t m = 0;
  std::uint32_t v = 0;
};

template <Rule R, bool kMax>
void update_half(Float16* param, const Float16* grad, float* m, float* v, std::int64_t n, StepScalars k,
                 float scale, MomentMax& largest, std::int64_t first);

/// update_run's loop. kStochastic: bf16 parameters rounded stochastically (store_param's rule without its
/// branch per element), element i with keyed_rounding_bits(key, low + i): the bits of the tensor's element
/// whose index has the low 32 bits low + i and the upper ones that `key` (rounding_key) was made from.
template <typename T, Rule R, bool kMax, bool kStochastic>
inline void update_loop(T* __restrict param, const T* __restrict grad, float* __restrict m,
                        float* __restrict v, std::int64_t n, const StepScalars k, float scale,
                        MomentMax& largest, std::uint32_t key, std::uint32_t low) {
  float unused_v = 0;
  std::uint32_t max_m = largest.m, max_v = largest.v;
  // (index: a 32-bit induction variable of its own, which AVX2 vectorizes without narrowing 64-bit lanes)
  std::uint32_t index = low;
  for (std::int64_t i = 0; i < n; ++i, ++index) {
    float p = to_float(param[i]);
    float mi = m[i];
    float& vi = has_second_moment(R) ? v[i] : unused_v;
    update<R>(p, to_float(grad[i]) * scale, mi, vi, k);
    if constexpr (kStochastic) {
      param[i] = from_float_stochastic(p, keyed_rounding_bits(key, index));
    } else {
      param[i] = from_float<T>(p);
    }
    m[i] = mi;
    if constexpr (kMax) {
      max_m = std::max(max_m, magnitude_bits(mi));
      if constexpr (has_second_moment(R)) max_v = std::max(max_v, magnitude_bits(vi));
    }
  }
  if constexpr (kMax) largest = {max_m, max_v};
}

/// The update of n elements, the first of them element `first` of its tensor: parameters and gradients of
/// storage type T, moments in floats (v unused by rules without a second moment). With kMax, also the largest
/// magnitude of the new moments, in the same pass.
template <typename T, Rule R, bool kMax = false>
inline void update_run(T* __restrict param, const T* __restrict grad, float* __restrict m,
                       float* __restrict v, std::int64_t n, const StepScalars k, float scale,
                       MomentMax& largest, std::int64_t first) {
#if defined(__AVX2__) || defined(__AVX512F__)
  if constexpr (std::is_same_v<T, Float16>) {
    update_half<R, kMax>(param, grad, m, v, n, k, scale, largest, first);
    return;
  }
#endif
  if constexpr (std::is_same_v<T, BFloat16>) {
    if (k.stochastic_round != 0) {
      // in pieces whose indices share their upper 32 bits (one piece but in tensors of over 2^32 elements)
      for (std::int64_t done = 0; done < n;) {
        const std::int64_t at = first + done;
        const std::int64_t count = std::min(n - done, ((at >> 32) + 1) * (std::int64_t{1} << 32) - at);
        update_loop<T, R, kMax, true>(param + done, grad + done, m + done,
                                      has_second_moment(R) ? v + done : nullptr, count, k, scale, largest,
                                      rounding_key(k.round_seed, at), static_cast<std::uint32_t>(at));
        done += count;
      }
      return;
    }
  }
  update_loop<T, R, kMax, false>(param, grad, m, v, n, k, scale, largest, 0, 0);
}

/// n half-precision values -> floats: dtypes.h's to_float, but for a signaling NaN, which F16C makes quiet.
/// NOTE: that cannot show in a step: every rule's first operation on a parameter or gradient is arithmetic,
/// which quiets it too (StepKernels.HalfAndBFloat16StorageStepsAsItsFloatValues steps signaling NaNs).
inline void widen(const Float16* __restrict in, float* __restrict out, std::int64_t n) {
  std::int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i))));
  }
#elif defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  }
#endif
  for (; i < n; ++i) out[i] = to_float(in[i]);
}

/// n floats -> half precision, exactly as dtypes.h's from_float (F16C's conversion rounding to nearest even,
/// with each NaN written as from_float writes it: its sign and 0x7e00).
inline void narrow(const float* __restrict in, Float16* __restrict out, std::int64_t n) {
  std::int64_t i = 0;
#if defined(__AVX512F__)
  const __m512i sign = _mm512_set1_epi32(0x8000), quiet_nan = _mm512_set1_epi32(0x7e00);
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(in + i);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i exact_nan =
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 16), sign), quiet_nan);
    const __m256i half = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm256_mask_blend_epi16(nan, half, _mm512_cvtepi32_epi16(exact_nan)));
  }
#elif defined(__AVX2__)
  const __m256i sign = _mm256_set1_epi32(0x8000), quiet_nan = _mm256_set1_epi32(0x7e00);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(in + i);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i exact_nan =
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 16), sign), quiet_nan);
    const __m128i half = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(nan), _mm256_extracti128_si256(nan, 1));
    const __m128i exact16 =
        _mm_packus_epi32(_mm256_castsi256_si128(exact_nan), _mm256_extracti128_si256(exact_nan, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm_blendv_epi8(half, exact16, nan16));
  }
#endif
  for (; i < n; ++i) out[i] = from_float<Float16>(in[i]);
}

/// Half-precision storage where the instruction set converts it (F16C): the compiler vectorizes dtypes.h's
/// conversions of bf16 but not those of fp16, so the values go through float buffers converted as above.
template <Rule R, bool kMax>
void update_half(Float16* param, const Float16* grad, float* m, float* v, std::int64_t n, StepScalars k,
                 float scale, MomentMax& largest, std::int64_t first) {
  constexpr std::int64_t kChunk = 256;
  alignas(64) float p[kChunk];
  alignas(64) float g[kChunk];
  for (std::int64_t begin = 0; begin < n; begin += kChunk) {
    const std::int64_t count = std::min(kChunk, n - begin);
    widen(param + begin, p, count);
    widen(grad + begin, g, count);
    update_run<float, R, kMax>(p, g, m + begin, has_second_moment(R) ? v + begin : nullptr, count, k, scale,
                               largest, first + begin);
    narrow(p, param + begin, count);
  }
}

template <typename T, Rule R>
void step32_range(const Step32& s, std::int64_t begin, std::int64_t end) {
  MomentMax unused;
  update_run<T, R>(static_cast<T*>(s.param) + begin, static_cast<const T*>(s.grad) + begin, s.m + begin,
                   has_second_moment(R) ? s.v + begin : nullptr, end - begin, s.scalars, s.grad_scale, unused,
                   begin);
}

#if defined(__AVX512VBMI__)
/// The order of 64 codes that the byte interleave of dequantize_run puts back in place: it works within
/// 128-bit lanes, so byte 16L + 4q + j (lane L) must hold code 16q + 4L + j.
struct InterleaveOrder {
  std::uint8_t byte[64];
};
constexpr InterleaveOrder interleave_order() {
  InterleaveOrder order{};
  for (int lane = 0; lane < 4; ++lane) {
    for (int q = 0; q < 4; ++q) {
      for (int j = 0; j < 4; ++j) {
        order.byte[16 * lane + 4 * q + j] = static_cast<std::uint8_t>(16 * q + 4 * lane + j);
      }
    }
  }
  return order;
}
inline constexpr InterleaveOrder kInterleaveOrder = interleave_order();
#endif

/// codes -> values * absmax for n codes.
inline void dequantize_run(const VectorBook& vb, const std::uint8_t* __restrict codes, float absmax,
                           float* __restrict out, std::int64_t n) {
  const CodeBook& book = *vb.book;
  std::int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 scale = _mm512_set1_ps(absmax);
#if defined(__AVX512VBMI__)
  if (book.count == kCodes) {
    // Each byte of the 256 values is looked up from its plane (four registers: two 128-byte permutes and a
    // blend on the code's top bit), 64 codes at a time; interleaving the four byte vectors gives the floats
    // (the codes are first put in the order the interleave undoes).
    __m512i plane[4][4];
    for (int k = 0; k < 4; ++k) {
      for (int r = 0; r < 4; ++r) plane[k][r] = _mm512_load_si512(vb.plane[k] + 64 * r);
    }
    const __m512i interleave_order = _mm512_loadu_si512(kInterleaveOrder.byte);
    for (; i + 64 <= n; i += 64) {
      const __m512i index = _mm512_permutexvar_epi8(interleave_order, _mm512_loadu_si512(codes + i));
      const __mmask64 upper = _mm512_movepi8_mask(index);
      __m512i byte[4];
      for (int k = 0; k < 4; ++k) {
        byte[k] = _mm512_mask_blend_epi8(upper, _mm512_permutex2var_epi8(plane[k][0], index, plane[k][1]),
                                         _mm512_permutex2var_epi8(plane[k][2], index, plane[k][3]));
      }
      const __m512i low01 = _mm512_unpacklo_epi8(byte[0], byte[1]),
                    high01 = _mm512_unpackhi_epi8(byte[0], byte[1]);
      const __m512i low23 = _mm512_unpacklo_epi8(byte[2], byte[3]),
                    high23 = _mm512_unpackhi_epi8(byte[2], byte[3]);
      const __m512i value[4] = {_mm512_unpacklo_epi16(low01, low23), _mm512_unpackhi_epi16(low01, low23),
                                _mm512_unpacklo_epi16(high01, high23), _mm512_unpackhi_epi16(high01, high23)};
      for (int q = 0; q < 4; ++q) {
        _mm512_storeu_ps(out + i + 16 * q, _mm512_mul_ps(_mm512_castsi512_ps(value[q]), scale));
      }
    }
  }
#endif
  if (book.count == 16) {  // the whole book in one register: a permute instead of a gather
    const __m512 table = _mm512_loadu_ps(book.code);
    for (; i + 16 <= n; i += 16) {
      const __m512i index =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
      _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_permutexvar_ps(index, table), scale));
    }
  }
  {  // scalar loads: faster than a gather where measured (bench/RESULTS-optim.md)
    const float* c = book.code;
    for (; i + 16 <= n; i += 16) {
      const std::uint8_t* b = codes + i;
      const __m512 value =
          _mm512_setr_ps(c[b[0]], c[b[1]], c[b[2]], c[b[3]], c[b[4]], c[b[5]], c[b[6]], c[b[7]], c[b[8]],
                         c[b[9]], c[b[10]], c[b[11]], c[b[12]], c[b[13]], c[b[14]], c[b[15]]);
      _mm512_storeu_ps(out + i, _mm512_mul_ps(value, scale));
    }
  }
#elif defined(__AVX2__)
  const __m256 scale = _mm256_set1_ps(absmax);
  if (book.count == 16) {  // the book in two registers: two permutes and a blend on bit 3 of the code
    const __m256 low = _mm256_loadu_ps(book.code), high = _mm256_loadu_ps(book.code + 8);
    for (; i + 8 <= n; i += 8) {
      const __m256i index =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
      const __m256 upper = _mm256_castsi256_ps(_mm256_slli_epi32(index, 28));  // sign bit: bit 3 of the code
      const __m256 value = _mm256_blendv_ps(_mm256_permutevar8x32_ps(low, index),
                                            _mm256_permutevar8x32_ps(high, index), upper);
      _mm256_storeu_ps(out + i, _mm256_mul_ps(value, scale));
    }
  }
  {  // scalar loads: faster than a gather where measured (bench/RESULTS-optim.md)
    const float* c = book.code;
    for (; i + 8 <= n; i += 8) {
      const std::uint8_t* b = codes + i;
      const __m256 value =
          _mm256_setr_ps(c[b[0]], c[b[1]], c[b[2]], c[b[3]], c[b[4]], c[b[5]], c[b[6]], c[b[7]]);
      _mm256_storeu_ps(out + i, _mm256_mul_ps(value, scale));
    }
  }
#endif
  for (; i < n; ++i) out[i] = dequantize(book, codes[i]) * absmax;
}

/// values * scale -> nearest codes for n values: `quantize` of qmap.h, lane by lane.
inline void quantize_run(const VectorBook& vb, const float* __restrict values, float scale,
                         std::uint8_t* __restrict codes, std::int64_t n) {
  const CodeBook& book = *vb.book;
  std::int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 factor = _mm512_set1_ps(scale);
  const __m512i magnitude_bits = _mm512_set1_epi32(0x7fffffff), low_bits = _mm512_set1_epi32(0xffff);
  const __m512i top = _mm512_set1_epi32(static_cast<int>(kLutTopMagnitude));
  const __m512i first = _mm512_set1_epi32(kLutFirstCell), zero = _mm512_setzero_si512();
  const __m512i mirror = _mm512_set1_epi32(book.mirror);
  // The sign, as `quantize` applies it to the code `up` of the magnitude.
  const auto signed_code = [&](__m512i up, __m512i bits) {
    const __mmask16 negative = _mm512_movepi32_mask(bits);
    return book.is_signed ? _mm512_mask_max_epi32(up, negative, _mm512_sub_epi32(mirror, up), zero)
                          : _mm512_maskz_mov_epi32(static_cast<__mmask16>(~negative), up);
  };
  if (book.count == 16) {
    // A binary search over the (at most 15) magnitudes where the code steps up, held in one register.
    const __m512i step_up = _mm512_load_si512(vb.step_up),
                  lowest = _mm512_set1_epi32(static_cast<int>(vb.lowest));
    for (; i + 16 <= n; i += 16) {
      const __m512i bits = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(values + i), factor));
      const __m512i magnitude = _mm512_and_si512(bits, magnitude_bits);
      __m512i steps = zero;  // thresholds <= magnitude found so far
      for (int half = 8; half >= 1; half /= 2) {
        const __m512i next = _mm512_add_epi32(steps, _mm512_set1_epi32(half));
        const __m512i threshold =
            _mm512_permutexvar_epi32(_mm512_sub_epi32(next, _mm512_set1_epi32(1)), step_up);
        steps = _mm512_mask_mov_epi32(steps, _mm512_cmpge_epu32_mask(magnitude, threshold), next);
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i),
                       _mm512_cvtepi32_epi8(signed_code(_mm512_add_epi32(lowest, steps), bits)));
    }
  }
  // A 16-lane gather from the cell table: unlike AVX2's 8-lane one, it beat scalar loads on the 2^24-element
  // step (bench/RESULTS-optim.md), though not on values in cache.
  const int* table = reinterpret_cast<const int*>(book.cell);
  for (; i + 16 <= n; i += 16) {
    const __m512i bits = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(values + i), factor));
    const __m512i magnitude = _mm512_min_epu32(_mm512_and_si512(bits, magnitude_bits), top);
    const __m512i cell = _mm512_max_epi32(_mm512_sub_epi32(_mm512_srli_epi32(magnitude, 16), first), zero);
    const __m512i entry = _mm512_i32gather_epi32(cell, table, 4);
    const __m512i up = _mm512_srli_epi32(_mm512_add_epi32(entry, _mm512_and_si512(magnitude, low_bits)), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(signed_code(up, bits)));
  }
#elif defined(__AVX2__)
  const __m256 factor = _mm256_set1_ps(scale);
  const __m256i magnitude_bits = _mm256_set1_epi32(0x7fffffff), low_bits = _mm256_set1_epi32(0xffff);
  const __m256i top = _mm256_set1_epi32(static_cast<int>(kLutTopMagnitude));
  const __m256i first = _mm256_set1_epi32(kLutFirstCell), zero = _mm256_setzero_si256();
  const __m256i mirror = _mm256_set1_epi32(book.mirror);
  // The table's cells in vector code, its entries by scalar loads, the codes in vector code, 256 values at a
  // time (the 8-lane gather was slower, and so was assembling each vector's entries from scalar loads with
  // inserts: bench/RESULTS-optim.md).
  const auto magnitude_of = [&](std::int64_t at, __m256i& bits) {
    bits = _mm256_castps_si256(_mm256_mul_ps(_mm256_loadu_ps(values + at), factor));
    return _mm256_min_epu32(_mm256_and_si256(bits, magnitude_bits), top);
  };
  constexpr std::int64_t kChunk = 256;
  alignas(32) std::uint32_t entry[kChunk];
  while (i + 8 <= n) {
    const std::int64_t count = std::min(kChunk, (n - i) / 8 * 8);
    for (std::int64_t j = 0; j < count; j += 8) {
      __m256i bits;
      const __m256i magnitude = magnitude_of(i + j, bits);
      _mm256_store_si256(reinterpret_cast<__m256i*>(entry + j),
                         _mm256_max_epi32(_mm256_sub_epi32(_mm256_srli_epi32(magnitude, 16), first), zero));
    }
    for (std::int64_t j = 0; j < count; ++j) entry[j] = book.cell[entry[j]];
    for (std::int64_t j = 0; j < count; j += 8) {
      __m256i bits;
      const __m256i magnitude = magnitude_of(i + j, bits);
      const __m256i cell_entry = _mm256_load_si256(reinterpret_cast<const __m256i*>(entry + j));
      __m256i code =
          _mm256_srli_epi32(_mm256_add_epi32(cell_entry, _mm256_and_si256(magnitude, low_bits)), 16);
      const __m256i negative = _mm256_srai_epi32(bits, 31);
      const __m256i mirrored = book.is_signed ? _mm256_max_epi32(_mm256_sub_epi32(mirror, code), zero) : zero;
      code = _mm256_blendv_epi8(code, mirrored, negative);
      const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i + j), _mm_packus_epi16(words, words));
    }
    i += count;
  }
#endif
  for (; i < n; ++i) codes[i] = quantize(book, values[i] * scale);
}

/// The largest magnitude of n values; NaN when any is NaN (magnitude_bits).
inline float absmax_run(const float* __restrict values, std::int64_t n) {
  std::uint32_t largest = 0;
  for (std::int64_t i = 0; i < n; ++i) largest = std::max(largest, magnitude_bits(values[i]));
  return bits_to_float(largest);
}

/// 4-bit codes of n elements (qmap.h's packing) -> one code per byte.
inline void unpack_codes(const std::uint8_t* __restrict packed, std::uint8_t* __restrict codes,
                         std::int64_t n) {
  for (std::int64_t j = 0; j < n / 2; ++j) {
    codes[2 * j] = static_cast<std::uint8_t>(packed[j] >> 4);
    codes[2 * j + 1] = static_cast<std::uint8_t>(packed[j] & 0xfu);
  }
  if (n % 2 != 0) codes[n - 1] = static_cast<std::uint8_t>(packed[n / 2] >> 4);
}

/// One code per byte -> 4-bit codes of n elements, two to a byte.
inline void pack_codes(const std::uint8_t* __restrict codes, std::uint8_t* __restrict packed,
                       std::int64_t n) {
  for (std::int64_t j = 0; j < n / 2; ++j) {
    packed[j] = static_cast<std::uint8_t>((codes[2 * j] << 4) | codes[2 * j + 1]);
  }
  if (n % 2 != 0) packed[n / 2] = static_cast<std::uint8_t>(codes[n - 1] << 4);
}

/// A block's codes (starting at element `offset`, a multiple of the block size) -> values * absmax.
template <int Bits>
inline void dequantize_block(const VectorBook& book, const std::uint8_t* codes, std::int64_t offset,
                             float absmax, float* __restrict out, std::int64_t n,
                             std::uint8_t* __restrict scratch) {
  if constexpr (Bits == 4) {
    unpack_codes(codes + offset / 2, scratch, n);
    dequantize_run(book, scratch, absmax, out, n);
  } else {
    dequantize_run(book, codes + offset, absmax, out, n);
  }
}

/// A block's values * scale -> its nearest codes.
template <int Bits>
inline void quantize_block(const VectorBook& book, const float* __restrict values, float scale,
                           std::uint8_t* codes, std::int64_t offset, std::int64_t n,
                           std::uint8_t* __restrict scratch) {
  if constexpr (Bits == 4) {
    quantize_run(book, values, scale, scratch, n);
    pack_codes(scratch, codes + offset / 2, n);
  } else {
    quantize_run(book, values, scale, codes + offset, n);
  }
}

/// The work space of one thread: a block's moments in float and its codes one to a byte.
struct BlockScratch {
  alignas(64) float m[kMaxBlock];
  alignas(64) float v[kMaxBlock];
  alignas(64) std::uint8_t codes[kMaxBlock];
};

/// One block: dequantize, update, new block absmax, requantize; the block's floats stay in L1.
template <typename T, Rule R, int Bits>
inline void step_quantized_block(const StepQuantized& s, std::int64_t block, const VectorBook& sb,
                                 const VectorBook& ub, BlockScratch& w) {
  constexpr bool kSecond = has_second_moment(R);
  const std::int64_t offset = block * s.block_size;
  const std::int64_t n = std::min(s.block_size, s.numel - offset);
  T* __restrict param = static_cast<T*>(s.param) + offset;
  const T* __restrict grad = static_cast<const T*>(s.grad) + offset;
  const StepScalars k = s.scalars;
  const float scale = s.grad_scale;
  float* __restrict m = w.m;
  float* __restrict v = w.v;

  dequantize_block<Bits>(sb, s.m, offset, s.absmax_m[block], m, n, w.codes);
  if constexpr (kSecond) dequantize_block<Bits>(ub, s.v, offset, s.absmax_v[block], v, n, w.codes);
  MomentMax largest;
  update_run<T, R, true>(param, grad, m, kSecond ? v : nullptr, n, k, scale, largest, offset);
  const float max_m = bits_to_float(largest.m);
  s.absmax_m[block] = max_m;
  quantize_block<Bits>(sb, m, block_scale(max_m), s.m, offset, n, w.codes);
  if constexpr (kSecond) {
    const float max_v = bits_to_float(largest.v);
    s.absmax_v[block] = max_v;
    quantize_block<Bits>(ub, v, block_scale(max_v), s.v, offset, n, w.codes);
  }
}

template <typename T, Rule R>
void step_quantized_range(const StepQuantized& s, std::int64_t block_begin, std::int64_t block_end) {
  BlockScratch scratch;
  const VectorBook& sb = vector_book(true, s.bits);
  const VectorBook& ub = vector_book(false, s.bits);
  if (s.bits == 4) {
    for (std::int64_t b = block_begin; b < block_end; ++b)
      step_quantized_block<T, R, 4>(s, b, sb, ub, scratch);
  } else {
    for (std::int64_t b = block_begin; b < block_end; ++b)
      step_quantized_block<T, R, 8>(s, b, sb, ub, scratch);
  }
}

template <template <typename, Rule> class Kernel, typename T, typename Step>
void dispatch_rule(const Step& s, std::int64_t begin, std::int64_t end) {
  switch (s.rule) {
    case Rule::kAdam:
      return Kernel<T, Rule::kAdam>::run(s, begin, end);
    case Rule::kAdamW:
      return Kernel<T, Rule::kAdamW>::run(s, begin, end);
    case Rule::kLion:
      return Kernel<T, Rule::kLion>::run(s, begin, end);
    case Rule::kSgd:
      return Kernel<T, Rule::kSgd>::run(s, begin, end);
  }
}

template <typename T, Rule R>
struct Step32Kernel {
  static void run(const Step32& s, std::int64_t begin, std::int64_t end) {
    step32_range<T, R>(s, begin, end);
  }
};

template <typename T, Rule R>
struct StepQuantizedKernel {
  static void run(const StepQuantized& s, std::int64_t begin, std::int64_t end) {
    step_quantized_range<T, R>(s, begin, end);
  }
};

/// Calls Kernel<T, R>::run for the storage type and rule: the one list of instantiations.
template <template <typename, Rule> class Kernel, typename Step>
void dispatch(const Step& s, std::int64_t begin, std::int64_t end) {
  switch (s.dtype) {
    case DType::kFloat32:
      return dispatch_rule<Kernel, float>(s, begin, end);
    case DType::kBFloat16:
      return dispatch_rule<Kernel, BFloat16>(s, begin, end);
    case DType::kFloat16:
      return dispatch_rule<Kernel, Float16>(s, begin, end);
  }
}

void step32(const Step32& s, std::int64_t begin, std::int64_t end) { dispatch<Step32Kernel>(s, begin, end); }
void step_quantized(const StepQuantized& s, std::int64_t begin, std::int64_t end) {
  dispatch<StepQuantizedKernel>(s, begin, end);
}
void quantize(const VectorBook& book, const float* values, float scale, std::uint8_t* codes, std::int64_t n) {
  quantize_run(book, values, scale, codes, n);
}
void dequantize(const VectorBook& book, const std::uint8_t* codes, float absmax, float* out, std::int64_t n) {
  dequantize_run(book, codes, absmax, out, n);
}
void dequantize_blocks(const VectorBook& book, int bits, const std::uint8_t* codes, const float* absmax,
                       std::int64_t n, std::int64_t block_size, float* out, std::int64_t block_begin,
                       std::int64_t block_end) {
  alignas(64) std::uint8_t scratch[kMaxBlock];
  for (std::int64_t b = block_begin; b < block_end; ++b) {
    const std::int64_t offset = b * block_size;
    const std::int64_t count = std::min(block_size, n - offset);
    if (bits == 4) {
      dequantize_block<4>(book, codes, offset, absmax[b], out + offset, count, scratch);
    } else {
      dequantize_block<8>(book, codes, offset, absmax[b], out + offset, count, scratch);
    }
  }
}
void quantize_blocks(const VectorBook& book, int bits, const float* values, std::int64_t n,
                     std::int64_t block_size, std::uint8_t* codes, float* absmax, std::int64_t block_begin,
                     std::int64_t block_end) {
  alignas(64) std::uint8_t scratch[kMaxBlock];
  for (std::int64_t b = block_begin; b < block_end; ++b) {
    const std::int64_t offset = b * block_size;
    const std::int64_t count = std::min(block_size, n - offset);
    absmax[b] = absmax_run(values + offset, count);
    const float scale = block_scale(absmax[b]);
    if (bits == 4) {
      quantize_block<4>(book, values + offset, scale, codes, offset, count, scratch);
    } else {
      quantize_block<8>(book, values + offset, scale, codes, offset, count, scratch);
    }
  }
}

}  // namespace memsave::kernels::MEMSAVE_CPU_ISA
