// Projections for the XLA CPU backend, on a maintained library (oneDNN's matmul primitive):
//
//   y[T, out] = x[T, in] @ w[layer]    x f32 or bf16; w the stacked [L, in, out] weights of
//                                      every layer (f32 or bf16), read in place; y f32 or
//                                      bf16; layer an int32 scalar clamped to [0, L).
//   transposed_w: w is [L, out, in] (a tied embedding table: logits = x @ table^T).
//
// Why in place: the decoder scans its layers over weights stacked [L, in, out]; XLA:CPU hands
// each dot a dynamic slice of them, and that slice is a copy of every layer's weights in every
// step, so a step's cost would grow with the model's whole weight bytes rather than with
// what it reads. The call reads w[layer] through a strided oneDNN memory descriptor instead.
//
// Which code: oneDNN picks its kernel from the CPU's features at run time (AMX-BF16 tiles,
// AVX512-BF16 dot products, plain AVX-512 / AVX2 with bf16 converted to f32, a reference
// loop elsewhere): the same binary on Intel and AMD. Accumulation is f32 in every case.
//
// Threads: the output columns are cut into one contiguous range per worker of XLA's intra-op
// pool (parallel_for.h); each worker runs oneDNN on its range single-threaded (its OpenMP
// team is set to 1 in that thread), so no OpenMP pool spins beside XLA's.
//
// The one kernel of our own, a streaming GEMV for a few rows (T <= kMaxGemvRows: a decode of
// a few sequences), f32 accumulation over f32 / bf16 / int8 weights read once in memory
// order, split over the weights' rows between workers. It serves int8 weights with float x
// (W8A16: oneDNN takes int8 weights only with int8 x) and float weights up to the row count
// the engine measured it faster than oneDNN on this CPU (gemv_rows; gemv_choice.py). A second
// handler (JaxserveMatmulGroup) streams several projections of one x in one call.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "dnnl.hpp"
#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

extern "C" void omp_set_num_threads(int);   // libgomp, which libdnnl links

namespace ffi = xla::ffi;

