// Projections on weights prepacked once, at load, into the blocked layout oneDNN's own
// kernels read (vLLM-CPU's create_onednn_mm / onednn_mm do the same):
//
//   y[T, out] f32 = x[T, in] @ W[layer]      x and W bf16 (or both f32); W stored as
//                                            packed[L, bytes] uint8, read in place
//
// Why: handed plain [in, out] weights strided by the stacked layer (matmul.cc), oneDNN 3.2
// runs its older gemm:jit kernel, which converts the weight panels on every call; given the
// layout its brgemm kernel wants (bf16: "BA16a64b2a", 64-column panels of 16 input rows in
// VNNI pairs), it runs brg:avx512_core_bf16 / brg:avx512_core_amx straight on them. SmolLM2's
// seven bf16 projections per layer, 2-core AVX512-BF16 EPYC, in XLA's step
// (benchmarks/results/prepacked-matmul-bf16-epyc-avx512bf16-packed.json): 0.58 -> 0.40 ms
// at 16 rows, 1.01 -> 0.87 at 64, 0.27 at one (the streaming GEMV: 0.31). vLLM-CPU's own
// calls: 0.31 / 0.68; these kernels outside XLA: 0.28 / 0.66 -- the rest is the calls'
// thread-pool wake-ups.
//
// The layout: a 64-byte header (what the layer was packed as), then the output columns cut
// into `parts` ranges of whole 64-column blocks (two per worker of XLA's intra-op pool), each
// packed on its own, back to back at 64-byte aligned offsets. The layout oneDNN picks
// depends on the CPU (AMX and AVX512-BF16 block differently), so packing happens on the
// serving machine and is never stored in a checkpoint. A call runs each part single-threaded on its worker; the
// part's primitive is built for the call's row count with the part's packed descriptor.

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
extern "C" int omp_get_max_threads();

namespace ffi = xla::ffi;

