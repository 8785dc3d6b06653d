// Ragged paged attention for the XLA CPU backend, exposed through the XLA FFI
// (parallel_for.h, the loop on XLA's pool, is shared with jaxserve/kernels/cpu/matmul.cc).
//
// Same contract as pallas_kernels/reference.py::ragged_paged_attention_reference:
//   q               [T, Hq, D]                       f32 | bf16 | f16
//   k_cache/v_cache [num_blocks, block_size, Hkv, D] f32 | bf16 | f16 | s8 | f8e4m3fn (same)
//   k_scale/v_scale int8 [num_blocks, block_size, Hkv, 1] scale codes (2^(code/8)) of an
//                   s8 / f8e4m3fn cache, dequantized row by row; empty for float caches
//   kv_lens         int32[S], block_tables int32[S, max_blocks],
//   query_start_loc int32[S + 1], num_seqs int32[] (sequences >= num_seqs are padding),
//   sliding_window  int32[] (0 = off; an operand, not an attribute, so a per-layer window
//                   can be a traced value scanned over layers)
//   out             [T, Hq, D] in q's dtype; rows of tokens outside live sequences are 0.
// Attributes: sm_scale (f32), logits_soft_cap (f32, 0 = off),
//   max_threads (i64, 0 = XLA's intra-op pool; benchmarks pass 1 to time one core).
//
// Query token i of sequence s (q_len = qsl[s+1] - qsl[s]) has position
// kv_lens[s] - q_len + i and sees keys at positions <= it (and > it - sliding_window);
// keys past the block table's capacity (max_blocks * block_size) are never read
// (malformed input: the reference's result there depends on its chunking).
//
// Work is split into tasks (sequence, kv heads, block of query tokens). A task keeps
// all `group` query heads of each of its kv heads (x its query tokens) as rows, walks
// the sequence's pages named by the block table (only those: the cache is read in
// place, never copied) and runs an online softmax in float32, so each K/V row is read
// once per task. Decode batches (one-token blocks, >= 8 of them) give a task every kv
// head of its sequence, so it reads whole pages; otherwise a task has one kv head.
// Tasks run on XLA's intra-op thread pool (the caller works too, so a busy pool
// never deadlocks), biggest first.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "attention_simd.h"
#include "element_types.h"
#include "parallel_for.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxserve_cpu::elements;  // bf16_t, to_f32, from_f32, dtype_size ...
using jaxserve_cpu::dims_str;
using jaxserve_cpu::parallel_for;
using jaxserve_cpu::streaming_workers;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------
// Vectorizable exp and tanh (Cephes-style, ~1-2 ulp in float32).
// ---------------------------------------------------------------------------

inline float exp_f32(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f - n * -2.12194440e-4f;
  const float z = r * r;
  const float y = (((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r +
                     4.1665795894e-2f) * r + 1.6666665459e-1f) * r + 5.0000001201e-1f) * z +
                  r + 1.0f;
  const int32_t e = int32_t(n) + 127;  // in [1, 254] after the clamp
  return y * bits_to_f32(uint32_t(e) << 23);
}

inline float tanh_f32(float x) {
  const float a = std::fabs(x);
  const float s = x * x;
  const float small = ((((-5.70498872745e-3f * s + 2.06390887954e-2f) * s - 5.37397155531e-2f) * s +
                        1.33314422036e-1f) * s - 3.33332819422e-1f) * s * x + x;
  const float big = std::copysign(1.0f - 2.0f / (exp_f32(a + a) + 1.0f), x);
  return a < 0.625f ? small : big;
}

// ---------------------------------------------------------------------------
// The problem and its tasks.
// ---------------------------------------------------------------------------

struct Problem {
  int64_t T, Hq, D, num_blocks, block_size, Hkv, S, max_blocks, group;
  float scale, cap;
  int64_t window;
  const int32_t* kv_lens;
  const int32_t* block_tables;
  const int32_t* qsl;
  // int8 / fp8 caches: one scale code per (slot, kv head) [num_blocks * block_size * Hkv];
  // null for float caches.
  const int8_t* k_scale = nullptr;
  const int8_t* v_scale = nullptr;
  // bf16 q and cache, D a multiple of 2W, and AVX512-BF16: K / V rows read in place as
  // bf16 (Bf16Rows) instead of converted to float32 first.
  bool bf16_dot = false;
  // Ask for the next tile's rows ahead (attend_simd): when the call reads enough that a
  // step's layers together outgrow the last-level cache (kPrefetchMinBytes).
  bool prefetch = false;
};

// A call reading less than this (K + V rows, all tasks) does not prefetch: ~30 layers of
// such calls stay within a 32 MB L3 between steps, and there the prefetches only cost (a
// 1-sequence, 256-token float32 call took 0.019 ms with them against 0.017 without).
constexpr int64_t kPrefetchMinBytes = int64_t(1) << 20;

