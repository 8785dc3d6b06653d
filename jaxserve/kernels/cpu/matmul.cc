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
// The one kernel of our own: rows <= kMaxGemvRows (a decode of a few sequences, a verify
// step) take a register-blocked GEMV that streams the weights once (bandwidth-bound: bf16
// weights halve its bytes). It is kept only while it beats oneDNN on the same call
// (benchmarks/bench_layer_matmul.py; GEMV_MARGIN in jaxserve/kernels/cpu/matmul.py).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
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
// GEMV: a few rows, the weights streamed once. A tile of T rows x NV vectors of output
// columns lives in registers while it walks kGemvKBlock weight rows, then is stored and
// reloaded for the next block; workers take contiguous column ranges (no partial sums).
// ---------------------------------------------------------------------------

constexpr int64_t kMaxGemvRows = 8;
constexpr int64_t kGemvKBlock = 8;
constexpr int kLanes = 16;
#ifdef __AVX512F__
constexpr int kGemvAccRegs = 16;   // 16-float accumulators per tile, of 32 zmm registers
#else
constexpr int kGemvAccRegs = 4;    // a v16 is two ymm registers: 8 of AVX2's 16
#endif

typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef uint16_t h16u __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u16x32 __attribute__((vector_size(64)));

inline v16u load16(const float* p) { v16u v; std::memcpy(&v, p, sizeof(v)); return v; }
inline v16u load16(const uint16_t* p) {
  h16u h;
  std::memcpy(&h, p, sizeof(h));
  const u16x32 wide = __builtin_convertvector(h, u16x32) << 16;
  v16u v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}
typedef int8_t b16u __attribute__((vector_size(16), aligned(1)));
typedef float f16x32 __attribute__((vector_size(64)));
inline v16u load16(const int8_t* p) {   // int8 weights (W8A16: the caller applies the scale)
  b16u b;
  std::memcpy(&b, p, sizeof(b));
  const f16x32 f = __builtin_convertvector(b, f16x32);
  v16u v;
  std::memcpy(&v, &f, sizeof(v));
  return v;
}
inline void store16(float* p, v16u v) { std::memcpy(p, &v, sizeof(v)); }

template <int T, int NV, typename W>
void gemv_tile(const float* X, const W* Wt, float* Y, int64_t in, int64_t out, int64_t o0,
               int64_t k0, int64_t k1) {
  v16u acc[T][NV];
  for (int t = 0; t < T; ++t)
    for (int n = 0; n < NV; ++n)
      acc[t][n] = k0 == 0 ? v16u{} : load16(Y + t * out + o0 + n * kLanes);
  for (int64_t i = k0; i < k1; ++i) {
    const W* w = Wt + i * out + o0;
    v16u wv[NV];
    for (int n = 0; n < NV; ++n) wv[n] = load16(w + n * kLanes);
    for (int t = 0; t < T; ++t) {
      const v16u xv = v16u{} + X[t * in + i];
      for (int n = 0; n < NV; ++n) acc[t][n] += xv * wv[n];
    }
  }
  for (int t = 0; t < T; ++t)
    for (int n = 0; n < NV; ++n) store16(Y + t * out + o0 + n * kLanes, acc[t][n]);
}

inline float weight_at(const float* w, int64_t i) { return w[i]; }
inline float weight_at(const uint16_t* w, int64_t i) { return bf16_to_f32(w[i]); }
inline float weight_at(const int8_t* w, int64_t i) { return float(w[i]); }

template <int T>
constexpr int gemv_vectors() { return std::max(1, std::min(8, kGemvAccRegs / T)); }

template <int T, typename W>
void gemv_columns(const float* X, const W* Wt, float* Y, int64_t in, int64_t out, int64_t c0,
                  int64_t c1) {
  constexpr int NV = gemv_vectors<T>();
  const int64_t full = c0 + (c1 - c0) / (NV * kLanes) * (NV * kLanes);
  const int64_t vec = full + (c1 - full) / kLanes * kLanes;
  for (int64_t k0 = 0; k0 < in; k0 += kGemvKBlock) {
    const int64_t k1 = std::min<int64_t>(in, k0 + kGemvKBlock);
    for (int64_t o = c0; o < full; o += NV * kLanes)
      gemv_tile<T, NV>(X, Wt, Y, in, out, o, k0, k1);
    for (int64_t o = full; o < vec; o += kLanes) gemv_tile<T, 1>(X, Wt, Y, in, out, o, k0, k1);
  }
  for (int64_t o = vec; o < c1; ++o)   // fewer than 16 columns left (out % 16)
    for (int t = 0; t < T; ++t) {
      float a = 0.f;
      for (int64_t i = 0; i < in; ++i) a += X[t * in + i] * weight_at(Wt, i * out + o);
      Y[t * out + o] = a;
    }
}

