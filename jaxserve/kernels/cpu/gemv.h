// The streaming GEMV of the CPU projections (matmul.cc): a few rows (T <= kMaxGemvRows: a
// decode of a few sequences), f32 accumulation over f32 / bf16 / int8 weights read once in
// memory order, split over the weights' rows between XLA's pool workers; and its transposed
// form for a tied LM head (a dot product per table row). matmul.cc's FFI handlers call it at
// the row counts the engine measured it faster than oneDNN (gemv_choice.py), and for int8
// weights with float x (W8A16: oneDNN takes int8 weights only with int8 x). Header-only, like
// parallel_for.h: the one .cc that includes it gets its own copy in an anonymous namespace.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <vector>

#include "bf16_bits.h"
#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace jaxserve_cpu {
namespace {

namespace ffi = xla::ffi;

// bf16 as its raw 16 bits: bf16_bits.h.
inline float bf16_to_f32(uint16_t h) { return bf16::to_f32(h); }
inline uint16_t f32_to_bf16(float f) { return bf16::from_f32(f); }

// ---------------------------------------------------------------------------
// GEMV: a few rows, the weights streamed once in memory order. A tile of T rows x NV native
// vectors of output columns lives in registers while it walks kGemvKBlock weight rows (that
// many sequential streams: what the hardware prefetchers follow), then is stored and
// reloaded for the next block. Workers split the weights' rows (gemv_rows_of).
// ---------------------------------------------------------------------------

constexpr int64_t kMaxGemvRows = 8;
constexpr int64_t kGemvKBlock = 8;
constexpr int64_t kGemvPartsPerWorker = 4;
#ifdef __AVX512F__
constexpr int kLanes = 16;         // one zmm register
constexpr int kGemvAccRegs = 16;   // accumulators per tile, of 32 registers
#else
constexpr int kLanes = 8;          // one ymm register (AVX2) or two xmm (SSE)
constexpr int kGemvAccRegs = 8;    // of AVX2's 16: the rest hold weights and x
#endif

// Register types (natural alignment) and unaligned memory views of them (loads and stores
// through these compile to single vmovups; a memcpy into an under-aligned vector type made
// g++ bounce every load through the stack: 1.7 GB/s instead of the memory's speed).
typedef float vf __attribute__((vector_size(kLanes * 4)));
typedef uint32_t vw __attribute__((vector_size(kLanes * 4)));
typedef int32_t vi __attribute__((vector_size(kLanes * 4)));
typedef float vfu __attribute__((vector_size(kLanes * 4), aligned(4), may_alias));
typedef uint16_t vhu __attribute__((vector_size(kLanes * 2), aligned(2), may_alias));
typedef int8_t vbu __attribute__((vector_size(kLanes), aligned(1), may_alias));
typedef uint32_t vwu __attribute__((vector_size(kLanes * 4), aligned(2), may_alias));

inline vf loadv(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline vf loadv(const uint16_t* p) {   // bf16: the top half of an f32
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#elif defined(__AVX2__)
  return reinterpret_cast<vf>(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#else
  return reinterpret_cast<vf>(__builtin_convertvector(*reinterpret_cast<const vhu*>(p), vw)
                              << 16);
#endif
}
inline vf loadv(const int8_t* p) {     // int8 weights (W8A16: the caller applies the scale)
  // g++ turns the generic conversion into scalar code (a third of the memory's speed): the
  // sign-extend and convert instructions by name where the target has them.
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  return reinterpret_cast<vf>(_mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  return __builtin_convertvector(__builtin_convertvector(*reinterpret_cast<const vbu*>(p), vi),
                                 vf);
#endif
}
inline void storev(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }

#define JAXSERVE_UNROLL _Pragma("GCC unroll 16")   // keeps acc[][] in registers (g++, clang++)

// Y[:, o0 .. o0 + NV * kLanes) += (or =, for the first block k0 == ka) X[:, k0:k1] @ W[k0:k1],
// times S[o0 ..] when S is given: the scales of the int8 weight group holding rows k0..k1.
template <int T, int NV, typename W>
void gemv_tile(const float* X, const W* Wt, float* Y, int64_t in, int64_t out, int64_t o0,
               int64_t k0, int64_t k1, bool first, const float* S = nullptr) {
  vf acc[T][NV];
  JAXSERVE_UNROLL for (int t = 0; t < T; ++t)
    JAXSERVE_UNROLL for (int n = 0; n < NV; ++n)
      acc[t][n] = first || S ? vf{} : loadv(Y + t * out + o0 + n * kLanes);
  for (int64_t i = k0; i < k1; ++i) {
    const W* w = Wt + i * out + o0;
    JAXSERVE_UNROLL for (int n = 0; n < NV; ++n) {
      const vf wv = loadv(w + n * kLanes);
      JAXSERVE_UNROLL for (int t = 0; t < T; ++t) acc[t][n] += X[t * in + i] * wv;
    }
  }
  if (S) {
    JAXSERVE_UNROLL for (int n = 0; n < NV; ++n) {
      const vf sv = loadv(S + o0 + n * kLanes);
      JAXSERVE_UNROLL for (int t = 0; t < T; ++t) {
        float* y = Y + t * out + o0 + n * kLanes;
        storev(y, (first ? vf{} : loadv(y)) + acc[t][n] * sv);
      }
    }
    return;
  }
  JAXSERVE_UNROLL for (int t = 0; t < T; ++t)
    JAXSERVE_UNROLL for (int n = 0; n < NV; ++n) storev(Y + t * out + o0 + n * kLanes, acc[t][n]);
}

inline float weight_at(const float* w, int64_t i) { return w[i]; }
inline float weight_at(const uint16_t* w, int64_t i) { return bf16_to_f32(w[i]); }
inline float weight_at(const int8_t* w, int64_t i) { return float(w[i]); }

template <int T>
constexpr int gemv_vectors() { return std::max(1, std::min(8, kGemvAccRegs / T)); }

// Y[T, out] = X[:, ka:kb] @ W[ka:kb, :]: the weight rows [ka, kb) read once, in memory order
// (kGemvKBlock rows at a time, each walked across every column: that many sequential streams).
// scale: int8 weights' group scales [in / group, out] (row i's group is i / group; a k-block
// never straddles two: group is a multiple of kGemvKBlock, or all of `in`), else nullptr.
template <int T, typename W>
void gemv_rows_range(const float* X, const W* Wt, float* Y, int64_t in, int64_t out, int64_t ka,
                     int64_t kb, const float* scale = nullptr, int64_t group = 0) {
  constexpr int NV = gemv_vectors<T>();
  const int64_t full = out / (NV * kLanes) * (NV * kLanes);
  const int64_t vec = full + (out - full) / kLanes * kLanes;
  for (int64_t k0 = ka; k0 < kb; k0 += kGemvKBlock) {
    const int64_t k1 = std::min<int64_t>(kb, k0 + kGemvKBlock);
    const float* S = scale ? scale + (k0 / group) * out : nullptr;
    for (int64_t o = 0; o < full; o += NV * kLanes)
      gemv_tile<T, NV>(X, Wt, Y, in, out, o, k0, k1, k0 == ka, S);
    for (int64_t o = full; o < vec; o += kLanes)
      gemv_tile<T, 1>(X, Wt, Y, in, out, o, k0, k1, k0 == ka, S);
  }
  for (int64_t o = vec; o < out; ++o)   // fewer than kLanes columns left (out % kLanes)
    for (int t = 0; t < T; ++t) {
      float a = 0.f;
      for (int64_t i = ka; i < kb; ++i)
        a += X[t * in + i] * weight_at(Wt, i * out + o) * (scale ? scale[(i / group) * out + o] : 1.f);
      Y[t * out + o] = a;
    }
}

// One projection's share of a GEMV pass: its weights (this layer's [in, out] block) and its
// output [T, out]. A pass may stream several projections of the same x (q/k/v, gate/up):
// one trip through the thread pool for all of them.
struct GemvSegment {
  const void* w;
  float* y;
  int64_t out;
  const float* scale = nullptr;   // int8 weights' group scales [in / group, out], or none
  int64_t group = 0;
};

// The pass, split over the weights' rows (split-K): part p reads rows [in * p / parts,
// in * (p + 1) / parts) of every segment -- whole rows, one contiguous slab each, so a
// decode projection of few columns (down_proj's 576: 2.3 KB rows) still streams at the
// memory's speed (split over columns, each worker read 256-byte pieces of every row: ~15
// GB/s against ~24 here) -- into partial sums of its own, which are then added in part
// order (the same sums whichever thread ran which part). More parts than workers, so a
// worker that starts late (a busy shared box) takes fewer of them.
template <int T, typename W>
void gemv_rows_of(ffi::ThreadPool& pool, const float* X, const std::vector<GemvSegment>& segs,
                  int64_t in) {
  int64_t cols = 0;
  for (const GemvSegment& g : segs) cols += g.out;
  const int64_t blocks = (in + kGemvKBlock - 1) / kGemvKBlock;
  const int64_t workers = streaming_workers(pool, in * cols * int64_t(sizeof(W)) / 4, blocks);
  const int64_t parts = workers <= 1 ? 1 : std::min<int64_t>(blocks, workers * kGemvPartsPerWorker);
  if (parts == 1) {
    for (const GemvSegment& g : segs)
      gemv_rows_range<T>(X, static_cast<const W*>(g.w), g.y, in, g.out, 0, in, g.scale, g.group);
    return;
  }
  thread_local std::vector<float> partial;   // [parts][T * cols], segments side by side
  partial.resize(size_t(parts * T * cols));
  float* base = partial.data();
  parallel_for(pool, parts, workers, [&](int64_t part, int64_t) {
    const int64_t ka = blocks * part / parts * kGemvKBlock;
    const int64_t kb = std::min(in, blocks * (part + 1) / parts * kGemvKBlock);
    float* y = base + part * T * cols;
    for (const GemvSegment& g : segs) {
      gemv_rows_range<T>(X, static_cast<const W*>(g.w), y, in, g.out, ka, kb, g.scale, g.group);
      y += T * g.out;
    }
  });
  int64_t at = 0;
  for (const GemvSegment& g : segs) {
    const int64_t n = T * g.out;
    for (int64_t i = 0; i < n; i += kLanes) {
      if (i + kLanes <= n) {
        vf sum = loadv(base + at + i);
        for (int64_t p = 1; p < parts; ++p) sum += loadv(base + p * T * cols + at + i);
        storev(g.y + i, sum);
      } else {
        for (int64_t j = i; j < n; ++j) {
          float sum = base[at + j];
          for (int64_t p = 1; p < parts; ++p) sum += base[p * T * cols + at + j];
          g.y[j] = sum;
        }
      }
    }
    at += n;
  }
}

template <typename W>
void gemv(ffi::ThreadPool& pool, const float* X, const std::vector<GemvSegment>& segs,
          int64_t T, int64_t in) {
  switch (T) {
    case 1: gemv_rows_of<1, W>(pool, X, segs, in); break;
    case 2: gemv_rows_of<2, W>(pool, X, segs, in); break;
    case 3: gemv_rows_of<3, W>(pool, X, segs, in); break;
    case 4: gemv_rows_of<4, W>(pool, X, segs, in); break;
    case 5: gemv_rows_of<5, W>(pool, X, segs, in); break;
    case 6: gemv_rows_of<6, W>(pool, X, segs, in); break;
    case 7: gemv_rows_of<7, W>(pool, X, segs, in); break;
    default: gemv_rows_of<8, W>(pool, X, segs, in); break;
  }
}

// The transposed GEMV: Y[T, V] = X[T, H] @ table[V, H]^T (a tied LM head: each logit a dot
// product of x with one table row). The table is read once, row after row -- one sequential
// stream (reading several rows in lockstep made that many short streams: 20-30 % slower) --
// split between workers in contiguous row ranges; U independent accumulators per x row keep
// the FMAs' latency hidden.
inline float lane_sum(vf v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

template <int T>
constexpr int dot_unroll() { return std::max(1, 8 / T); }

template <int T, typename W>
void dot_row(const float* X, const W* row, float* Y, int64_t H, int64_t V, int64_t v) {
  constexpr int U = dot_unroll<T>();
  vf acc[U][T];
  JAXSERVE_UNROLL for (int u = 0; u < U; ++u)
    JAXSERVE_UNROLL for (int t = 0; t < T; ++t) acc[u][t] = vf{};
  const int64_t step = U * kLanes, body = H / step * step, vec = H / kLanes * kLanes;
  for (int64_t h = 0; h < body; h += step)
    JAXSERVE_UNROLL for (int u = 0; u < U; ++u) {
      const vf wv = loadv(row + h + u * kLanes);
      JAXSERVE_UNROLL for (int t = 0; t < T; ++t) acc[u][t] += loadv(X + t * H + h + u * kLanes) * wv;
    }
  for (int64_t h = body; h < vec; h += kLanes) {
    const vf wv = loadv(row + h);
    JAXSERVE_UNROLL for (int t = 0; t < T; ++t) acc[0][t] += loadv(X + t * H + h) * wv;
  }
  JAXSERVE_UNROLL for (int t = 0; t < T; ++t) {
    vf total = acc[0][t];
    JAXSERVE_UNROLL for (int u = 1; u < U; ++u) total += acc[u][t];
    float sum = lane_sum(total);
    for (int64_t h = vec; h < H; ++h) sum += X[t * H + h] * weight_at(row, h);
    Y[t * V + v] = sum;
  }
}

// bf16 rows: 2 * kLanes weights per load, split into the even ones and the odd ones
// (bf16::split_even_odd: two integer ops, no widening shuffles). Xp is x with each
// 2 * kLanes chunk reordered to match: its even elements, then its odd ones (even_odd_chunks).
template <int T>
void dot_row(const float* Xp, const uint16_t* row, float* Y, int64_t H, int64_t V, int64_t v) {
  constexpr int U = std::max(1, dot_unroll<T>() / 2);
  vf acc[U][T];
  JAXSERVE_UNROLL for (int u = 0; u < U; ++u)
    JAXSERVE_UNROLL for (int t = 0; t < T; ++t) acc[u][t] = vf{};
  const int64_t chunk = 2 * kLanes, step = U * chunk;
  const int64_t body = H / step * step, pairs = H / chunk * chunk;
  auto fma_chunk = [&](int64_t h, vf* a) {
    vf we, wo;
    bf16::split_even_odd(vw(*reinterpret_cast<const vwu*>(row + h)), &we, &wo);
    JAXSERVE_UNROLL for (int t = 0; t < T; ++t)
      a[t] += loadv(Xp + t * H + h) * we + loadv(Xp + t * H + h + kLanes) * wo;
  };
  for (int64_t h = 0; h < body; h += step)
    JAXSERVE_UNROLL for (int u = 0; u < U; ++u) fma_chunk(h + u * chunk, acc[u]);
  for (int64_t h = body; h < pairs; h += chunk) fma_chunk(h, acc[0]);
  JAXSERVE_UNROLL for (int t = 0; t < T; ++t) {
    vf total = acc[0][t];
    JAXSERVE_UNROLL for (int u = 1; u < U; ++u) total += acc[u][t];
    float sum = lane_sum(total);
    for (int64_t h = pairs; h < H; ++h) sum += Xp[t * H + h] * bf16_to_f32(row[h]);
    Y[t * V + v] = sum;
  }
}

// x [T, H] reordered for the bf16 dot_rows: each whole 2 * kLanes chunk as its even then its
// odd elements.
void even_odd_chunks(const float* X, float* Xp, int64_t T, int64_t H) {
  const int64_t pairs = H / (2 * kLanes) * (2 * kLanes);
  for (int64_t t = 0; t < T; ++t) {
    const float* x = X + t * H;
    float* xp = Xp + t * H;
    for (int64_t h = 0; h < pairs; h += 2 * kLanes)
      for (int j = 0; j < kLanes; ++j) {
        xp[h + j] = x[h + 2 * j];
        xp[h + kLanes + j] = x[h + 2 * j + 1];
      }
    for (int64_t h = pairs; h < H; ++h) xp[h] = x[h];
  }
}

template <int T, typename W>
void transposed_gemv_rows_of(ffi::ThreadPool& pool, const float* X, const W* table, float* Y,
                             int64_t H, int64_t V) {
  const int64_t workers = streaming_workers(pool, V * H * int64_t(sizeof(W)) / 4, V);
  const int64_t parts = workers <= 1 ? 1 : std::min<int64_t>(V, workers * kGemvPartsPerWorker);
  parallel_for(pool, parts, workers, [&](int64_t part, int64_t) {
    for (int64_t v = V * part / parts; v < V * (part + 1) / parts; ++v)
      dot_row<T>(X, table + v * H, Y, H, V, v);
  });
}

template <typename W>
void transposed_gemv(ffi::ThreadPool& pool, const float* X, const W* table, float* Y, int64_t T,
                     int64_t H, int64_t V) {
  std::vector<float> reordered;
  if (std::is_same<W, uint16_t>::value) {
    reordered.resize(size_t(T * H));
    even_odd_chunks(X, reordered.data(), T, H);
    X = reordered.data();
  }
  switch (T) {
    case 1: transposed_gemv_rows_of<1>(pool, X, table, Y, H, V); break;
    case 2: transposed_gemv_rows_of<2>(pool, X, table, Y, H, V); break;
    case 3: transposed_gemv_rows_of<3>(pool, X, table, Y, H, V); break;
    case 4: transposed_gemv_rows_of<4>(pool, X, table, Y, H, V); break;
    case 5: transposed_gemv_rows_of<5>(pool, X, table, Y, H, V); break;
    case 6: transposed_gemv_rows_of<6>(pool, X, table, Y, H, V); break;
    case 7: transposed_gemv_rows_of<7>(pool, X, table, Y, H, V); break;
    default: transposed_gemv_rows_of<8>(pool, X, table, Y, H, V); break;
  }
}

}  // namespace
}  // namespace jaxserve_cpu
