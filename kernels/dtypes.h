// Storage types of parameters and gradients, and their exact conversions to and from float (round to nearest
// even, or for bf16 stochastically), the same on the host and on the device.
#pragma once

#include "host_device.h"

#include <cstdint>
#include <cstring>

namespace memsave::kernels {

enum class DType : std::int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct BFloat16 {
  std::uint16_t bits;
};
struct Float16 {
  std::uint16_t bits;
};

MEMSAVE_HD float bits_to_float(std::uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
#endif
}

MEMSAVE_HD std::uint32_t to_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
#endif
}

/// |x| as IEEE bits: they order non-negative floats as numbers and put NaN above infinity, so the largest of
/// them is an exact, order-free absmax (NaN when any value is NaN).
MEMSAVE_HD std::uint32_t magnitude_bits(float x) { return to_bits(x) & 0x7fffffffu; }

MEMSAVE_HD float to_float(float x) { return x; }
MEMSAVE_HD float to_float(BFloat16 x) { return bits_to_float(static_cast<std::uint32_t>(x.bits) << 16); }

MEMSAVE_HD float to_float(Float16 x) {
  const std::uint32_t sign = static_cast<std::uint32_t>(x.bits & 0x8000u) << 16;
  const std::uint32_t exponent = (x.bits >> 10) & 0x1fu;
  const std::uint32_t mantissa = x.bits & 0x3ffu;
  if (exponent == 0x1fu) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // zero and subnormals: mantissa * 2^-24, exact in float
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
  return bits_to_float(sign | to_bits(magnitude));
}

template <typename T>
MEMSAVE_HD T from_float(float x);

template <>
MEMSAVE_HD float from_float<float>(float x) {
  return x;
}

/// The bf16 NaN of a float NaN's bits: its sign and upper payload, quieted.
MEMSAVE_HD BFloat16 bf16_nan(std::uint32_t bits) {
  return BFloat16{static_cast<std::uint16_t>((bits >> 16) | 0x40u)};
}

template <>
MEMSAVE_HD BFloat16 from_float<BFloat16>(float x) {
  const std::uint32_t bits = to_bits(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return bf16_nan(bits);
  const std::uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return BFloat16{static_cast<std::uint16_t>((bits + rounding) >> 16)};
}

template <>
MEMSAVE_HD Float16 from_float<Float16>(float x) {
  const std::uint32_t bits = to_bits(x);
  const std::uint16_t sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return Float16{static_cast<std::uint16_t>(sign | 0x7e00u)};   // NaN
  if (magnitude >= 0x477ff000u) return Float16{static_cast<std::uint16_t>(sign | 0x7c00u)};  // rounds to inf
  if (magnitude < 0x38800000u) {
    // subnormal or zero in half: round magnitude * 2^24 to an integer, ties to even (exact in float
    // arithmetic)
    const float scaled = bits_to_float(magnitude) * 16777216.0f;
    const float floor_value = static_cast<float>(static_cast<std::uint32_t>(scaled));
    const float rest = scaled - floor_value;
    std::uint32_t m = static_cast<std::uint32_t>(floor_value);
    m += (rest > 0.5f || (rest == 0.5f && (m & 1u))) ? 1u : 0u;
    return Float16{static_cast<std::uint16_t>(sign | m)};
  }
  const std::uint32_t rounding = 0xfffu + ((magnitude >> 13) & 1u);
  return Float16{static_cast<std::uint16_t>(sign | ((magnitude - 0x38000000u + rounding) >> 13))};
}

/// MurmurHash3's 32-bit finalizer (Appleby): a bijection of 32-bit words in which every input bit flips each
/// output bit with probability close to 1/2.
MEMSAVE_HD std::uint32_t mix32(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x85ebca6bu;
  x ^= x >> 13;
  x *= 0xc2b2ae35u;
  x ^= x >> 16;
  return x;
}

/// What rounding_bits takes of `seed` and of the upper 32 bits of `index`: the same for every index of a run
/// of 2^32 (a loop computes it once).
MEMSAVE_HD std::uint32_t rounding_key(std::uint32_t seed, std::int64_t index) {
  return mix32(seed ^ static_cast<std::uint32_t>(static_cast<std::uint64_t>(index) >> 32));
}

/// rounding_bits of the index whose lower 32 bits are `low` and whose upper ones made `key` (rounding_key).
MEMSAVE_HD std::uint32_t keyed_rounding_bits(std::uint32_t key, std::uint32_t low) {
  return mix32(low ^ key);
}

/// The random bits of element `index` in a stochastic rounding keyed by `seed`: a hash of the two, not a
/// generator's state, so they do not depend on which thread or device rounds the element, or in what order.
MEMSAVE_HD std::uint32_t rounding_bits(std::uint32_t seed, std::int64_t index) {
  return keyed_rounding_bits(rounding_key(seed, index),
                             static_cast<std::uint32_t>(static_cast<std::uint64_t>(index)));
}

/// x rounded to bfloat16 stochastically: to the neighbour of larger magnitude with probability (the 16 bits
/// that bf16 drops) / 2^16, else to the one of smaller magnitude, so the expected result is x. `random`'s low
/// 16 bits decide. A value beyond the largest finite bf16 may round to infinity, as it may to nearest; NaN
/// and infinity convert as from_float<BFloat16> converts them (infinity has no low bits to carry, so the sum
/// below leaves it as it is; a NaN's could carry into its sign or leave it infinity).
MEMSAVE_HD BFloat16 from_float_stochastic(float x, std::uint32_t random) {
  const std::uint32_t bits = to_bits(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return bf16_nan(bits);
  return BFloat16{static_cast<std::uint16_t>((bits + (random & 0xffffu)) >> 16)};
}

}  // namespace memsave::kernels