template <int T, typename W>
void gemv_rows_of(ffi::ThreadPool& pool, const float* X, const W* Wt, float* Y, int64_t in,
                  int64_t out) {
  constexpr int64_t tile = gemv_vectors<T>() * kLanes;
  const int64_t tiles = (out + tile - 1) / tile;
  const int64_t workers = streaming_workers(pool, in * out * int64_t(sizeof(W)) / 4, tiles);
  parallel_for(pool, workers, workers, [&](int64_t part, int64_t) {
    const int64_t c0 = std::min(out, tiles * part / workers * tile);
    const int64_t c1 = std::min(out, tiles * (part + 1) / workers * tile);
    gemv_columns<T>(X, Wt, Y, in, out, c0, c1);
  });
}

template <typename W>
void gemv(ffi::ThreadPool& pool, const float* X, const W* Wt, float* Y, int64_t T, int64_t in,
          int64_t out) {
  switch (T) {
    case 1: gemv_rows_of<1>(pool, X, Wt, Y, in, out); break;
    case 2: gemv_rows_of<2>(pool, X, Wt, Y, in, out); break;
    case 3: gemv_rows_of<3>(pool, X, Wt, Y, in, out); break;
    case 4: gemv_rows_of<4>(pool, X, Wt, Y, in, out); break;
    case 5: gemv_rows_of<5>(pool, X, Wt, Y, in, out); break;
    case 6: gemv_rows_of<6>(pool, X, Wt, Y, in, out); break;
    case 7: gemv_rows_of<7>(pool, X, Wt, Y, in, out); break;
    default: gemv_rows_of<8>(pool, X, Wt, Y, in, out); break;
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

ffi::Error run_gemv(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, const char* W, dt wt,
                    ffi::Result<ffi::AnyBuffer>& y, int64_t T, int64_t in, int64_t out) {
  std::vector<float> xf(size_t(T * in)), yf;
  if (x.element_type() == ffi::DataType::F32) {
    std::memcpy(xf.data(), x.untyped_data(), xf.size() * 4);
  } else {
    const uint16_t* xh = static_cast<const uint16_t*>(x.untyped_data());
    for (size_t i = 0; i < xf.size(); ++i) xf[i] = bf16_to_f32(xh[i]);
  }
  const bool f32_out = y->element_type() == ffi::DataType::F32;
  if (!f32_out) yf.resize(size_t(T * out));
  float* Yf = f32_out ? static_cast<float*>(y->untyped_data()) : yf.data();
  if (wt == dt::f32)
    gemv(pool, xf.data(), reinterpret_cast<const float*>(W), Yf, T, in, out);
  else if (wt == dt::s8)
    gemv(pool, xf.data(), reinterpret_cast<const int8_t*>(W), Yf, T, in, out);
  else
    gemv(pool, xf.data(), reinterpret_cast<const uint16_t*>(W), Yf, T, in, out);
  if (!f32_out) {
    uint16_t* yh = static_cast<uint16_t*>(y->untyped_data());
    for (size_t i = 0; i < yf.size(); ++i) yh[i] = f32_to_bf16(yf[i]);
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
  if ((T <= limit || (wt == dt::s8 && xt != dt::s8)) && !transposed_w && xt != dt::s8)
    return run_gemv(pool, x, W, wt, y, T, in, out);
  const std::string error =
      onednn_gemm(pool, static_cast<const char*>(x.untyped_data()), W,
                  static_cast<char*>(y->untyped_data()), T, in, out, transposed_w, xt, wt, yt);
  if (!error.empty()) return ffi::Error(ffi::ErrorCode::kInternal, "matmul: oneDNN: " + error);
  return ffi::Error::Success();
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
