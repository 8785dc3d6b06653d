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
// The one kernel of our own, a streaming GEMV for a few rows, is in gemv.h. It serves int8
// weights with float x (W8A16: oneDNN takes int8 weights only with int8 x) and float weights
// up to the row count the engine measured it faster than oneDNN on this CPU (gemv_rows;
// gemv_choice.py). A second handler (JaxserveMatmulGroup) streams several projections of one
// x in one call.

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
#include "gemv.h"
#include "gemv_gguf.h"
#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

extern "C" void omp_set_num_threads(int);   // libgomp, which libdnnl links

namespace ffi = xla::ffi;

namespace {

using jaxserve_cpu::bf16_to_f32;
using jaxserve_cpu::dims_str;
using jaxserve_cpu::f32_to_bf16;
using jaxserve_cpu::gemv;
using jaxserve_cpu::GemvSegment;
using jaxserve_cpu::kGemvKBlock;
using jaxserve_cpu::kMaxGemvRows;
using jaxserve_cpu::parallel_for;
using jaxserve_cpu::streaming_workers;
using jaxserve_cpu::transposed_gemv;


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

// GGUF's packed blocks (gemv_gguf.h): n weights of one format, each [L, out_i, bpr] uint8
// (bpr = in / 32 blocks of the format's bytes), read in place at `layer`; x quantized to 8
// bits per block once for all of them; results [T, out_i] float32. Any T: more than 8 rows
// run as 8-row tiles over each part's weight rows.
ffi::Error GgufMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                          ffi::Buffer<ffi::S32> layer_buf, ffi::RemainingArgs args,
                          ffi::RemainingRets results, int64_t fmt) {
  const auto xd = x.dimensions();
  const size_t n = results.size();
  if (xd.size() != 2 || layer_buf.element_count() != 1 || n == 0 || args.size() != n ||
      fmt < 0 || fmt >= jaxserve_cpu::kGgufFormats)
    return ffi::Error::InvalidArgument("gguf matmul: want x [T, in], layer [], n >= 1 packed "
                                       "weights [L, out_i, bytes] of format 0..5 and n results "
                                       "[T, out_i]; got x " + dims_str(xd));
  if (x.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("gguf matmul: x float32");
  const int64_t T = xd[0], in = xd[1];
  const int64_t per_block = jaxserve_cpu::gguf_block_weights(int(fmt));
  if (in % per_block != 0)
    return ffi::Error::InvalidArgument("gguf matmul: in (" + std::to_string(in) +
                                       ") is not a whole number of " +
                                       std::to_string(per_block) + "-weight blocks");
  const int64_t bpr = jaxserve_cpu::gguf_row_bytes(int(fmt), in);
  std::vector<jaxserve_cpu::GgufSegment> segs;
  int64_t rows = 0;
  bool no_layers = false;
  for (size_t i = 0; i < n; ++i) {
    auto w = args.get<ffi::AnyBuffer>(i);
    auto y = results.get<ffi::AnyBuffer>(i);
    if (w.has_error()) return w.error();
    if (y.has_error()) return y.error();
    const auto wd = w->dimensions(), yd = (*y)->dimensions();
    if (w->element_type() != ffi::DataType::U8 || wd.size() != 3 || wd[2] != bpr ||
        (*y)->element_type() != ffi::DataType::F32 || yd.size() != 2 || yd[0] != T ||
        yd[1] != wd[1])
      return ffi::Error::InvalidArgument("gguf matmul: weight " + std::to_string(i) + " " +
                                         dims_str(wd) + " / result " + dims_str(yd) +
                                         " do not fit x " + dims_str(xd) + " (uint8 [L, out, " +
                                         std::to_string(bpr) + "], float32 [T, out])");
    const int64_t L = wd[0], out = wd[1];
    no_layers = no_layers || L == 0;
    const int64_t layer = std::min<int64_t>(std::max<int64_t>(layer_buf.typed_data()[0], 0),
                                            std::max<int64_t>(L - 1, 0));
    segs.push_back({static_cast<const uint8_t*>(w->untyped_data()) + layer * out * bpr,
                    static_cast<float*>((*y)->untyped_data()), out});
    rows += out;
  }
  if (T == 0 || rows == 0) return ffi::Error::Success();
  if (no_layers || in == 0) {
    for (const auto& g : segs) std::memset(g.y, 0, size_t(T * g.out) * 4);
    return ffi::Error::Success();
  }
  thread_local jaxserve_cpu::GgufX xq;
  jaxserve_cpu::gguf_quantize_x(static_cast<const float*>(x.untyped_data()), T, in, &xq);
  const int64_t workers = streaming_workers(pool, rows * bpr * std::max<int64_t>(1, T / 8) / 4,
                                            rows);
  const int64_t parts = jaxserve_cpu::gguf_parts(workers, rows, T);
  const jaxserve_cpu::GgufX& xr = xq;
  parallel_for(pool, parts, workers, [&](int64_t part, int64_t) {
    jaxserve_cpu::gguf_run_part(int(fmt), segs, bpr, xr, T, rows, part, parts);
  });
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulGroup, MatmulGroupImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // x [T, in]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .RemainingArgs()               // weights (, scales)
                                  .RemainingRets()               // results [T, out_i]
                                  .Attr<int64_t>("group_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveGgufMatmul, GgufMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // x [T, in] float32
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .RemainingArgs()               // packed weights [L, out_i, bytes]
                                  .RemainingRets()               // results [T, out_i] float32
                                  .Attr<int64_t>("fmt"));        // 0 q8_0, 1 q4_0, 2 q4_1, 3 q4_K

