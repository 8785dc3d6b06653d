// Layer matmul for the XLA CPU backend (the second kernel of the library that
// paged_attention.cc starts; loader.py compiles both files into one .so):
//
//   y[T, out] = x[T, in] @ w[layer]      x, y float32; w the stacked [L, in, out] float32
//                                        weights of every layer; layer an int32 scalar
//                                        (clamped to [0, L)).
//
// Why: the decoder runs its layers under a scan over weights stacked [L, in, out]. XLA:CPU
// hands each dot a dynamic slice of the stacked weights, and that slice is a copy: every
// layer's weights are copied in every step, on top of the dot reading them. This reads
// w[layer] in place instead (models/layer_matmul.py decides when).
//
// Two shapes of work:
//  * T <= kMaxGemvRows (a decode of a few sequences, a verify step): a register-blocked
//    GEMV that streams the weights once (their memory traffic is all the cost).
//  * larger T (decode batches, prefill chunks): a cache-blocked, register-blocked GEMM.
//    The columns are cut into panels of kNR = 48; a task is one panel (tasks are shared
//    dynamically over XLA's intra-op pool). For each block of kKC weight rows the task
//    packs the [kKC, 48] weight block into a contiguous, zero-padded buffer (48 KiB: it
//    stays in L1/L2 while every row tile of x reuses it), then runs the micro-kernel on
//    each tile of up to kMR = 8 rows of x: 8 x 3 vectors of 16 accumulators (24 of the 32
//    AVX-512 registers), per k three vector loads of the packed weights, eight broadcasts
//    of x and 24 FMAs. Written with GCC vector extensions: -march=native turns them into
//    AVX-512 (or AVX2) code; the portable build still computes the same thing.
//    Ragged edges (T % 8, out % 48, in % kKC) run the same code: a narrower template
//    instance for the last rows, zero padding and a partial store for the last columns.

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "parallel_for.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve_cpu::dims_str;
using jaxserve_cpu::parallel_for;
using jaxserve_cpu::streaming_workers;


// ---------------------------------------------------------------------------
// GEMV: a few rows (a decode of a few sequences, a speculative verify step), where
// streaming the weights once is the cost. Register-blocked: a tile of T rows x NV vectors
// of output columns lives in registers while it walks a block of kGemvKBlock weight rows
// (kGemvKBlock short sequential streams, which the prefetchers follow), then is stored and
// reloaded for the next block; workers take contiguous column ranges (no partial sums).
// The first version kept every row's [out] accumulator in memory and updated it once per
// weight row: T loads and stores per weight vector, 2x slower at T = 8 (SmolLM2's
// [576, 1536], one thread: 0.75 -> 0.40 ms) -- and a verify step carries k + 1 <= 8 rows.
// ---------------------------------------------------------------------------

constexpr int64_t kMaxGemvRows = 8;
constexpr int64_t kGemvKBlock = 8;
constexpr int kLanes = 16;                     // floats per v16u
constexpr int kGemvAccRegs = 16;               // accumulators per tile (of 32 zmm registers)

typedef float v16u __attribute__((vector_size(64), aligned(4)));   // unaligned rows