namespace {

using dt = dnnl::memory::data_type;
using md = dnnl::memory::desc;
using jaxserve_cpu::dims_str;
using jaxserve_cpu::parallel_for;

constexpr int64_t kColumnAlign = 64;   // the matrix units' column blocking
constexpr int64_t kLayoutRows = 64;    // the row count the layout is asked for
constexpr int64_t kOffsetAlign = 64;   // bytes: each part starts on a cache line
constexpr int64_t kRowBlock = 256;     // rows per task of a call (bounds its dense buffer)

// Each packed layer starts with what it was packed as, checked by every call: the part
// boundaries follow the packing process's CPU count, and a layout read with other ones
// (an executable built for another count, weights packed elsewhere) would be silently
// wrong wherever the byte counts happen to agree.
struct Header {
  char magic[8];
  int64_t in, out, parts, dtype;
};
constexpr char kMagic[8] = {'j', 'x', 's', 'p', 'k', 'v', '1', '\0'};
constexpr int64_t kHeaderBytes = 64;
static_assert(sizeof(Header) <= kHeaderBytes, "the header fits its cache line");

Header header_of(int64_t in, int64_t out, int64_t parts, dt wt) {
  Header h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.in = in, h.out = out, h.parts = parts, h.dtype = static_cast<int64_t>(wt);
  return h;
}

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

// oneDNN's kernels pick their blocking (the packed layout too) for the OpenMP team size of
// the thread that builds them: every primitive here is built, and run, for a team of one,
// the size each pool worker runs it with, so the layout packed is the layout the call reads.
class OneThreadTeam {
 public:
  OneThreadTeam() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~OneThreadTeam() { omp_set_num_threads(saved_); }
 private:
  int saved_;
};

struct Part {
  int64_t c0, c1, offset;   // columns [c0, c1), bytes from the layer's start
  md w;                     // its packed descriptor
};

struct Layout {
  std::vector<Part> parts;
  int64_t bytes = 0;        // one layer
  bool blocked = false;     // oneDNN asked for a blocked layout (else packing buys nothing)
};

using LayoutKey = std::tuple<int64_t, int64_t, int64_t, dt>;   // in, out, parts, dtype

// The layout is asked for kLayoutRows rows, and a call of another row count runs on it as
// packed: where oneDNN would pick a kernel that cannot read it (another ISA's blocking for
// few rows, as AMX might), the only primitive left is its reference loop, ~100x slower.
// Weights are packed only where every row count a step has gets an optimized kernel.
bool optimized_at_every_row_count(int64_t in, int64_t cols, const md& w, dt wt) {
  for (int64_t rows : {int64_t(1), int64_t(8), int64_t(16), int64_t(512)}) {
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    dnnl::matmul::primitive_desc pd(cpu_engine(), md({rows, in}, wt, {in, 1}), w,
                                    md({rows, cols}, dt::f32, {cols, 1}), attr);
    if (std::string(pd.impl_info_str()).rfind("ref", 0) == 0) return false;
  }
  return true;
}

// What packing [in, out] weights into `parts` column ranges looks like on this CPU (cached).
const Layout& layout(int64_t in, int64_t out, int64_t parts, dt wt) {
  static std::mutex mu;
  static std::map<LayoutKey, Layout> cache;
  std::lock_guard<std::mutex> lock(mu);
  const LayoutKey key{in, out, parts, wt};
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  OneThreadTeam team;
  Layout l;
  l.blocked = true;
  l.bytes = kHeaderBytes;
  const int64_t blocks = (out + kColumnAlign - 1) / kColumnAlign;
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t c0 = std::min(out, blocks * p / parts * kColumnAlign);
    const int64_t c1 = std::min(out, blocks * (p + 1) / parts * kColumnAlign);
    if (c1 <= c0) continue;
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    dnnl::matmul::primitive_desc pd(
        cpu_engine(), md({kLayoutRows, in}, wt, {in, 1}),
        md({in, c1 - c0}, wt, dnnl::memory::format_tag::any),
        md({kLayoutRows, c1 - c0}, dt::f32, {c1 - c0, 1}), attr);
    const md w = pd.weights_desc();
    l.blocked = l.blocked && w.get_format_kind() == dnnl::memory::format_kind::blocked &&
                w.get_inner_nblks() > 0 && optimized_at_every_row_count(in, c1 - c0, w, wt);
    l.parts.push_back(Part{c0, c1, l.bytes, w});
    l.bytes += round_up(int64_t(w.get_size()), kOffsetAlign);
  }
  return cache.emplace(key, std::move(l)).first->second;
}

struct Prim {
  dnnl::matmul matmul;
  md x, w, y, scratch;
};

using PrimKey = std::tuple<int64_t, int64_t, int64_t, dt>;   // rows, in, cols, dtype

// The matmul of `rows` rows on one part's packed weights (cached; executed concurrently
// with caller-owned scratchpads). Its y is the part's own dense [rows, cols]: oneDNN 3.2's
// brgemm takes no row stride ("unsupported format tag", and the reference loop instead).
const Prim& primitive(int64_t rows, int64_t in, const Part& part, dt wt) {
  static std::mutex mu;
  static std::map<PrimKey, Prim> cache;
  std::lock_guard<std::mutex> lock(mu);
  const int64_t cols = part.c1 - part.c0;
  const PrimKey key{rows, in, cols, wt};
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  OneThreadTeam team;
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  const md x({rows, in}, wt, {in, 1}), y({rows, cols}, dt::f32, {cols, 1});
  dnnl::matmul::primitive_desc pd(cpu_engine(), x, part.w, y, attr);
  return cache.emplace(key, Prim{dnnl::matmul(pd), x, part.w, y, pd.scratchpad_desc()})
      .first->second;
}

