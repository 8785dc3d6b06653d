// SIMD helpers of the CPU attention kernel (paged_attention.cc): GCC vector extensions
// (AVX-512, AVX or SSE, whatever -march gives) for W float lanes, the transposed sums,
// horizontal max / sum, exp and tanh; and, where the CPU has AVX512-BF16, bf16 pair dot
// products (dot_bf16).
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

#include "bf16_bits.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace jaxserve_cpu::simd {

#if defined(__AVX512F__)
constexpr int W = 16;
#elif defined(__AVX__)
constexpr int W = 8;
#else
constexpr int W = 4;
#endif

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));
typedef uint8_t vb __attribute__((vector_size(W)));     // W fp8 values

inline vf splat(float x) { return vf{} + x; }
inline vf loadu(const float* p) { vf v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void storeu(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline vf vselect(vi m, vf a, vf b) { return m ? a : b; }

template <int... I>
constexpr vi make_iota(std::integer_sequence<int, I...>) { return vi{I...}; }
constexpr vi kIota = make_iota(std::make_integer_sequence<int, W>{});

// Lane l of combine<G>: blocks of 2G lanes; the first G come from x, the next G from
// y; `hi` takes the upper G of each 2G-block of the source, `lo` the lower G.
constexpr int combine_lane(int G, bool hi, int l) {
  const int q = l / (2 * G), w = l % (2 * G);
  return (w < G ? 0 : W) + 2 * G * q + (w % G) + (hi ? G : 0);
}
// __builtin_shufflevector (GCC >= 12 and clang alike) takes its lanes as constant
// arguments: the pack expansions below spell them out.
template <int G, bool Hi, int... I>
inline vf combine_half(vf x, vf y, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(x, y, combine_lane(G, Hi, I)...);
}

template <int G>
inline vf combine(vf x, vf y) {
  constexpr auto lanes = std::make_integer_sequence<int, W>{};
  return combine_half<G, false>(x, y, lanes) + combine_half<G, true>(x, y, lanes);
}

// v[0..W): lane i of the result = sum of the lanes of v[i]. Overwrites v.
template <int G = 1>
inline vf transpose_sum(vf* v) {
  if constexpr (G >= W) {
    return v[0];
  } else {
    for (int i = 0; i < W / (2 * G); ++i) v[i] = combine<G>(v[2 * i], v[2 * i + 1]);
    return transpose_sum<2 * G>(v);
  }
}

template <int S, int... I>
inline vf rotate(vf v, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(v, v, ((I + S) % W)...);
}

template <int S = W / 2>
inline float hmax(vf v) {
  if constexpr (S == 0) {
    return v[0];
  } else {
    return hmax<S / 2>(vmax(v, rotate<S>(v, std::make_integer_sequence<int, W>{})));
  }
}

template <int S = W / 2>
inline float hsum(vf v) {
  if constexpr (S == 0) {
    return v[0];
  } else {
    return hsum<S / 2>(v + rotate<S>(v, std::make_integer_sequence<int, W>{}));
  }
}

// exp of each lane, as exp_f32 (lanes must not be NaN; -inf gives a tiny positive value,
// callers mask it to 0).
inline vf vexp(vf x) {
  x = vmax(x, splat(-87.0f));
  x = x < 88.0f ? x : splat(88.0f);
  const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const vf r = x - n * 0.693359375f - n * -2.12194440e-4f;
  const vf z = r * r;
  const vf y = (((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r +
                  4.1665795894e-2f) * r + 1.6666665459e-1f) * r + 5.0000001201e-1f) * z + r + 1.0f;
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  return y * (vf)(e);
}

inline vf vtanh(vf x) {
  const vi sign_bit = vi{} + int32_t(0x80000000u);
  const vi xb = (vi)(x);
  const vi ab = xb & ~sign_bit;
  const vf a = (vf)(ab);
  const vf s = x * x;
  const vf small = ((((-5.70498872745e-3f * s + 2.06390887954e-2f) * s - 5.37397155531e-2f) * s +
                     1.33314422036e-1f) * s - 3.33332819422e-1f) * s * x + x;
  const vf big_abs = 1.0f - 2.0f / (vexp(a + a) + 1.0f);
  const vi big_bits = (vi)(big_abs) | (xb & sign_bit);
  return vselect(a < 0.625f, small, (vf)(big_bits));
}

// bf16 K rows read in place: (a, b) bf16 pairs -> a f32 lane each, 2 products summed
// (VDPBF16PS). Products of bf16 values are exact in float32, so a dot product accumulates
// the same terms as converting both sides first. Needs 2W bf16 per call.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kBf16Dot = true;
inline vf dot_bf16(vf acc, const uint16_t* x, const uint16_t* y) {
  const __m512i a = _mm512_loadu_si512(x), b = _mm512_loadu_si512(y);
  return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)b);
}
#else
constexpr bool kBf16Dot = false;
inline vf dot_bf16(vf acc, const uint16_t*, const uint16_t*) { return acc; }  // never called
#endif

// 2W bf16 values at p (one vector of W little-endian pairs) as two f32 vectors: the
// even-indexed values and the odd-indexed ones (bf16_bits.h: a shift and a mask).
inline void load_bf16_even_odd(const uint16_t* p, vf* even, vf* odd) {
  vi pairs;
  std::memcpy(&pairs, p, sizeof(pairs));
  bf16::split_even_odd(pairs, even, odd);
}

}  // namespace jaxserve_cpu::simd