// Query tokens [t0, t1) of sequence `seq`, kv heads [h0, h1). Rows are ordered
// (kv head, token, group member): row = (h - h0) * rows_per_head + ti * group + g.
struct Task {
  int32_t seq, h0, h1, t0, t1;
  int64_t pos0;            // position of token t0
  int64_t key_lo, key_hi;  // keys [key_lo, key_hi) can be visible
  int64_t cost;
};

// Rows per head of a task (q tokens x group heads) x D: the f32 accumulator stays in L1/L2.
constexpr int64_t kMaxRowElems = 4096;

using namespace jaxserve_cpu::simd;  // W, vf, transpose_sum, vexp ... (attention_simd.h)

// ---------------------------------------------------------------------------
// Per-task scratch and the q / output row conversions (q's dtype is a runtime switch:
// rows are few, the K/V loop is where the time goes).
// ---------------------------------------------------------------------------

struct Scratch {
  std::vector<float> q, acc, m, l, k, v, zero;
  std::vector<uint16_t> qh, zero_h;   // the bf16 in-place path's q (unscaled) and zero row
  std::vector<int64_t> pos;
  void reserve(int64_t rows, int64_t D) {
    q.resize(rows * D); acc.resize(rows * D); m.resize(rows); l.resize(rows);
    k.resize(W * D); v.resize(W * D); zero.assign(D, 0.0f); pos.resize(rows);
    qh.resize(rows * D); zero_h.assign(D, 0);
  }
};

// Bf16Rows accumulates each 2W block of a row as its W even-indexed values, then its W odd
// ones: back to index order, for `rows` rows of D.
inline void unpermute_even_odd(Scratch& sc, int64_t rows, int64_t D) {
  float tmp[2 * W];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < D; c += 2 * W) {
      float* a = sc.acc.data() + r * D + c;
      for (int i = 0; i < W; ++i) { tmp[2 * i] = a[i]; tmp[2 * i + 1] = a[W + i]; }
      std::memcpy(a, tmp, sizeof(tmp));
    }
}

struct QOut {
  const void* q;
  void* out;
  ffi::DataType dtype;
};

template <typename QT>
void load_q_typed(const Problem& p, const Task& t, const QT* q, Scratch& sc) {
  const int64_t G = p.group, D = p.D, rows_per_head = (t.t1 - t.t0) * G;
  for (int64_t h = t.h0; h < t.h1; ++h)
    for (int64_t ti = 0; ti < t.t1 - t.t0; ++ti)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = (h - t.h0) * rows_per_head + ti * G + g;
        const QT* src = q + ((t.t0 + ti) * p.Hq + h * G + g) * D;
        if (std::is_same_v<QT, bf16_t> && p.bf16_dot) {   // Bf16Rows: scaled after q.k
          if constexpr (std::is_same_v<QT, bf16_t>)
            for (int64_t d = 0; d < D; ++d) sc.qh[r * D + d] = src[d].bits;
        } else {
          for (int64_t d = 0; d < D; ++d) sc.q[r * D + d] = to_f32(src[d]) * p.scale;
        }
        sc.pos[r] = t.pos0 + ti;
        sc.m[r] = kNegInf;
        sc.l[r] = 0.0f;
      }
  std::fill(sc.acc.begin(), sc.acc.begin() + (t.h1 - t.h0) * rows_per_head * D, 0.0f);
}

template <typename QT>
void store_out_typed(const Problem& p, const Task& t, QT* out, const Scratch& sc) {
  const int64_t G = p.group, D = p.D, rows_per_head = (t.t1 - t.t0) * G;
  for (int64_t h = t.h0; h < t.h1; ++h)
    for (int64_t ti = 0; ti < t.t1 - t.t0; ++ti)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = (h - t.h0) * rows_per_head + ti * G + g;
        QT* dst = out + ((t.t0 + ti) * p.Hq + h * G + g) * D;
        const float denom = sc.l[r] > 0.0f ? sc.l[r] : 1.0f;  // no visible key: acc is 0
        for (int64_t d = 0; d < D; ++d) dst[d] = from_f32<QT>(sc.acc[r * D + d] / denom);
      }
}

void load_q(const Problem& p, const Task& t, const QOut& io, Scratch& sc) {
  switch (io.dtype) {
    case ffi::DataType::BF16: return load_q_typed(p, t, static_cast<const bf16_t*>(io.q), sc);
    case ffi::DataType::F16: return load_q_typed(p, t, static_cast<const f16_t*>(io.q), sc);
    default: return load_q_typed(p, t, static_cast<const float*>(io.q), sc);
  }
}