// One part: its columns [c0, c1) of y ([rows, ldy]) through a dense buffer.
void run_part(const Prim& p, const void* x, const void* w, float* y, int64_t rows,
              int64_t cols, int64_t ldy) {
  thread_local bool single = (omp_set_num_threads(1), true);
  (void)single;
  thread_local std::vector<char> scratch;
  thread_local std::vector<float> dense;
  if (dense.size() < size_t(rows * cols)) dense.resize(size_t(rows * cols));
  const size_t need = p.scratch.get_size();
  if (scratch.size() < need) scratch.resize(need);
  dnnl::engine& e = cpu_engine();
  dnnl::stream s(e);
  dnnl::memory xm(p.x, e, const_cast<void*>(x)), wm(p.w, e, const_cast<void*>(w)),
      ym(p.y, e, dense.data()), sm(p.scratch, e, scratch.data());
  p.matmul.execute(s, {{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, ym},
                       {DNNL_ARG_SCRATCHPAD, sm}});
  s.wait();
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(y + r * ldy, dense.data() + r * cols, size_t(cols) * sizeof(float));
}

dt weight_dt(int32_t bf16) { return bf16 ? dt::bf16 : dt::f32; }

ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer packed,
                            ffi::Buffer<ffi::S32> layer_buf, ffi::Result<ffi::AnyBuffer> y,
                            int64_t parts) {
  const auto xd = x.dimensions(), pd = packed.dimensions(), yd = y->dimensions();
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  if (xd.size() != 2 || pd.size() != 2 || yd.size() != 2 || yd[0] != xd[0] ||
      packed.element_type() != ffi::DataType::U8 || y->element_type() != ffi::DataType::F32 ||
      (!bf16 && x.element_type() != ffi::DataType::F32) || layer_buf.element_count() != 1 ||
      parts < 1)
    return ffi::Error::InvalidArgument("packed matmul: want x [T, in] bfloat16 / float32, "
                                       "packed [L, bytes] uint8, layer [], y [T, out] float32, "
                                       "parts >= 1; got x " + dims_str(xd) + ", packed " +
                                       dims_str(pd) + ", y " + dims_str(yd));
  const int64_t T = xd[0], in = xd[1], out = yd[1], L = pd[0];
  if (T == 0 || out == 0) return ffi::Error::Success();
  if (in == 0 || L == 0) {
    std::memset(y->untyped_data(), 0, size_t(T * out) * 4);
    return ffi::Error::Success();
  }
  const dt wt = weight_dt(bf16);
  std::string error;
  try {
    const Layout& l = layout(in, out, parts, wt);
    if (l.bytes != pd[1])
      return ffi::Error::InvalidArgument(
          "packed matmul: " + std::to_string(pd[1]) + " bytes per layer, but [" +
          std::to_string(in) + ", " + std::to_string(out) + "] weights in " +
          std::to_string(parts) + " parts pack into " + std::to_string(l.bytes) +
          " here (packed on another CPU or for another shape?)");
    const int64_t layer = std::min<int64_t>(std::max<int64_t>(layer_buf.typed_data()[0], 0),
                                            L - 1);
    const char* W = static_cast<const char*>(packed.untyped_data()) + layer * l.bytes;
    const Header want = header_of(in, out, parts, wt);
    if (std::memcmp(W, &want, sizeof(Header)) != 0) {
      Header got;
      std::memcpy(&got, W, sizeof(Header));
      return ffi::Error::InvalidArgument(
          std::memcmp(got.magic, kMagic, sizeof(kMagic)) != 0
              ? std::string("packed matmul: layer ") + std::to_string(layer) +
                    " holds no packed weights"
              : "packed matmul: weights packed as [" + std::to_string(got.in) + ", " +
                    std::to_string(got.out) + "] in " + std::to_string(got.parts) +
                    " parts, read as [" + std::to_string(in) + ", " + std::to_string(out) +
                    "] in " + std::to_string(parts) + " (a step built for another CPU count " +
                    "or shape: the weights and the step must come from one process)");
    }
    const char* X = static_cast<const char*>(x.untyped_data());
    float* Y = static_cast<float*>(y->untyped_data());
    const int64_t n = int64_t(l.parts.size());
    int64_t workers = std::max<int64_t>(1, pool.num_threads());
    if (T * in * out < (int64_t(1) << 20)) workers = 1;   // waking a thread costs about this
    // Tasks: each column range times each block of at most kRowBlock rows (a prefill
    // chunk's or a long prompt's logits: the dense buffer stays a block's size).
    const int64_t blocks = (T + kRowBlock - 1) / kRowBlock, tail = T - (blocks - 1) * kRowBlock;
    std::vector<const Prim*> full, last;   // built here, not on a pool thread (they throw)
    for (const Part& part : l.parts) {
      full.push_back(blocks > 1 ? &primitive(kRowBlock, in, part, wt) : nullptr);
      last.push_back(&primitive(tail, in, part, wt));
    }
    const int64_t esize = bf16 ? 2 : 4;
    std::mutex mu;
    const int64_t tasks = n * blocks;
    parallel_for(pool, tasks, std::min(workers, tasks), [&](int64_t i, int64_t) {
      const int64_t p = i % n, b = i / n, r0 = b * kRowBlock;
      const Part& part = l.parts[size_t(p)];
      const bool is_last = b == blocks - 1;
      try {
        run_part(is_last ? *last[size_t(p)] : *full[size_t(p)], X + r0 * in * esize,
                 W + part.offset, Y + r0 * out + part.c0, is_last ? tail : kRowBlock,
                 part.c1 - part.c0, out);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu);
        error = e.what();
      }
    });
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!error.empty()) return ffi::Error(ffi::ErrorCode::kInternal, "packed matmul: " + error);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedMatmul, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // x [T, in]
                                  .Arg<ffi::AnyBuffer>()         // packed [L, bytes] uint8
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Ret<ffi::AnyBuffer>()         // y [T, out] float32
                                  .Attr<int64_t>("parts"));

