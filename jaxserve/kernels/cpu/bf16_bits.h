// bfloat16 as its raw 16 bits (the top half of a float32), shared by every CPU kernel
// library (the projections' GEMV, gemv.h; the paged attention, attention/cpu/): the scalar
// conversions, and the even / odd split a kernel uses to read bf16 pairs in place.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace jaxserve_cpu::bf16 {

inline float to_f32(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t from_f32(float f) {   // round to nearest even; NaN stays a (quiet) NaN
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

// A vector of 32-bit lanes, each a little-endian pair of bf16 values (a, b), as two float
// vectors: the even-indexed values (a, the low halves shifted up) and the odd-indexed ones
// (b, the high halves masked) -- two integer ops where widening each half takes a shuffle
// (one shuffle unit on AVX2 Zen). VI: the integer vector type, VF: the float one, of the
// same size (GCC vector extensions).
template <typename VF, typename VI>
inline void split_even_odd(VI pairs, VF* even, VF* odd) {
  using Lane = std::remove_cv_t<std::remove_reference_t<decltype(pairs[0])>>;
  const VI high = VI{} + static_cast<Lane>(0xffff0000u);
  *even = reinterpret_cast<VF>(pairs << 16);
  *odd = reinterpret_cast<VF>(pairs & high);
}

}  // namespace jaxserve_cpu::bf16