void store_out(const Problem& p, const Task& t, const QOut& io, const Scratch& sc) {
  switch (io.dtype) {
    case ffi::DataType::BF16: return store_out_typed(p, t, static_cast<bf16_t*>(io.out), sc);
    case ffi::DataType::F16: return store_out_typed(p, t, static_cast<f16_t*>(io.out), sc);
    default: return store_out_typed(p, t, static_cast<float*>(io.out), sc);
  }
}

// Cache slot (page * block_size + row) of key `key` of a sequence, through its table.
inline int64_t key_slot(const Problem& p, const int32_t* table, int64_t key) {
  const int64_t page =
      std::min<int64_t>(std::max<int64_t>(table[key / p.block_size], 0), p.num_blocks - 1);
  return page * p.block_size + key % p.block_size;
}

// One cache row (a slot's kv head) as f32: f32 caches are read in place, others are
// converted into `buf`; quantized (int8 / fp8) rows are dequantized with their scale.
template <typename KV>
inline const float* cache_row(const KV* cache, const Problem& p, int64_t slot, int64_t head,
                              float* buf, const int8_t* scales) {
  const KV* src = cache + (slot * p.Hkv + head) * p.D;
  if constexpr (std::is_same_v<KV, float>) {
    return src;
  } else if constexpr (std::is_same_v<KV, int8_t> || std::is_same_v<KV, f8e4m3_t>) {
    const float s = decode_scale(scales[slot * p.Hkv + head]);
    const vf sv = splat(s);
    int64_t d = 0;
    // int8: the plain loop below (GCC vectorizes it); fp8: W values at a time by hand
    for (; std::is_same_v<KV, f8e4m3_t> && d + W <= p.D; d += W) {
      if constexpr (std::is_same_v<KV, f8e4m3_t>) {
        // e4m3fn bits -> f32 bits: a normal value's exponent+mantissa move into place,
        // rebiased (+120); exponent 0 is subnormal, m * 2^-9 (NaN is never stored).
        vb x;
        std::memcpy(&x, src + d, sizeof(x));
        const vi b = __builtin_convertvector(x, vi);
        const vi em = b & 0x7f, sign = (b & 0x80) << 24;
        const vi normal = sign | ((em + (120 << 3)) << 20);
        const vi sub = sign | (vi)(__builtin_convertvector(em, vf) * 0.001953125f);
        storeu(buf + d, (vf)(em < 8 ? sub : normal) * sv);
      }
    }
    for (; d < p.D; ++d) buf[d] = to_f32(src[d]) * s;
    return buf;
  } else {
    if constexpr (std::is_same_v<KV, bf16_t>) {
      int64_t d = 0;
      for (; d + W <= p.D; d += W) {
        vh h;
        std::memcpy(&h, src + d, sizeof(h));
        const vi bits = __builtin_convertvector(h, vi) << 16;
        storeu(buf + d, (vf)(bits));
      }
      for (; d < p.D; ++d) buf[d] = to_f32(src[d]);
    } else {
      for (int64_t d = 0; d < p.D; ++d) buf[d] = to_f32(src[d]);
    }
    return buf;
  }
}

// ---------------------------------------------------------------------------
// SIMD attention of one task, D = ND * W. Keys go in tiles of W (any block size: a
// tile may span pages or part of one). Rows go in blocks of NB (the group's heads of
// a decode token are one block) so their independent dependency chains interleave:
// per tile and row, W logits at once (W dot products reduced by one transpose-sum),
// masked, one online-softmax step; then acc += p V for all NB rows with each V row
// loaded once and the accumulators in registers. How a tile's K and V rows are read is
// the `Rows` policy: float rows (F32Rows, any cache dtype converted first) or bf16 rows
// read in place (Bf16Rows, AVX512-BF16).
// ---------------------------------------------------------------------------

// K / V rows as float32 (a float cache in place, others converted into scratch).
template <int ND>
struct F32Rows {
  static constexpr int64_t D = int64_t(ND) * W;
  const float* const* k;
  const float* const* v;

  // s[b] = the W logits of row r0 + b (q already scaled).
  template <int NB>
  void scores(const Problem&, const Scratch& sc, int64_t r0, vf* s) const {
    for (int b = 0; b < NB; ++b) {
      const float* qr = sc.q.data() + (r0 + b) * D;
      vf qv[ND];
      for (int c = 0; c < ND; ++c) qv[c] = loadu(qr + c * W);
      vf part[W];
      for (int j = 0; j < W; ++j) {
        vf a = qv[0] * loadu(k[j]);
        for (int c = 1; c < ND; ++c) a += qv[c] * loadu(k[j] + c * W);
        part[j] = a;
      }
      s[b] = transpose_sum(part);
    }
  }

