// Projections over GGUF's packed blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), read in place: y[T, out] =
// x[T, in] @ W^T with W the file's own bytes, [out, in / 32 blocks] -- each output feature a
// row of consecutive 32-weight blocks along the input, so the kernel is a dot product per
// weight row (the transposed GEMV's shape), split over rows between XLA's pool workers.
//
// As llama.cpp's vec_dot does: x is quantized once per call to 8 bits per 32-block (a float
// scale d and the block's sum s = d * sum(q), Q8_1-style), so each weight block meets each x
// block in one integer dot product of 32 bytes (vpdpbusd on AVX512-VNNI, vpmaddubsw +
// vpmaddwd on AVX2), scaled once in float. The blocks are decoded in registers and never
// written out: a Q4_1 weight costs 5 bits of memory traffic instead of 32.
//
//   q8_0  34 B: f16 d, 32 x int8 q        w = d * q         dot = d dx (q . xq)
//   q4_0  18 B: f16 d, 16 B of nibbles    w = d (n - 8)     dot = d dx (n . xq) - 8 d sx
//   q4_1  20 B: f16 d, f16 m, nibbles     w = d n + m       dot = d dx (n . xq) + m sx
//   q4_K  144 B per 256 weights: f16 d, f16 dmin, 12 B of 6-bit scales sc_j and mins m_j of
//         8 sub-blocks of 32, 128 B of nibbles; w = d sc_j n - dmin m_j, so each sub-block
//         meets one x block as q4_1's blocks do: d sc_j dx (n . xq) - dmin m_j sx
// Nibbles: byte j holds weight j (low 4 bits) and weight j + 16 (high); in q4_K each 32
// bytes hold sub-block 2i (low nibbles, in order) and 2i + 1 (high nibbles).
//
// More than kMaxGemvRows rows (a prefill chunk) run as tiles of 8 rows over a part's weight
// rows, which stay in the core's caches between tiles. Header-only, like gemv.h.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <vector>

#include "gemv.h"   // JAXSERVE_UNROLL

