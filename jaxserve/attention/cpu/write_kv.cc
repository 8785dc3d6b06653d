// write_kv for the XLA CPU backend (XLA FFI): this step's K/V rows into the paged caches at
// their slots, in place. Built into the attention kernel's library (attention/cpu/loader.py).

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"
#include "element_types.h"
#include "parallel_for.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve_cpu::dims_str;
using jaxserve_cpu::elements::dtype_size;

// write_kv: this step's K/V rows into the caches at their slots, in place (the results alias
// the cache operands). XLA:CPU's own scatter rewrites a bf16 / f16 / fp8 cache whole on every
// call (it computes those types in f32: 33 ms per 12.6M-value cache and layer, ~2 s per
// SmolLM2 step with a 256 MiB cache); float32 and int8 scatters are in place and stay in XLA.
ffi::Error write_rows(const ffi::AnyBuffer& cache, ffi::Result<ffi::AnyBuffer>& out,
                      const ffi::AnyBuffer& rows, const int32_t* slots, int64_t num_tokens,
                      int64_t num_slots, size_t row_bytes) {
  char* dst = static_cast<char*>(out->untyped_data());
  const size_t cache_bytes = size_t(num_slots) * row_bytes;
  if (dst != cache.untyped_data())   // XLA did not alias: start from the operand's contents
    std::memcpy(dst, cache.untyped_data(), cache_bytes);
  const char* src = static_cast<const char*>(rows.untyped_data());
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= num_slots) continue;   // -1: padding rows write nothing
    std::memcpy(dst + size_t(slot) * row_bytes, src + size_t(t) * row_bytes, row_bytes);
  }
  return ffi::Error::Success();
}

ffi::Error WriteKVImpl(ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::AnyBuffer k,
                       ffi::AnyBuffer v, ffi::Buffer<ffi::S32> slots,
                       ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  const auto cd = k_cache.dimensions();
  const auto kd = k.dimensions();
  if (cd.size() != 4 || kd.size() != 3 || dims_str(cd) != dims_str(v_cache.dimensions()) ||
      dims_str(kd) != dims_str(v.dimensions()) || kd[1] != cd[2] || kd[2] != cd[3] ||
      slots.element_count() != size_t(kd[0]))
    return ffi::Error::InvalidArgument("write_kv: want caches [blocks, block_size, Hkv, D], "
                                       "k/v [T, Hkv, D] and slots [T]; got " + dims_str(cd) +
                                       ", " + dims_str(kd));
  const ffi::DataType t = k_cache.element_type();
  if (dtype_size(t) == 0 || v_cache.element_type() != t || k.element_type() != t ||
      v.element_type() != t)
    return ffi::Error::InvalidArgument("write_kv: caches and rows must share one dtype");
  const int64_t num_slots = cd[0] * cd[1];
  const size_t row_bytes = size_t(cd[2] * cd[3]) * dtype_size(t);
  const int32_t* s = slots.typed_data();
  ffi::Error e = write_rows(k_cache, k_out, k, s, kd[0], num_slots, row_bytes);
  if (e.failure()) return e;
  return write_rows(v_cache, v_out, v, s, kd[0], num_slots, row_bytes);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWriteKV, WriteKVImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()       // k_cache (aliased to out 0)
                                  .Arg<ffi::AnyBuffer>()       // v_cache (aliased to out 1)
                                  .Arg<ffi::AnyBuffer>()       // k rows [T, Hkv, D]
                                  .Arg<ffi::AnyBuffer>()       // v rows
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots [T], -1 = skip
                                  .Ret<ffi::AnyBuffer>()       // k_cache
                                  .Ret<ffi::AnyBuffer>());     // v_cache