  // acc[b] += w[b] * V row j, for the NB rows.
  template <int NB>
  void accumulate(int64_t j, const float (*w)[W], vf (*acc)[ND]) const {
    for (int c = 0; c < ND; ++c) {
      const vf vc = loadu(v[j] + c * W);
      for (int b = 0; b < NB; ++b) acc[b][c] += w[b][j] * vc;
    }
  }
};

// bf16 K / V rows read in place from the cache (no conversion pass): q . k with bf16 pair
// dot products (exact products, float32 sums), then * scale; p V in float32 with each V
// row split into its even- and odd-indexed values, so the accumulator holds a row's
// values in that order within each 2W block (unpermute_even_odd puts them back).
template <int ND>
struct Bf16Rows {
  static_assert(ND % 2 == 0, "bf16 rows go 2W values per vector");
  static constexpr int64_t D = int64_t(ND) * W;
  const uint16_t* const* k;
  const uint16_t* const* v;

  template <int NB>
  void scores(const Problem& p, const Scratch& sc, int64_t r0, vf* s) const {
    for (int b = 0; b < NB; ++b) {
      const uint16_t* qr = sc.qh.data() + (r0 + b) * D;
      vf part[W];
      for (int j = 0; j < W; ++j) {
        vf a = dot_bf16(vf{}, qr, k[j]);
        for (int c = 2; c < ND; c += 2) a = dot_bf16(a, qr + c * W, k[j] + c * W);
        part[j] = a;
      }
      s[b] = transpose_sum(part) * p.scale;
    }
  }

  template <int NB>
  void accumulate(int64_t j, const float (*w)[W], vf (*acc)[ND]) const {
    for (int c = 0; c < ND; c += 2) {
      vf even, odd;
      load_bf16_even_odd(v[j] + c * W, &even, &odd);
      for (int b = 0; b < NB; ++b) {
        acc[b][c] += w[b][j] * even;
        acc[b][c + 1] += w[b][j] * odd;
      }
    }
  }
};

template <int ND, int NB, typename Rows>
inline void tile_rows(const Problem& p, Scratch& sc, int64_t r0, int64_t kt, int64_t first,
                      int64_t end, const Rows& rows, vi key_pos) {
  constexpr int64_t D = int64_t(ND) * W;
  int64_t lo[NB], hi[NB];
  int64_t jlo = W, jhi = 0;
  for (int b = 0; b < NB; ++b) {
    const int64_t pr = sc.pos[r0 + b];
    lo[b] = p.window > 0 ? std::max(first, pr - p.window + 1) : first;
    hi[b] = std::min(end, pr + 1);
    if (hi[b] > lo[b]) {
      jlo = std::min(jlo, lo[b] - kt);
      jhi = std::max(jhi, hi[b] - kt);
    } else {
      lo[b] = hi[b] = 0;  // nothing visible in this tile
    }
  }
  if (jhi <= jlo) return;

  vf s[NB];
  rows.template scores<NB>(p, sc, r0, s);
  if (p.cap > 0.0f)
    for (int b = 0; b < NB; ++b) s[b] = p.cap * vtanh(s[b] / p.cap);

  alignas(64) float pbuf[NB][W];
  float corr[NB];
  for (int b = 0; b < NB; ++b) {
    const vi visible = (key_pos >= int32_t(lo[b])) & (key_pos < int32_t(hi[b]));
    const vf sb = vselect(visible, s[b], splat(kNegInf));
    float& m = sc.m[r0 + b];
    float& l = sc.l[r0 + b];
    const float m_new = std::max(m, hmax(sb));
    // m_old == -inf: acc and l are still 0, any finite factor will do.
    corr[b] = (m_new > m && m != kNegInf) ? exp_f32(m - m_new) : 1.0f;
    const vf pv = vselect(visible, vexp(sb - (m_new == kNegInf ? 0.0f : m_new)), vf{});
    storeu(pbuf[b], pv);
    l = l * corr[b] + hsum(pv);
    m = m_new;
  }

  vf acc[NB][ND];
  for (int b = 0; b < NB; ++b) {
    const float* ar = sc.acc.data() + (r0 + b) * D;
    for (int c = 0; c < ND; ++c) acc[b][c] = loadu(ar + c * W) * corr[b];
  }
  // Keys in [jlo, jhi) are real (visible to some row), so p = 0 rows add exact zeros.
  for (int64_t j = jlo; j < jhi; ++j) rows.template accumulate<NB>(j, pbuf, acc);
  for (int b = 0; b < NB; ++b) {
    float* ar = sc.acc.data() + (r0 + b) * D;
    for (int c = 0; c < ND; ++c) storeu(ar + c * W, acc[b][c]);
  }
}