namespace jaxserve_cpu {
namespace {

constexpr int kGgufBlock = 32;
enum GgufFormat : int {
  kGgufQ8_0 = 0, kGgufQ4_0 = 1, kGgufQ4_1 = 2, kGgufQ4_K = 3, kGgufQ5_K = 4, kGgufQ6_K = 5
};
constexpr int kGgufFormats = 6;

constexpr int64_t gguf_block_bytes(int fmt) {
  return fmt == kGgufQ8_0 ? 34 : fmt == kGgufQ4_0 ? 18 : fmt == kGgufQ4_1 ? 20
       : fmt == kGgufQ4_K ? 144 : fmt == kGgufQ5_K ? 176 : 210;
}
constexpr bool gguf_is_k_quant(int fmt) { return fmt >= kGgufQ4_K; }
// Weights per block: 32, or a K-quant's 256-weight super-block.
inline int64_t gguf_block_weights(int fmt) { return gguf_is_k_quant(fmt) ? 256 : kGgufBlock; }
// Bytes of one weight row of `in` weights (in a whole number of blocks).
inline int64_t gguf_row_bytes(int fmt, int64_t in) {
  return in / gguf_block_weights(fmt) * gguf_block_bytes(fmt);
}

// The instruction set this copy of the kernel was compiled for (the library is built for the
// CPU it runs on; tests build an AVX2-only copy too).
inline const char* gguf_isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {   // subnormal: normalise
      int e = -1;
      do { ++e; mant <<= 1; } while (!(mant & 0x400));
      bits = sign | (uint32_t(127 - 15 - e) << 23) | ((mant & 0x3ff) << 13);
    }
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// x [T, in] quantized per 32-block: q int8 [T, blocks, 32], d and s = d * sum(q) [T, blocks].
struct GgufX {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  int64_t blocks = 0;
};

inline void gguf_quantize_x(const float* X, int64_t T, int64_t in, GgufX* out) {
  const int64_t nb = in / kGgufBlock;
  out->blocks = nb;
  out->q.resize(size_t(T * nb * kGgufBlock));
  out->d.resize(size_t(T * nb));
  out->s.resize(size_t(T * nb));
  for (int64_t b = 0; b < T * nb; ++b) {
    const float* x = X + b * kGgufBlock;   // rows are whole blocks: [T, nb, 32] = [T * nb, 32]
    float amax = 0.f;
    for (int j = 0; j < kGgufBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    int8_t* q = out->q.data() + b * kGgufBlock;
    int sum = 0;
    for (int j = 0; j < kGgufBlock; ++j) {
      q[j] = int8_t(std::nearbyint(x[j] * inv));
      sum += q[j];
    }
    out->d[b] = d;
    out->s[b] = d * float(sum);
  }
}

#if defined(__AVX2__)
// The 32 weights of a block as bytes in order: Q8_0 signed, Q4_x unsigned nibbles 0..15.
template <int FMT>
inline __m256i gguf_block_bytes_of(const uint8_t* blk) {
  if (FMT == kGgufQ8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  const __m128i packed = _mm_loadu_si128(
      reinterpret_cast<const __m128i*>(blk + (FMT == kGgufQ4_1 ? 4 : 2)));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

// 8 int32 partial sums of u . s over 32 bytes, u unsigned (0..255), s signed.
inline __m256i gguf_dot_us(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline float gguf_hsum(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}
#endif

// Y[t, r] (row stride ldy) for weight rows [r0, r1) of W (bpr bytes a row) and T rows of x.
template <int T, int FMT>
void gguf_dot_rows(const uint8_t* W, int64_t bpr, const GgufX& xq, int64_t t0, float* Y,
                   int64_t ldy, int64_t r0, int64_t r1) {
  constexpr int64_t BPB = FMT == kGgufQ8_0 ? 34 : FMT == kGgufQ4_0 ? 18 : 20;
  const int64_t nb = xq.blocks;
  const int8_t* XQ = xq.q.data() + t0 * nb * kGgufBlock;
  const float* XD = xq.d.data() + t0 * nb;
  const float* XS = xq.s.data() + t0 * nb;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = W + r * bpr;
    float corr[T];
    JAXSERVE_UNROLL for (int t = 0; t < T; ++t) corr[t] = 0.f;
#if defined(__AVX2__)
    __m256 acc[T];
    JAXSERVE_UNROLL for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * BPB;
      const float d = f16_at(blk);
      const float c = FMT == kGgufQ4_1 ? f16_at(blk + 2) : -8.f * d;
      const __m256i w = gguf_block_bytes_of<FMT>(blk);
      // Q8_0's weights are signed: |w| against x carrying w's sign (llama.cpp's trick).
      const __m256i u = FMT == kGgufQ8_0 ? _mm256_sign_epi8(w, w) : w;
      JAXSERVE_UNROLL for (int t = 0; t < T; ++t) {
        const int64_t at = t * nb + b;
        __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(XQ + at * kGgufBlock));
        if (FMT == kGgufQ8_0) xv = _mm256_sign_epi8(xv, w);
        const __m256 p = _mm256_cvtepi32_ps(gguf_dot_us(u, xv));
        acc[t] = _mm256_fmadd_ps(p, _mm256_set1_ps(d * XD[at]), acc[t]);
        if (FMT != kGgufQ8_0) corr[t] += c * XS[at];
      }
    }
    JAXSERVE_UNROLL for (int t = 0; t < T; ++t) Y[t * ldy + r] = gguf_hsum(acc[t]) + corr[t];
#else
    float acc[T];
    for (int t = 0; t < T; ++t) acc[t] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * BPB;
      const float d = f16_at(blk);
      const float c = FMT == kGgufQ4_1 ? f16_at(blk + 2) : -8.f * d;
      int w[kGgufBlock];
      for (int j = 0; j < kGgufBlock; ++j) {
        if (FMT == kGgufQ8_0) {
          w[j] = int8_t(blk[2 + j]);
        } else {
          const uint8_t byte = blk[(FMT == kGgufQ4_1 ? 4 : 2) + (j & 15)];
          w[j] = j < 16 ? (byte & 0x0f) : (byte >> 4);
        }
      }
      for (int t = 0; t < T; ++t) {
        const int64_t at = t * nb + b;
        const int8_t* xb = XQ + at * kGgufBlock;
        int sum = 0;
        for (int j = 0; j < kGgufBlock; ++j) sum += w[j] * xb[j];
        acc[t] += float(sum) * (d * XD[at]);
        if (FMT != kGgufQ8_0) corr[t] += c * XS[at];
      }
    }
    for (int t = 0; t < T; ++t) Y[t * ldy + r] = acc[t] + corr[t];
#endif
  }
}

// Q4_K's sub-block j (0..7) scale and min, 6 bits each, from its 12 packed bytes (ggml's
// get_scale_min_k4).
inline void q4k_scale_min(const uint8_t* q, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

#if defined(__AVX2__)
// Sub-block j's 32 weights as bytes: Q4_K / Q5_K unsigned 0..15 / 0..31; Q6_K signed q - 32.
// qh: the super-block's 32 high-bit bytes (Q5_K), loaded once per super-block.
template <int FMT>
inline __m256i k_quant_weights(const uint8_t* blk, __m256i qh, int j) {
  const __m256i lo4 = _mm256_set1_epi8(0x0f);
  if (FMT == kGgufQ6_K) {
    const int h = j >> 2, s = (j >> 1) & 1, c = j & 1;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32 * c));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
    const __m256i low = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * s)), lo4);
    const __m256i high = _mm256_and_si256(
        _mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * (j & 3))), _mm256_set1_epi8(3));
    return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)),
                           _mm256_set1_epi8(32));
  }
  const uint8_t* qs = blk + (FMT == kGgufQ5_K ? 48 : 16) + 32 * (j / 2);
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
  __m256i w = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(bytes, 4) : bytes, lo4);
  if (FMT == kGgufQ5_K) {
    const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)),
                                         _mm256_set1_epi8(1));
    w = _mm256_or_si256(w, _mm256_slli_epi16(bit, 4));   // bit 0 -> bit 4, no carry across bytes
  }
  return w;
}
#endif