inline v16u load16(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void store16(float* p, v16u v) { *reinterpret_cast<v16u*>(p) = v; }

// y[:, o0 : o0 + NV * 16] (+)= x[:, k0 : k1] @ w[k0 : k1, o0 : o0 + NV * 16] for T rows:
// the first block (k0 == 0) starts from zero, the others add to what the previous stored.
template <int T, int NV>
void gemv_tile(const float* X, const float* Wt, float* Y, int64_t in, int64_t out, int64_t o0,
               int64_t k0, int64_t k1) {
  v16u acc[T][NV];
  for (int t = 0; t < T; ++t)
    for (int n = 0; n < NV; ++n)
      acc[t][n] = k0 == 0 ? v16u{} : load16(Y + t * out + o0 + n * kLanes);
  for (int64_t i = k0; i < k1; ++i) {
    const float* w = Wt + i * out + o0;
    v16u wv[NV];
    for (int n = 0; n < NV; ++n) wv[n] = load16(w + n * kLanes);
    for (int t = 0; t < T; ++t) {
      const float xv = X[t * in + i];
      for (int n = 0; n < NV; ++n) acc[t][n] += xv * wv[n];
    }
  }
  for (int t = 0; t < T; ++t)
    for (int n = 0; n < NV; ++n) store16(Y + t * out + o0 + n * kLanes, acc[t][n]);
}

template <int T>
constexpr int gemv_vectors() { return std::max(1, std::min(8, kGemvAccRegs / T)); }

// Columns [c0, c1) of y (c0 a multiple of the tile; c1 too, or `out`). Weight rows go in
// blocks of kGemvKBlock, each block across all the tiles.
template <int T>
void gemv_columns(const float* X, const float* Wt, float* Y, int64_t in, int64_t out,
                  int64_t c0, int64_t c1) {
  constexpr int NV = gemv_vectors<T>();
  const int64_t full = c0 + (c1 - c0) / (NV * kLanes) * (NV * kLanes);  // whole tiles end
  const int64_t vec = full + (c1 - full) / kLanes * kLanes;             // single vectors end
  for (int64_t k0 = 0; k0 < in; k0 += kGemvKBlock) {
    const int64_t k1 = std::min<int64_t>(in, k0 + kGemvKBlock);
    for (int64_t o = c0; o < full; o += NV * kLanes) gemv_tile<T, NV>(X, Wt, Y, in, out, o, k0, k1);
    for (int64_t o = full; o < vec; o += kLanes) gemv_tile<T, 1>(X, Wt, Y, in, out, o, k0, k1);
  }
  for (int64_t o = vec; o < c1; ++o)            // fewer than 16 columns left (out % 16)
    for (int t = 0; t < T; ++t) {
      float a = 0.f;
      for (int64_t i = 0; i < in; ++i) a += X[t * in + i] * Wt[i * out + o];
      Y[t * out + o] = a;
    }
}

template <int T>
void gemv_rows_of(ffi::ThreadPool& pool, const float* X, const float* Wt, float* Y, int64_t in,
                  int64_t out) {
  constexpr int64_t tile = gemv_vectors<T>() * kLanes;
  const int64_t tiles = (out + tile - 1) / tile;
  const int64_t workers = streaming_workers(pool, in * out, tiles);
  parallel_for(pool, workers, workers, [&](int64_t part, int64_t) {
    const int64_t c0 = std::min(out, tiles * part / workers * tile);
    const int64_t c1 = std::min(out, tiles * (part + 1) / workers * tile);
    gemv_columns<T>(X, Wt, Y, in, out, c0, c1);
  });
}

void gemv(ffi::ThreadPool& pool, const float* X, const float* W, float* Y, int64_t T,
          int64_t in, int64_t out) {
  switch (T) {
    case 1: gemv_rows_of<1>(pool, X, W, Y, in, out); break;
    case 2: gemv_rows_of<2>(pool, X, W, Y, in, out); break;
    case 3: gemv_rows_of<3>(pool, X, W, Y, in, out); break;
    case 4: gemv_rows_of<4>(pool, X, W, Y, in, out); break;
    case 5: gemv_rows_of<5>(pool, X, W, Y, in, out); break;
    case 6: gemv_rows_of<6>(pool, X, W, Y, in, out); break;
    case 7: gemv_rows_of<7>(pool, X, W, Y, in, out); break;
    default: gemv_rows_of<8>(pool, X, W, Y, in, out); break;
  }
}

// ---------------------------------------------------------------------------
// GEMM: more rows.
// ---------------------------------------------------------------------------

typedef float v16 __attribute__((vector_size(64)));                // aligned (packed panel)

constexpr int kMR = 8;            // rows of x per micro-tile
constexpr int kNV = 3;            // 16-float vectors per micro-tile row
constexpr int64_t kNR = kNV * 16; // columns per panel (48)
constexpr int64_t kKC = 256;      // weight rows per packed block: 256 x 48 x 4 B = 48 KiB
constexpr int64_t kPackAhead = 16; // rows of w prefetched ahead of the packing copy

// C[0:MR, 0:ncols] (+)= A[0:MR, 0:kc] @ Bp[0:kc, 0:ncols]; Bp is packed [kc][kNR] (zero
// padded past ncols), A and C are row-major with strides lda, ldc. ncols <= NV * 16.
template <int MR, int NV>
void micro_tile(int64_t kc, const float* __restrict A, int64_t lda, const float* __restrict Bp,
                float* __restrict C, int64_t ldc, int64_t ncols, bool accumulate) {
  v16 acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 3
    for (int j = 0; j < NV; ++j) acc[i][j] = v16{};
  for (int64_t k = 0; k < kc; ++k) {
    v16 b[NV];
#pragma GCC unroll 3
    for (int j = 0; j < NV; ++j) b[j] = *reinterpret_cast<const v16*>(Bp + k * kNR + j * 16);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const float a = A[i * lda + k];
#pragma GCC unroll 3
      for (int j = 0; j < NV; ++j) acc[i][j] += a * b[j];
    }
  }
  if (ncols == NV * 16) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 3
      for (int j = 0; j < NV; ++j) {
        v16u* c = reinterpret_cast<v16u*>(C + i * ldc + j * 16);
        *c = accumulate ? *c + acc[i][j] : acc[i][j];
      }
    return;
  }
  for (int i = 0; i < MR; ++i) {
    alignas(64) float row[NV * 16];
    std::memcpy(row, &acc[i][0], sizeof(row));
    float* c = C + i * ldc;
    for (int64_t n = 0; n < ncols; ++n) c[n] = accumulate ? c[n] + row[n] : row[n];
  }
}

