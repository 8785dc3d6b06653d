// Cache and query element types of the CPU attention kernels (paged_attention.cc,
// write_kv.cc): bf16 / f16 / float8 e4m3fn bits, their bit-exact conversions to and from
// float32 (rounding to nearest even, as XLA), the int8 / fp8 cache's scale codes, and the
// byte size of each FFI dtype the kernels take.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "bf16_bits.h"
#include "xla/ffi/api/ffi.h"

namespace jaxserve_cpu::elements {

struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };
struct f8e4m3_t { uint8_t bits; };   // float8 e4m3fn (no inf; 0x7f / 0xff are NaN)

inline float bits_to_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t f32_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float to_f32(float x) { return x; }
inline float to_f32(bf16_t x) { return bf16::to_f32(x.bits); }
inline float to_f32(f16_t x) {
  const uint32_t h = x.bits;
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in f32
    const float v = float(mant) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  if (exp == 31) return bits_to_f32(sign | 0x7f800000u | (mant << 13));
  return bits_to_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline float to_f32(int8_t x) { return float(x); }

// e4m3fn -> f32 through a 256-entry table at namespace scope (1 KiB, stays in L1; a
// function-local static would pay its init guard per element): sign, 4-bit exponent with
// bias 7, 3-bit mantissa; exponent 0 is subnormal, m * 2^-9; 0x7f / 0xff are NaN (never
// stored: write_kv saturates at +-448).
struct F8Table {
  float v[256];
  F8Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      float x = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
      if (e == 15 && m == 7) x = std::numeric_limits<float>::quiet_NaN();
      v[b] = (b & 128) ? -x : x;
    }
  }
};
const F8Table kF8Table;
inline float to_f32(f8e4m3_t x) { return kF8Table.v[x.bits]; }

// Scale codes of a quantized cache (jaxserve/quantization/kv.py): scale = 2^(code / 8).
struct ScaleTable {
  float v[256];
  ScaleTable() { for (int c = -128; c < 128; ++c) v[c + 128] = std::exp2(c / 8.0f); }
};
const ScaleTable kScaleTable;   // namespace scope: no per-call static-init guard
inline float decode_scale(int8_t code) { return kScaleTable.v[int(code) + 128]; }

template <typename T> T from_f32(float f);
template <> inline float from_f32<float>(float f) { return f; }
template <> inline bf16_t from_f32<bf16_t>(float f) { return {bf16::from_f32(f)}; }
template <> inline f16_t from_f32<f16_t>(float f) {
  uint32_t u = f32_to_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return {uint16_t(sign | 0x7e00u)};   // NaN
  if (u >= 0x477ff000u) return {uint16_t(sign | 0x7c00u)};  // >= 65520 rounds to inf
  if (u < 0x38800000u) {                                     // below 2^-14: subnormal / 0
    const float scaled = bits_to_f32(u) * 16777216.0f;        // exact: * 2^24
    return {uint16_t(sign | uint32_t(std::nearbyint(scaled)))};
  }
  u += 0xfffu + ((u >> 13) & 1u);
  return {uint16_t(sign | ((u - (112u << 23)) >> 13))};
}

// Bytes per element of the dtypes the kernels take; 0 for any other.
inline size_t dtype_size(xla::ffi::DataType t) {
  switch (t) {
    case xla::ffi::DataType::F32: return 4;
    case xla::ffi::DataType::BF16:
    case xla::ffi::DataType::F16: return 2;
    case xla::ffi::DataType::S8:
    case xla::ffi::DataType::F8E4M3FN: return 1;   // quantized caches only, never q
    default: return 0;
  }
}

}  // namespace jaxserve_cpu::elements