// Weight l (0..31) of sub-block j, scalar: Q4_K / Q5_K unsigned, Q6_K signed (q - 32).
template <int FMT>
inline int k_quant_weight(const uint8_t* blk, int j, int l) {
  if (FMT == kGgufQ6_K) {
    const int h = j >> 2, s = (j >> 1) & 1, c = j & 1;
    const int low = (blk[64 * h + 32 * c + l] >> (4 * s)) & 15;
    const int high = (blk[128 + 32 * h + l] >> (2 * (j & 3))) & 3;
    return (low | (high << 4)) - 32;
  }
  const uint8_t byte = blk[(FMT == kGgufQ5_K ? 48 : 16) + 32 * (j / 2) + l];
  int w = j & 1 ? byte >> 4 : byte & 0x0f;
  if (FMT == kGgufQ5_K) w |= ((blk[16 + l] >> j) & 1) << 4;
  return w;
}

// The K-quants (Q4_K, Q5_K, Q6_K): 256-weight super-blocks of 8 sub-blocks of 32, each
// sub-block meeting one 32-block of x.
template <int T, int FMT>
void gguf_dot_rows_k(const uint8_t* W, int64_t bpr, const GgufX& xq, int64_t t0, float* Y,
                     int64_t ldy, int64_t r0, int64_t r1) {
  constexpr int64_t BPB = gguf_block_bytes(FMT);
  const int64_t nb = xq.blocks, nsb = nb / 8;
  const int8_t* XQ = xq.q.data() + t0 * nb * kGgufBlock;
  const float* XD = xq.d.data() + t0 * nb;
  const float* XS = xq.s.data() + t0 * nb;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = W + r * bpr;
    float corr[T];
    JAXSERVE_UNROLL for (int t = 0; t < T; ++t) corr[t] = 0.f;
#if defined(__AVX2__)
    __m256 acc[T];
    JAXSERVE_UNROLL for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
#else
    float acc[T];
    for (int t = 0; t < T; ++t) acc[t] = 0.f;
#endif
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* blk = row + sb * BPB;
      const float d = f16_at(FMT == kGgufQ6_K ? blk + 208 : blk);
      const float dmin = FMT == kGgufQ6_K ? 0.f : f16_at(blk + 2);
#if defined(__AVX2__)
      const __m256i qh = FMT == kGgufQ5_K
          ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)) : _mm256_setzero_si256();