// Most rows per block: NB x ND accumulators (+ a V chunk) must fit the 32 (or 16) registers.
template <int ND>
constexpr int kMaxRowBlock = W == 16 ? (ND <= 4 ? 4 : ND == 8 ? 3 : 1) : (ND <= 2 ? 4 : ND == 4 ? 2 : 1);

// One row block's tile through the Rows policy, NB = nb rows (nb <= NBmax).
template <int ND, int NBmax, typename Rows>
inline void tile_row_block(const Problem& p, Scratch& sc, int64_t nb, int64_t r0, int64_t kt,
                           int64_t first, int64_t end, const Rows& rows, vi key_pos) {
  switch (nb) {
    case 4: if constexpr (NBmax >= 4) tile_rows<ND, 4>(p, sc, r0, kt, first, end, rows, key_pos); break;
    case 3: if constexpr (NBmax >= 3) tile_rows<ND, 3>(p, sc, r0, kt, first, end, rows, key_pos); break;
    case 2: if constexpr (NBmax >= 2) tile_rows<ND, 2>(p, sc, r0, kt, first, end, rows, key_pos); break;
    default: tile_rows<ND, 1>(p, sc, r0, kt, first, end, rows, key_pos); break;
  }
}

// Bf16InPlace: a bf16 cache and bf16 q on a CPU with AVX512-BF16 (Problem::bf16_dot):
// rows are read in place as bf16 (Bf16Rows); otherwise converted to float32 (F32Rows).
template <typename KV, int ND, bool Bf16InPlace>
void attend_simd(const Problem& p, const Task& t, const KV* k_cache, const KV* v_cache,
                 Scratch& sc) {
  constexpr int64_t D = int64_t(ND) * W;
  constexpr int NBmax = kMaxRowBlock<ND>;
  using Row = std::conditional_t<Bf16InPlace, const uint16_t*, const float*>;
  const int64_t R = (t.t1 - t.t0) * p.group;  // rows per kv head
  const int32_t* table = p.block_tables + int64_t(t.seq) * p.max_blocks;
  int64_t slot[W];
  Row krow[W];
  Row vrow[W];

  for (int64_t kt = (t.key_lo / W) * W; kt < t.key_hi; kt += W) {
    const int64_t first = std::max(kt, t.key_lo), end = std::min(kt + W, t.key_hi);
    for (int64_t i = 0; i < W; ++i)
      slot[i] = (kt + i < first || kt + i >= end) ? -1 : key_slot(p, table, kt + i);
    const vi key_pos = kIota + int32_t(kt);  // positions fit int32 (kv_lens are int32)
    // The next tile's K and V rows, asked of the memory system now, one head's per head
    // step below: a sequence's pages are scattered, so the hardware prefetcher is untrained
    // at each new page and a tile's loads would wait on DRAM. A 50 MB decode call reads 1.7x
    // faster so (cpu-attention-bf16-in-place-*.md); every head's rows in one burst filled
    // the miss buffers and gained nothing; and this same loop as a helper function measured
    // 3.2 ms against 2.3 inline (GCC 12.2, 64 x 1024 bf16), for reasons not yet understood.
    const int64_t next = kt + W;
    int64_t next_slot[W];
    const bool ahead = p.prefetch && next < t.key_hi;
    if (ahead)
      for (int64_t i = 0; i < W; ++i)
        next_slot[i] = next + i < t.key_hi ? key_slot(p, table, next + i) : -1;
    for (int64_t h = t.h0; h < t.h1; ++h) {
      if (ahead)
        for (int64_t i = 0; i < W; ++i)
          if (next_slot[i] >= 0) {
            const char* kb = reinterpret_cast<const char*>(k_cache + (next_slot[i] * p.Hkv + h) * D);
            const char* vb = reinterpret_cast<const char*>(v_cache + (next_slot[i] * p.Hkv + h) * D);
            for (int64_t off = 0; off < D * int64_t(sizeof(KV)); off += 64) {
              __builtin_prefetch(kb + off);
              __builtin_prefetch(vb + off);
            }
          }
      for (int64_t i = 0; i < W; ++i) {
        if constexpr (Bf16InPlace) {
          const int64_t at = (slot[i] * p.Hkv + h) * D;
          krow[i] = slot[i] < 0 ? sc.zero_h.data() : &k_cache[at].bits;
          vrow[i] = slot[i] < 0 ? sc.zero_h.data() : &v_cache[at].bits;
        } else if (slot[i] < 0) {
          krow[i] = vrow[i] = sc.zero.data();
        } else {
          krow[i] = cache_row(k_cache, p, slot[i], h, sc.k.data() + i * D, p.k_scale);
          vrow[i] = cache_row(v_cache, p, slot[i], h, sc.v.data() + i * D, p.v_scale);
        }
      }
      using Rows = std::conditional_t<Bf16InPlace, Bf16Rows<ND>, F32Rows<ND>>;
      const Rows rows{krow, vrow};
      const int64_t base = (h - t.h0) * R;
      for (int64_t r = 0; r < R;) {
        const int64_t nb = std::min<int64_t>(NBmax, R - r);
        tile_row_block<ND, NBmax>(p, sc, nb, base + r, kt, first, end, rows, key_pos);
        r += nb;
      }
    }
  }
  if constexpr (Bf16InPlace) unpermute_even_odd(sc, (t.h1 - t.h0) * R, D);
}