// Bytes one layer of [in, out] weights (bf16 != 0: bfloat16, else float32) packs into, in
// `parts` column ranges; 0 where oneDNN keeps them plain here (nothing to gain: no bf16
// kernel, an AVX2 CPU's f32 gemm) or cannot say; -1 on an error.
extern "C" int64_t jaxserve_onednn_packed_bytes(int64_t in, int64_t out, int64_t parts,
                                                int32_t bf16) {
  const dt wt = weight_dt(bf16);
  if (in <= 0 || out <= 0 || parts < 1) return -1;
  try {
    const Layout& l = layout(in, out, parts, wt);
    return l.blocked ? l.bytes : 0;
  } catch (const dnnl::error&) {   // no matmul of this dtype here (bf16 on an AVX2 CPU)
    return 0;
  } catch (const std::exception&) {
    return -1;
  }
}

// Packs `layers` layers of plain [in, out] weights (row-major, back to back; transposed:
// [out, in], a tied embedding table) into `dst` (layers * jaxserve_onednn_packed_bytes
// bytes). 0 on success, -1 on an error.
extern "C" int32_t jaxserve_onednn_pack(const void* src, int64_t layers, int64_t in,
                                        int64_t out, int64_t parts, int32_t bf16,
                                        int32_t transposed, void* dst) {
  const dt wt = weight_dt(bf16);
  try {
    const Layout& l = layout(in, out, parts, wt);
    if (!l.blocked) return -1;
    const int64_t esize = bf16 ? 2 : 4;
    dnnl::engine& e = cpu_engine();
    dnnl::stream s(e);
    OneThreadTeam team;
    for (int64_t layer = 0; layer < layers; ++layer) {
      const char* w = static_cast<const char*>(src) + layer * in * out * esize;
      char* d = static_cast<char*>(dst) + layer * l.bytes;
      const Header h = header_of(in, out, parts, wt);
      std::memcpy(d, &h, sizeof(Header));
      for (const Part& part : l.parts) {
        const md plain = transposed ? md({in, part.c1 - part.c0}, wt, {1, in})
                                    : md({in, part.c1 - part.c0}, wt, {out, 1});
        dnnl::memory from(plain, e, const_cast<char*>(w + part.c0 * (transposed ? in : 1) *
                                                      esize));
        dnnl::memory to(part.w, e, d + part.offset);
        dnnl::reorder(from, to).execute(s, from, to);
      }
      s.wait();
    }
    return 0;
  } catch (const std::exception&) {
    return -1;
  }
}