#endif
      for (int j = 0; j < 8; ++j) {
        float s0, s1, dm = 0.f;   // the scales of the sub-block's two halves, its min
        if (FMT == kGgufQ6_K) {
          s0 = d * float(int8_t(blk[192 + 2 * j]));
          s1 = d * float(int8_t(blk[193 + 2 * j]));
        } else {
          int sc, mn;
          q4k_scale_min(blk + 4, j, &sc, &mn);
          s0 = s1 = d * float(sc);
          dm = dmin * float(mn);
        }
        const int64_t b = sb * 8 + j;
#if defined(__AVX2__)
        __m256i w = k_quant_weights<FMT>(blk, qh, j);
        const __m256i sign = w;
        if (FMT == kGgufQ6_K) w = _mm256_sign_epi8(w, w);
        // lanes 0-3 sum bytes 0-15 (first half), lanes 4-7 bytes 16-31
        const __m256 halves = _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0));
        JAXSERVE_UNROLL for (int t = 0; t < T; ++t) {
          const int64_t at = t * nb + b;
          __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(XQ + at * kGgufBlock));
          if (FMT == kGgufQ6_K) xv = _mm256_sign_epi8(xv, sign);
          const __m256 p = _mm256_cvtepi32_ps(gguf_dot_us(w, xv));
          acc[t] = _mm256_fmadd_ps(p, _mm256_mul_ps(halves, _mm256_set1_ps(XD[at])), acc[t]);
          if (FMT != kGgufQ6_K) corr[t] -= dm * XS[at];
        }
#else
        int w[kGgufBlock];
        for (int l = 0; l < kGgufBlock; ++l) w[l] = k_quant_weight<FMT>(blk, j, l);
        for (int t = 0; t < T; ++t) {
          const int64_t at = t * nb + b;
          const int8_t* xb = XQ + at * kGgufBlock;
          int lo = 0, hi = 0;
          for (int l = 0; l < 16; ++l) lo += w[l] * xb[l];
          for (int l = 16; l < kGgufBlock; ++l) hi += w[l] * xb[l];
          acc[t] += (float(lo) * s0 + float(hi) * s1) * XD[at];
          if (FMT != kGgufQ6_K) corr[t] -= dm * XS[at];
        }
#endif
      }
    }
#if defined(__AVX2__)
    JAXSERVE_UNROLL for (int t = 0; t < T; ++t) Y[t * ldy + r] = gguf_hsum(acc[t]) + corr[t];
#else
    for (int t = 0; t < T; ++t) Y[t * ldy + r] = acc[t] + corr[t];
#endif
  }
}

// One weight's share of a pass: this layer's [out, bpr] blocks and its result [T, out].
struct GgufSegment {
  const uint8_t* w;
  float* y;
  int64_t out;
};

template <int T, int FMT>
void gguf_rows(const uint8_t* W, int64_t bpr, const GgufX& xq, int64_t t0, float* Y,
               int64_t ldy, int64_t r0, int64_t r1) {
  if (gguf_is_k_quant(FMT))
    gguf_dot_rows_k<T, FMT>(W, bpr, xq, t0, Y, ldy, r0, r1);
  else
    gguf_dot_rows<T, gguf_is_k_quant(FMT) ? kGgufQ4_1 : FMT>(W, bpr, xq, t0, Y, ldy, r0, r1);
}