using TileFn = void (*)(int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t,
                        bool);

template <int NV>
constexpr TileFn kTilesOfWidth[kMR] = {micro_tile<1, NV>, micro_tile<2, NV>, micro_tile<3, NV>,
                                       micro_tile<4, NV>, micro_tile<5, NV>, micro_tile<6, NV>,
                                       micro_tile<7, NV>, micro_tile<8, NV>};

TileFn tile_fn(int64_t rows, int64_t ncols) {
  const int64_t nv = (ncols + 15) / 16;
  if (nv == 1) return kTilesOfWidth<1>[rows - 1];
  if (nv == 2) return kTilesOfWidth<2>[rows - 1];
  return kTilesOfWidth<3>[rows - 1];
}

struct AlignedFree {
  void operator()(float* p) const { std::free(p); }
};

// One task of the GEMM: columns [panel * kNR, +kNR) of y, all rows. Bp: kKC x kNR floats.
void gemm_panel(const float* X, const float* W, float* Y, int64_t T, int64_t in, int64_t out,
                int64_t panel, float* Bp) {
  const int64_t n0 = panel * kNR, ncols = std::min(kNR, out - n0);
  const int64_t lines = (ncols * int64_t(sizeof(float)) + 63) / 64;
  for (int64_t k0 = 0; k0 < in; k0 += kKC) {
    const int64_t kc = std::min(kKC, in - k0);
    const float* src = W + k0 * out + n0;
    // Pack the weight block: kc strided runs of ncols floats. The runs are short and far
    // apart (a row of w each), so fetch kPackAhead rows ahead of the copy.
    for (int64_t k = 0; k < kc; ++k) {
      if (k + kPackAhead < in - k0)
        for (int64_t l = 0; l < lines; ++l)
          __builtin_prefetch(src + (k + kPackAhead) * out + l * 16, 0, 0);
      std::memcpy(Bp + k * kNR, src + k * out, size_t(ncols) * sizeof(float));
      if (ncols < kNR) std::memset(Bp + k * kNR + ncols, 0, size_t(kNR - ncols) * sizeof(float));
    }
    // While the row tiles compute on this block, fetch the next one (the next rows of this
    // panel, or the first of the next panel, which this worker likely takes next), a share
    // per tile, so its packing finds it in cache.
    const bool last = k0 + kKC >= in;
    const float* next = last ? W + (n0 + kNR) : src + kKC * out;
    const int64_t next_rows = last ? (n0 + kNR < out ? std::min(kKC, in) : 0)
                                   : std::min(kKC, in - k0 - kKC);
    const int64_t next_lines = last ? (std::min(kNR, out - n0 - kNR) * 4 + 63) / 64 : lines;
    const int64_t tiles = (T + kMR - 1) / kMR;
    for (int64_t m0 = 0, tile = 0; m0 < T; m0 += kMR, ++tile) {
      for (int64_t k = next_rows * tile / tiles; k < next_rows * (tile + 1) / tiles; ++k)
        for (int64_t l = 0; l < next_lines; ++l) __builtin_prefetch(next + k * out + l * 16, 0, 1);
      const int64_t rows = std::min<int64_t>(kMR, T - m0);
      tile_fn(rows, ncols)(kc, X + m0 * in + k0, in, Bp, Y + m0 * out + n0, out, ncols, k0 > 0);
    }
  }
}