// Scalar attention of one task, any D (the fallback for D not a multiple of W).
template <typename KV>
void attend_scalar(const Problem& p, const Task& t, const KV* k_cache, const KV* v_cache,
                   Scratch& sc) {
  const int64_t D = p.D;
  const int64_t R = (t.t1 - t.t0) * p.group;  // rows per kv head
  const int32_t* table = p.block_tables + int64_t(t.seq) * p.max_blocks;
  for (int64_t key = t.key_lo; key < t.key_hi; ++key) {
    const int64_t slot = key_slot(p, table, key);
    for (int64_t h = t.h0; h < t.h1; ++h) {
      const float* k = cache_row(k_cache, p, slot, h, sc.k.data(), p.k_scale);
      const float* v = cache_row(v_cache, p, slot, h, sc.v.data(), p.v_scale);
      for (int64_t r = (h - t.h0) * R; r < (h - t.h0 + 1) * R; ++r) {
        const int64_t pr = sc.pos[r];
        if (key > pr || (p.window > 0 && pr - key >= p.window)) continue;
        const float* qr = sc.q.data() + r * D;
        float s = 0.0f;
        for (int64_t d = 0; d < D; ++d) s += qr[d] * k[d];
        if (p.cap > 0.0f) s = p.cap * tanh_f32(s / p.cap);
        const float m_old = sc.m[r];
        const float m_new = std::max(m_old, s);
        float* ar = sc.acc.data() + r * D;
        if (m_new != m_old) {
          const float corr = m_old == kNegInf ? 0.0f : exp_f32(m_old - m_new);
          sc.l[r] *= corr;
          for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
          sc.m[r] = m_new;
        }
        const float e = exp_f32(s - m_new);
        sc.l[r] += e;
        for (int64_t d = 0; d < D; ++d) ar[d] += e * v[d];
      }
    }
  }
}

template <typename KV, int ND>
void attend(const Problem& p, const Task& t, const KV* k, const KV* v, Scratch& sc) {
  if constexpr (std::is_same_v<KV, bf16_t> && kBf16Dot) {
    if (p.bf16_dot) return attend_simd<KV, ND, true>(p, t, k, v, sc);
  }
  attend_simd<KV, ND, false>(p, t, k, v, sc);
}

template <typename KV>
void run_task(const Problem& p, const Task& t, const KV* k, const KV* v, const QOut& io,
              Scratch& sc) {
  load_q(p, t, io, sc);
  switch (p.D) {
    case 1 * W: attend_simd<KV, 1, false>(p, t, k, v, sc); break;
    case 2 * W: attend<KV, 2>(p, t, k, v, sc); break;
    case 4 * W: attend<KV, 4>(p, t, k, v, sc); break;
    case 8 * W: attend<KV, 8>(p, t, k, v, sc); break;
    case 16 * W: attend<KV, 16>(p, t, k, v, sc); break;
    default: attend_scalar<KV>(p, t, k, v, sc); break;
  }
  store_out(p, t, io, sc);
}

template <typename KV>
void run_all(const Problem& p, const std::vector<Task>& tasks, const QOut& io, const void* k,
             const void* v, ffi::ThreadPool& pool, int64_t total_cost, int64_t max_threads) {
  int64_t rows_max = 0;
  for (const Task& t : tasks) rows_max = std::max<int64_t>(rows_max, (t.h1 - t.h0) * (t.t1 - t.t0));
  rows_max = std::max<int64_t>(rows_max * p.group, 1);
  int64_t workers = std::max<int64_t>(1, pool.num_threads());
  if (max_threads > 0) workers = std::min(workers, max_threads);
  // Below ~2M multiply-adds (~0.1 ms on one core) waking a second thread costs about
  // what it saves.
  if (total_cost * p.D < (int64_t(1) << 21)) workers = 1;
  workers = std::max<int64_t>(1, std::min<int64_t>(workers, int64_t(tasks.size())));
  std::vector<Scratch> scratch(workers);
  for (auto& sc : scratch) sc.reserve(rows_max, p.D);
  parallel_for(pool, int64_t(tasks.size()), workers, [&](int64_t i, int64_t w) {
    run_task<KV>(p, tasks[i], static_cast<const KV*>(k), static_cast<const KV*>(v), io,
                 scratch[w]);
  });
}