template <int FMT>
void gguf_tile(const uint8_t* W, int64_t bpr, const GgufX& xq, int64_t t0, int64_t rows,
               float* Y, int64_t ldy, int64_t r0, int64_t r1) {
  float* y = Y + t0 * ldy;
  switch (rows) {
    case 1: gguf_rows<1, FMT>(W, bpr, xq, t0, y, ldy, r0, r1); break;
    case 2: gguf_rows<2, FMT>(W, bpr, xq, t0, y, ldy, r0, r1); break;
    case 3: gguf_rows<3, FMT>(W, bpr, xq, t0, y, ldy, r0, r1); break;
    case 4: gguf_rows<4, FMT>(W, bpr, xq, t0, y, ldy, r0, r1); break;
    case 5: gguf_rows<5, FMT>(W, bpr, xq, t0, y, ldy, r0, r1); break;
    case 6: gguf_rows<6, FMT>(W, bpr, xq, t0, y, ldy, r0, r1); break;
    case 7: gguf_rows<7, FMT>(W, bpr, xq, t0, y, ldy, r0, r1); break;
    default: gguf_rows<8, FMT>(W, bpr, xq, t0, y, ldy, r0, r1); break;
  }
}

// Part p of `parts` of all segments' rows laid end to end: rows [R p / parts, R (p+1) /
// parts), each run over every 8-row tile of x.
template <int FMT>
void gguf_part(const std::vector<GgufSegment>& segs, int64_t bpr, const GgufX& xq, int64_t T,
               int64_t total_rows, int64_t part, int64_t parts) {
  const int64_t a = total_rows * part / parts, b = total_rows * (part + 1) / parts;
  int64_t base = 0;
  for (const GgufSegment& g : segs) {
    const int64_t r0 = std::max(a, base) - base, r1 = std::min(b, base + g.out) - base;
    if (r0 < r1)
      for (int64_t t0 = 0; t0 < T; t0 += 8)
        gguf_tile<FMT>(g.w, bpr, xq, t0, std::min<int64_t>(8, T - t0), g.y, g.out, r0, r1);
    base += g.out;
  }
}

inline void gguf_run_part(int fmt, const std::vector<GgufSegment>& segs, int64_t bpr,
                          const GgufX& xq, int64_t T, int64_t total_rows, int64_t part,
                          int64_t parts) {
  if (fmt == kGgufQ8_0)
    gguf_part<kGgufQ8_0>(segs, bpr, xq, T, total_rows, part, parts);
  else if (fmt == kGgufQ4_0)
    gguf_part<kGgufQ4_0>(segs, bpr, xq, T, total_rows, part, parts);
  else if (fmt == kGgufQ4_1)
    gguf_part<kGgufQ4_1>(segs, bpr, xq, T, total_rows, part, parts);
  else if (fmt == kGgufQ4_K)
    gguf_part<kGgufQ4_K>(segs, bpr, xq, T, total_rows, part, parts);
  else if (fmt == kGgufQ5_K)
    gguf_part<kGgufQ5_K>(segs, bpr, xq, T, total_rows, part, parts);
  else
    gguf_part<kGgufQ6_K>(segs, bpr, xq, T, total_rows, part, parts);
}

// How many parts a pass over `rows` weight rows of `bytes` in all is cut into: about
// kGemvPartsPerWorker per worker at decode rows; at more rows of x, parts of at most ~64
// weight rows, so a part's blocks stay in cache across its 8-row tiles.
inline int64_t gguf_parts(int64_t workers, int64_t rows, int64_t T) {
  if (workers <= 1 && T <= 8) return 1;
  int64_t parts = std::max<int64_t>(1, workers * 4);
  if (T > 8) parts = std::max(parts, (rows + 63) / 64);
  return std::min(parts, rows);
}

}  // namespace
}  // namespace jaxserve_cpu