// False if the packing buffers could not be allocated.
bool gemm(ffi::ThreadPool& pool, const float* X, const float* W, float* Y, int64_t T,
          int64_t in, int64_t out) {
  const int64_t panels = (out + kNR - 1) / kNR;
  int64_t workers = std::max<int64_t>(1, pool.num_threads());
  // Below ~1M multiply-adds (~0.02 ms on one core) waking a second thread costs about
  // what it saves.
  if (T * in * out < (int64_t(1) << 20)) workers = 1;
  workers = std::min(workers, panels);
  const int64_t kc_max = std::min(kKC, in);
  const size_t buf_floats = size_t(kc_max * kNR);
  std::vector<std::unique_ptr<float, AlignedFree>> bufs;
  for (int64_t w = 0; w < workers; ++w) {
    bufs.emplace_back(static_cast<float*>(std::aligned_alloc(64, buf_floats * sizeof(float))));
    if (!bufs.back()) return false;
  }
  parallel_for(pool, panels, workers, [&](int64_t panel, int64_t worker) {
    gemm_panel(X, W, Y, T, in, out, panel, bufs[worker].get());
  });
  return true;
}

ffi::Error LayerMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> layer_buf,
                           ffi::Result<ffi::Buffer<ffi::F32>> y, int64_t gemv_rows) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || xd[1] != wd[1] ||
      yd[0] != xd[0] || yd[1] != wd[2] || layer_buf.element_count() != 1)
    return ffi::Error::InvalidArgument("layer_matmul: want x [T, in], w [L, in, out], "
                                       "layer [], y [T, out]; got x " + dims_str(xd) +
                                       ", w " + dims_str(wd) + ", y " + dims_str(yd));
  const int64_t T = xd[0], in = wd[1], out = wd[2], L = wd[0];
  float* Y = y->typed_data();
  if (T == 0 || out == 0) return ffi::Error::Success();
  if (in == 0 || L == 0) {
    std::memset(Y, 0, size_t(T * out) * sizeof(float));
    return ffi::Error::Success();
  }
  const int64_t layer = std::min<int64_t>(std::max<int64_t>(layer_buf.typed_data()[0], 0), L - 1);
  const float* W = w.typed_data() + layer * in * out;
  // gemv_rows: the largest T that takes the GEMV (-1: kMaxGemvRows; tests force either).
  const int64_t limit = gemv_rows < 0 ? kMaxGemvRows : std::min(gemv_rows, kMaxGemvRows);
  if (T <= limit)
    gemv(pool, x.typed_data(), W, Y, T, in, out);
  else if (!gemm(pool, x.typed_data(), W, Y, T, in, out))
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, "layer_matmul: out of memory");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveLayerMatmul, LayerMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, in]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [L, in, out]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, out]
                                  .Attr<int64_t>("gemv_rows"));