// The tasks of one call, biggest first (dynamic scheduling then balances well). Marks
// the tokens of live sequences in `covered`; total_cost sums key x row pairs.
std::vector<Task> make_tasks(const Problem& p, int64_t num_seqs, std::vector<char>* covered,
                             int64_t* total_cost) {
  const int64_t key_cap = p.max_blocks * p.block_size;  // keys beyond the table are never seen
  const int64_t max_tok = std::max<int64_t>(1, kMaxRowElems / (p.group * p.D));

  // Decode-sized query blocks (one token) of many sequences take all kv heads per task:
  // a key's rows of all heads are adjacent in the cache, so a task then reads its pages
  // contiguously. Otherwise (prefill, or too few tasks to share out) one head per task.
  int64_t num_units = 0, max_block_tokens = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(p.qsl[s + 1], p.T) -
                                               std::max<int64_t>(p.qsl[s], 0));
    num_units += (n + max_tok - 1) / max_tok;
    max_block_tokens = std::max(max_block_tokens, std::min(n, max_tok));
  }
  const int64_t heads_per_task = (max_block_tokens <= 1 && num_units >= 8) ? p.Hkv : 1;

  covered->assign(p.T, 0);
  std::vector<Task> tasks;
  *total_cost = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t start = p.qsl[s], end = p.qsl[s + 1];
    const int64_t t_lo = std::max<int64_t>(start, 0), t_hi = std::min<int64_t>(end, p.T);
    if (t_hi <= t_lo) continue;
    const int64_t offset = int64_t(p.kv_lens[s]) - end;  // position(t) = t + offset
    for (int64_t t = t_lo; t < t_hi; ++t) (*covered)[t] = 1;
    for (int64_t t0 = t_lo; t0 < t_hi; t0 += max_tok) {
      const int64_t t1 = std::min(t0 + max_tok, t_hi);
      const int64_t pos_lo = t0 + offset, pos_hi = t1 - 1 + offset;
      int64_t key_hi = std::min(pos_hi + 1, key_cap);
      int64_t key_lo = p.window > 0 ? std::max<int64_t>(0, pos_lo - p.window + 1) : 0;
      if (key_hi <= key_lo) key_lo = key_hi = 0;  // nothing visible: rows are 0
      const int64_t cost =
          std::max<int64_t>(key_hi - key_lo, 0) * (t1 - t0) * p.group * heads_per_task;
      for (int64_t h = 0; h < p.Hkv; h += heads_per_task) {
        // A task with no visible key still runs: it writes its rows as 0.
        tasks.push_back({int32_t(s), int32_t(h), int32_t(std::min(h + heads_per_task, p.Hkv)),
                         int32_t(t0), int32_t(t1), pos_lo, key_lo, key_hi, cost});
        *total_cost += cost;
      }
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.cost > b.cost; });
  return tasks;
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                              ffi::AnyBuffer v_cache, ffi::AnyBuffer k_scale,
                              ffi::AnyBuffer v_scale, ffi::Buffer<ffi::S32> kv_lens,
                              ffi::Buffer<ffi::S32> block_tables,
                              ffi::Buffer<ffi::S32> query_start_loc,
                              ffi::Buffer<ffi::S32> num_seqs_buf,
                              ffi::Buffer<ffi::S32> sliding_window_buf,
                              ffi::Result<ffi::AnyBuffer> out, float sm_scale,
                              float logits_soft_cap, int64_t max_threads) {
  const auto qd = q.dimensions(), kd = k_cache.dimensions(), vd = v_cache.dimensions();
  const auto btd = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || dims_str(kd) != dims_str(vd))
    return ffi::Error::InvalidArgument("paged_attention: want q [T, Hq, D] and k/v caches "
                                       "[num_blocks, block_size, Hkv, D] of one shape; got q " +
                                       dims_str(qd) + ", k " + dims_str(kd) + ", v " + dims_str(vd));
  if (kd[3] != qd[2] || kd[2] <= 0 || qd[1] % kd[2] != 0)
    return ffi::Error::InvalidArgument("paged_attention: head_dim or heads mismatch: q " +
                                       dims_str(qd) + ", k " + dims_str(kd));
  if (k_cache.element_type() != v_cache.element_type() || dtype_size(k_cache.element_type()) == 0)
    return ffi::Error::InvalidArgument("paged_attention: k/v caches must share a dtype "
                                       "(float32, bfloat16, float16, int8 or float8_e4m3fn)");
  const bool quantized = dtype_size(k_cache.element_type()) == 1;
  const size_t scale_count = quantized ? size_t(kd[0] * kd[1] * kd[2]) : 0;
  if (k_scale.element_type() != ffi::DataType::S8 || v_scale.element_type() != ffi::DataType::S8 ||
      k_scale.element_count() != scale_count || v_scale.element_count() != scale_count)
    return ffi::Error::InvalidArgument("paged_attention: int8 / fp8 caches need int8 scale "
                                       "codes [num_blocks, block_size, Hkv, 1] for k and v "
                                       "(empty for float caches)");
  if (out->element_type() != q.element_type() || dims_str(out->dimensions()) != dims_str(qd))
    return ffi::Error::InvalidArgument("paged_attention: output must match q");
  if (btd.size() != 2 || kv_lens.element_count() != size_t(btd[0]) ||
      query_start_loc.element_count() != size_t(btd[0]) + 1 || num_seqs_buf.element_count() != 1 ||
      sliding_window_buf.element_count() != 1)
    return ffi::Error::InvalidArgument("paged_attention: want kv_lens [S], block_tables [S, W], "
                                       "query_start_loc [S+1], num_seqs [], sliding_window []");

  Problem p;
  p.T = qd[0]; p.Hq = qd[1]; p.D = qd[2];
  p.num_blocks = kd[0]; p.block_size = kd[1]; p.Hkv = kd[2];
  p.S = btd[0]; p.max_blocks = btd[1];
  p.group = p.Hq / p.Hkv;
  p.scale = sm_scale; p.cap = logits_soft_cap; p.window = std::max<int64_t>(sliding_window_buf.typed_data()[0], 0);
  p.kv_lens = kv_lens.typed_data();
  p.block_tables = block_tables.typed_data();
  p.qsl = query_start_loc.typed_data();
  p.bf16_dot = kBf16Dot && q.element_type() == ffi::DataType::BF16 &&
               k_cache.element_type() == ffi::DataType::BF16 && p.D % (2 * W) == 0;
  if (quantized) {
    p.k_scale = static_cast<const int8_t*>(k_scale.untyped_data());
    p.v_scale = static_cast<const int8_t*>(v_scale.untyped_data());
  }

  const size_t row_bytes = size_t(p.Hq * p.D) * dtype_size(q.element_type());
  if (dtype_size(q.element_type()) < 2)
    return ffi::Error::InvalidArgument("paged_attention: q must be float32, bfloat16 or float16");
  char* out_bytes = static_cast<char*>(out->untyped_data());
  if (p.T == 0 || p.Hq == 0 || p.D == 0) return ffi::Error::Success();

  const int64_t num_seqs = std::min<int64_t>(std::max<int64_t>(num_seqs_buf.typed_data()[0], 0), p.S);
  std::vector<char> covered;
  int64_t total_cost = 0;
  std::vector<Task> tasks = make_tasks(p, num_seqs, &covered, &total_cost);
  int64_t read_bytes = 0;
  for (const Task& t : tasks)
    read_bytes += (t.key_hi - t.key_lo) * (t.h1 - t.h0) * p.D * 2 *
                  int64_t(dtype_size(k_cache.element_type()));
  p.prefetch = read_bytes >= kPrefetchMinBytes;
  for (int64_t t = 0; t < p.T; ++t)
    if (!covered[t]) std::memset(out_bytes + t * row_bytes, 0, row_bytes);

  const QOut io{q.untyped_data(), out_bytes, q.element_type()};
  const void* kp = k_cache.untyped_data();
  const void* vp = v_cache.untyped_data();
  switch (k_cache.element_type()) {
    case ffi::DataType::F32: run_all<float>(p, tasks, io, kp, vp, pool, total_cost, max_threads); break;
    case ffi::DataType::BF16: run_all<bf16_t>(p, tasks, io, kp, vp, pool, total_cost, max_threads); break;
    case ffi::DataType::S8: run_all<int8_t>(p, tasks, io, kp, vp, pool, total_cost, max_threads); break;
    case ffi::DataType::F8E4M3FN: run_all<f8e4m3_t>(p, tasks, io, kp, vp, pool, total_cost, max_threads); break;
    default: run_all<f16_t>(p, tasks, io, kp, vp, pool, total_cost, max_threads); break;
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()       // q
                                  .Arg<ffi::AnyBuffer>()       // k_cache
                                  .Arg<ffi::AnyBuffer>()       // v_cache
                                  .Arg<ffi::AnyBuffer>()       // k_scale (int8 codes; empty)
                                  .Arg<ffi::AnyBuffer>()       // v_scale
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // sliding_window
                                  .Ret<ffi::AnyBuffer>()       // out
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("logits_soft_cap")
                                  .Attr<int64_t>("max_threads"));