namespace {

using jaxserve_cpu::dims_str;
using jaxserve_cpu::parallel_for;
using jaxserve_cpu::streaming_workers;

// ---------------------------------------------------------------------------
// Element types: f32, and bf16 as its raw 16 bits (the top half of an f32).
// ---------------------------------------------------------------------------

inline float bf16_to_f32(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {   // round to nearest even (NaN stays NaN)
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

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

// bf16 rows: 2 * kLanes weights per load, split into the even ones (the low halves of each
// 32-bit lane, shifted up) and the odd ones (the high halves, masked): two plain integer ops
// where widening each half takes a shuffle (one shuffle unit on AVX2 Zen). Xp is x with each
// 2 * kLanes chunk reordered to match: its even elements, then its odd ones (even_odd_chunks).
template <int T>
void dot_row(const float* Xp, const uint16_t* row, float* Y, int64_t H, int64_t V, int64_t v) {
  constexpr int U = std::max(1, dot_unroll<T>() / 2);
  vf acc[U][T];
  JAXSERVE_UNROLL for (int u = 0; u < U; ++u)
    JAXSERVE_UNROLL for (int t = 0; t < T; ++t) acc[u][t] = vf{};
  const int64_t chunk = 2 * kLanes, step = U * chunk;
  const int64_t body = H / step * step, pairs = H / chunk * chunk;
  const vw high = vw{} + 0xffff0000u;
  auto fma_chunk = [&](int64_t h, vf* a) {
    const vw w = *reinterpret_cast<const vwu*>(row + h);
    const vf we = reinterpret_cast<vf>(w << 16), wo = reinterpret_cast<vf>(w & high);
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

// ---------------------------------------------------------------------------
// oneDNN: one matmul primitive per (shape, strides, dtypes), built once and kept.
// ---------------------------------------------------------------------------

using dt = dnnl::memory::data_type;

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

struct Key {
  int64_t rows, in, cols, ldw, ldy;
  bool transposed;
  dt x, w, y;
  bool operator<(const Key& o) const {
    return std::tie(rows, in, cols, ldw, ldy, transposed, x, w, y) <
           std::tie(o.rows, o.in, o.cols, o.ldw, o.ldy, o.transposed, o.x, o.w, o.y);
  }
};

struct Prim {
  dnnl::matmul matmul;
  dnnl::memory::desc x_md, w_md, y_md, scratch_md;
};

// Primitives are built under the lock and then only executed (with a caller-owned
// scratchpad, so two threads may run one primitive at once).
const Prim& primitive(const Key& k) {
  static std::mutex mu;
  static std::map<Key, Prim> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(k);
  if (it != cache.end()) return it->second;
  using md = dnnl::memory::desc;
  md x_md({k.rows, k.in}, k.x, {k.in, 1});
  md w_md = k.transposed ? md({k.in, k.cols}, k.w, {1, k.ldw}) : md({k.in, k.cols}, k.w, {k.ldw, 1});
  md y_md({k.rows, k.cols}, k.y, {k.ldy, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  dnnl::matmul::primitive_desc pd(cpu_engine(), x_md, w_md, y_md, attr);
  return cache.emplace(k, Prim{dnnl::matmul(pd), x_md, w_md, y_md, pd.scratchpad_desc()})
      .first->second;
}

void run_onednn(const Key& k, const void* X, const void* Wt, void* Y) {
  thread_local bool single = (omp_set_num_threads(1), true);
  (void)single;
  thread_local std::vector<char> scratch;
  const Prim& p = primitive(k);
  const size_t need = p.scratch_md.get_size();
  if (scratch.size() < need) scratch.resize(need);
  dnnl::engine& e = cpu_engine();
  dnnl::stream s(e);
  dnnl::memory xm(p.x_md, e, const_cast<void*>(X)), wm(p.w_md, e, const_cast<void*>(Wt)),
      ym(p.y_md, e, Y), sm(p.scratch_md, e, scratch.data());
  p.matmul.execute(s, {{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, ym},
                       {DNNL_ARG_SCRATCHPAD, sm}});
  s.wait();
}

int64_t elem_size(dt t) { return t == dt::f32 ? 4 : t == dt::s8 ? 1 : 2; }

// Whether oneDNN has a bf16 matmul on this CPU (AVX-512 and up; none on AVX2-only CPUs).
bool onednn_has_bf16() {
  static const bool ok = [] {
    try {
      primitive(Key{8, 64, 64, 64, 64, false, dt::bf16, dt::bf16, dt::f32});
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return ok;
}

// bf16 on a CPU oneDNN has no bf16 kernel for: the operands converted to f32 (the weight
// columns into a per-thread buffer), then the f32 primitive. Correct, not fast: the engine
// picks float32 on such CPUs unless the user asks for bf16.
void emulated_bf16(const Key& k, const char* X, const char* W, char* Y) {
  thread_local std::vector<float> xf, wf, yf;
  xf.resize(size_t(k.rows * k.in));
  wf.resize(size_t(k.in * k.cols));
  yf.resize(size_t(k.rows * k.cols));
  for (int64_t i = 0; i < k.rows * k.in; ++i)
    xf[i] = k.x == dt::f32 ? reinterpret_cast<const float*>(X)[i]
                           : bf16_to_f32(reinterpret_cast<const uint16_t*>(X)[i]);
  // The weight block keeps its layout ([in, cols], or [cols, in] transposed), made
  // contiguous: both loops walk the source's rows in order.
  const int64_t outer = k.transposed ? k.cols : k.in, inner = k.transposed ? k.in : k.cols;
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < inner; ++i) {
      const int64_t at = o * k.ldw + i;
      wf[o * inner + i] = k.w == dt::f32 ? reinterpret_cast<const float*>(W)[at]
                                         : bf16_to_f32(reinterpret_cast<const uint16_t*>(W)[at]);
    }
  run_onednn(Key{k.rows, k.in, k.cols, inner, k.cols, k.transposed, dt::f32, dt::f32, dt::f32},
             xf.data(), wf.data(), yf.data());
  for (int64_t r = 0; r < k.rows; ++r)
    for (int64_t c = 0; c < k.cols; ++c) {
      const float v = yf[r * k.cols + c];
      if (k.y == dt::f32)
        reinterpret_cast<float*>(Y)[r * k.ldy + c] = v;
      else
        reinterpret_cast<uint16_t*>(Y)[r * k.ldy + c] = f32_to_bf16(v);
    }
}

// Columns split over the pool in ranges of a multiple of 64 (the matrix units' blocking).
// Returns an error message ("" on success): oneDNN throws, and a pool thread must not.
std::string onednn_gemm(ffi::ThreadPool& pool, const char* X, const char* W, char* Y, int64_t T,
                        int64_t in, int64_t out, bool transposed, dt xt, dt wt, dt yt) {
  constexpr int64_t kAlign = 64;
  const int64_t blocks = (out + kAlign - 1) / kAlign;
  int64_t workers = std::max<int64_t>(1, pool.num_threads());
  if (T * in * out < (int64_t(1) << 20)) workers = 1;   // waking a thread costs about this
  workers = std::min(workers, blocks);
  const int64_t ldw = transposed ? in : out;
  const bool emulate = (xt == dt::bf16 || wt == dt::bf16 || yt == dt::bf16) && !onednn_has_bf16();
  std::mutex mu;
  std::string error;
  parallel_for(pool, workers, workers, [&](int64_t part, int64_t) {
    const int64_t c0 = std::min(out, blocks * part / workers * kAlign);
    const int64_t c1 = std::min(out, blocks * (part + 1) / workers * kAlign);
    if (c1 <= c0) return;
    const Key key{T, in, c1 - c0, ldw, out, transposed, xt, wt, yt};
    const char* w0 = W + (transposed ? c0 * in : c0) * elem_size(wt);
    try {
      if (emulate)
        emulated_bf16(key, X, w0, Y + c0 * elem_size(yt));
      else
        run_onednn(key, X, w0, Y + c0 * elem_size(yt));
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(mu);
      error = e.what();
    }
  });
  return error;
}

// ---------------------------------------------------------------------------
// The FFI handler.
// ---------------------------------------------------------------------------

bool to_dt(ffi::DataType t, dt* out) {
  if (t == ffi::DataType::F32) { *out = dt::f32; return true; }
  if (t == ffi::DataType::BF16) { *out = dt::bf16; return true; }
  if (t == ffi::DataType::S8) { *out = dt::s8; return true; }
  return false;
}

// The GEMV over one or more projections of x: x converted to f32 once; bf16 results go
// through an f32 buffer. ws[i]: this layer's [in, outs[i]] weights; ys[i]: [T, outs[i]].
ffi::Error run_gemv(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, dt wt,
                    const std::vector<const char*>& ws, const std::vector<int64_t>& outs,
                    const std::vector<ffi::AnyBuffer>& ys, int64_t T, int64_t in,
                    bool transposed = false, const std::vector<const float*>& scales = {},
                    int64_t group = 0) {
  std::vector<float> xf(size_t(T * in));
  if (x.element_type() == ffi::DataType::F32) {
    std::memcpy(xf.data(), x.untyped_data(), xf.size() * 4);
  } else {
    const uint16_t* xh = static_cast<const uint16_t*>(x.untyped_data());
    for (size_t i = 0; i < xf.size(); ++i) xf[i] = bf16_to_f32(xh[i]);
  }
  std::vector<std::vector<float>> bf16_out(ws.size());
  std::vector<GemvSegment> segs;
  for (size_t s = 0; s < ws.size(); ++s) {
    float* y = nullptr;
    if (ys[s].element_type() == ffi::DataType::F32) {
      y = static_cast<float*>(ys[s].untyped_data());
    } else {
      bf16_out[s].resize(size_t(T * outs[s]));
      y = bf16_out[s].data();
    }
    segs.push_back(GemvSegment{ws[s], y, outs[s], scales.empty() ? nullptr : scales[s], group});
  }
  if (transposed && wt == dt::f32)   // one segment: [out, in] rows, a tied LM head
    transposed_gemv(pool, xf.data(), reinterpret_cast<const float*>(ws[0]), segs[0].y, T, in,
                    outs[0]);
  else if (transposed)
    transposed_gemv(pool, xf.data(), reinterpret_cast<const uint16_t*>(ws[0]), segs[0].y, T, in,
                    outs[0]);
  else if (wt == dt::f32)
    gemv<float>(pool, xf.data(), segs, T, in);
  else if (wt == dt::s8)
    gemv<int8_t>(pool, xf.data(), segs, T, in);
  else
    gemv<uint16_t>(pool, xf.data(), segs, T, in);
  for (size_t s = 0; s < ws.size(); ++s) {
    if (bf16_out[s].empty()) continue;
    uint16_t* yh = static_cast<uint16_t*>(ys[s].untyped_data());
    for (size_t i = 0; i < bf16_out[s].size(); ++i) yh[i] = f32_to_bf16(bf16_out[s][i]);
  }
  return ffi::Error::Success();
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                      ffi::Buffer<ffi::S32> layer_buf, ffi::Result<ffi::AnyBuffer> y,
                      int64_t gemv_rows, bool transposed_w) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  const int64_t w_in = wd.size() == 3 ? (transposed_w ? wd[2] : wd[1]) : -1;
  const int64_t w_out = wd.size() == 3 ? (transposed_w ? wd[1] : wd[2]) : -1;
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || xd[1] != w_in || yd[0] != xd[0] ||
      yd[1] != w_out || layer_buf.element_count() != 1)
    return ffi::Error::InvalidArgument("matmul: want x [T, in], w [L, in, out] ([L, out, in] "
                                       "transposed), layer [], y [T, out]; got x " +
                                       dims_str(xd) + ", w " + dims_str(wd) + ", y " +
                                       dims_str(yd));
  dt xt, wt, yt;
  if (!to_dt(x.element_type(), &xt) || !to_dt(w.element_type(), &wt) ||
      !to_dt(y->element_type(), &yt) || yt == dt::s8 || (xt == dt::s8 && wt != dt::s8))
    return ffi::Error::InvalidArgument("matmul: x, w, y float32 / bfloat16, or int8 w with "
                                       "int8 x (W8A8) or float x (W8A16, rows <= 8)");
  const int64_t T = xd[0], in = w_in, out = w_out, L = wd[0];
  if (T == 0 || out == 0) return ffi::Error::Success();
  if (in == 0 || L == 0) {
    std::memset(y->untyped_data(), 0, size_t(T * out * elem_size(yt)));
    return ffi::Error::Success();
  }
  const int64_t layer = std::min<int64_t>(std::max<int64_t>(layer_buf.typed_data()[0], 0), L - 1);
  const char* W = static_cast<const char*>(w.untyped_data()) + layer * in * out * elem_size(wt);
  const int64_t limit = gemv_rows < 0 ? kMaxGemvRows : std::min(gemv_rows, kMaxGemvRows);
  if (wt == dt::s8 && xt != dt::s8 && T > kMaxGemvRows)
    return ffi::Error::InvalidArgument("matmul: int8 weights with float x (W8A16) take at most "
                                       "8 rows; quantize x to int8 (W8A8) for more");
  if ((T <= limit || (wt == dt::s8 && xt != dt::s8)) && xt != dt::s8 &&
      !(transposed_w && wt == dt::s8))
    return run_gemv(pool, x, wt, {W}, {out}, {*y}, T, in, transposed_w);
  const std::string error =
      onednn_gemm(pool, static_cast<const char*>(x.untyped_data()), W,
                  static_cast<char*>(y->untyped_data()), T, in, out, transposed_w, xt, wt, yt);
  if (!error.empty()) return ffi::Error(ffi::ErrorCode::kInternal, "matmul: oneDNN: " + error);
  return ffi::Error::Success();
}

// Several projections of one x in one call (q/k/v; gate/up): a decode step's projections
// are small (SmolLM2's k_proj: 0.44 MB, ~20 us of streaming) and each call of its own paid
// ~25-30 us of thunk and pool wake-up on top. The GEMV only: the caller takes it at the row
// counts where the GEMV serves these weights, and calls one projection at a time elsewhere.
ffi::Error MatmulGroupImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                           ffi::Buffer<ffi::S32> layer_buf, ffi::RemainingArgs args,
                           ffi::RemainingRets results, int64_t group_size) {
  // args: n weights [L, in, out_i]; with group_size > 0 (int8 weights, W8A16 group-wise)
  // then their n scales [L, in / group_size, out_i] float32.
  const auto xd = x.dimensions();
  const size_t n = results.size();
  const bool grouped = group_size > 0;
  if (xd.size() != 2 || layer_buf.element_count() != 1 || n == 0 ||
      args.size() != (grouped ? 2 * n : n))
    return ffi::Error::InvalidArgument("matmul group: want x [T, in], layer [], n >= 1 weights "
                                       "[L, in, out_i] (and n scales with group_size) and n "
                                       "results [T, out_i]; got x " + dims_str(xd));
  const int64_t T = xd[0], in = xd[1];
  if (x.element_type() != ffi::DataType::F32 && x.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("matmul group: x float32 or bfloat16");
  if (T > kMaxGemvRows)
    return ffi::Error::InvalidArgument("matmul group: the GEMV takes at most 8 rows");
  if (grouped && in > 0 && (in % group_size != 0 ||
                            (group_size % kGemvKBlock != 0 && group_size != in)))
    return ffi::Error::InvalidArgument("matmul group: group_size " + std::to_string(group_size) +
                                       " must divide in (" + std::to_string(in) +
                                       ") and be a multiple of 8 (or in itself)");
  std::vector<const char*> ws;
  std::vector<const float*> scales;
  std::vector<int64_t> outs;
  std::vector<ffi::AnyBuffer> ys;
  dt wt = dt::f32;
  bool no_weights = in == 0;   // x @ an empty [0, out] block (or a model of 0 layers): zeros
  for (size_t i = 0; i < n; ++i) {
    auto w = args.get<ffi::AnyBuffer>(i);
    auto y = results.get<ffi::AnyBuffer>(i);
    if (w.has_error()) return w.error();
    if (y.has_error()) return y.error();
    const auto wd = w->dimensions(), yd = (*y)->dimensions();
    dt this_wt, yt;
    if (wd.size() != 3 || wd[1] != in || yd.size() != 2 || yd[0] != T || yd[1] != wd[2] ||
        !to_dt(w->element_type(), &this_wt) || !to_dt((*y)->element_type(), &yt) ||
        yt == dt::s8 || (i > 0 && this_wt != wt) || (grouped && this_wt != dt::s8))
      return ffi::Error::InvalidArgument("matmul group: weight " + std::to_string(i) + " " +
                                         dims_str(wd) + " / result " + dims_str(yd) +
                                         " do not fit x " + dims_str(xd) +
                                         " (one weight dtype, float results; int8 with scales)");
    wt = this_wt;
    const int64_t L = wd[0], out = wd[2];
    no_weights = no_weights || L == 0;
    const int64_t layer = std::min<int64_t>(std::max<int64_t>(layer_buf.typed_data()[0], 0),
                                            std::max<int64_t>(L - 1, 0));
    ws.push_back(static_cast<const char*>(w->untyped_data()) + layer * in * out * elem_size(wt));
    if (grouped) {
      auto sc = args.get<ffi::AnyBuffer>(n + i);
      if (sc.has_error()) return sc.error();
      const auto sd = sc->dimensions();
      const int64_t groups = in / group_size;
      if (sc->element_type() != ffi::DataType::F32 || sd.size() != 3 || sd[0] != L ||
          sd[1] != groups || sd[2] != out)
        return ffi::Error::InvalidArgument("matmul group: scales " + std::to_string(i) + " " +
                                           dims_str(sd) + " are not float32 [L, in / " +
                                           std::to_string(group_size) + ", out] of weight " +
                                           dims_str(wd));
      scales.push_back(static_cast<const float*>(sc->untyped_data()) + layer * groups * out);
    }
    outs.push_back(out);
    ys.push_back(**y);
  }
  if (T == 0) return ffi::Error::Success();
  if (no_weights) {
    for (size_t i = 0; i < n; ++i)
      std::memset(ys[i].untyped_data(), 0, size_t(T * outs[i]) * (ys[i].element_type() ==
                                                 ffi::DataType::F32 ? 4 : 2));
    return ffi::Error::Success();
  }
  return run_gemv(pool, x, wt, ws, outs, ys, T, in, false, scales, group_size);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // x [T, in]
                                  .Arg<ffi::AnyBuffer>()         // w [L, in, out]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Ret<ffi::AnyBuffer>()         // y [T, out]
                                  .Attr<int64_t>("gemv_rows")
                                  .Attr<bool>("transposed_w"));

// The CPU's best oneDNN instruction set, as oneDNN detected it (0 when unknown): the
// engine's startup log names it.
extern "C" int jaxserve_onednn_isa() {
  return static_cast<int>(dnnl::get_effective_cpu_isa());
}

// 1 when oneDNN computes bf16 matmuls natively here (else matmul.cc converts to f32).
extern "C" int jaxserve_onednn_bf16() { return onednn_has_bf16() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulGroup, MatmulGroupImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // x [T, in]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .RemainingArgs()               // weights (, scales)
                                  .RemainingRets()               // results [T, out_i]
                                  .Attr<int64_t>("group_size"));
