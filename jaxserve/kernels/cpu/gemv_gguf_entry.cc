// The GGUF block kernels (gemv_gguf.h) behind a plain C ABI, without XLA: what tests call
// through ctypes on every instruction-set build of the kernel (the matmul library links this
// file; tests also compile it alone for AVX2 and for no SIMD at all).

#include <cstdint>
#include <vector>

#include "gemv_gguf.h"

// The GGUF kernel without XLA, for tests of each compiled instruction set: y [T, out] =
// x [T, in] @ dequantized(w [out, bytes])^T in `parts` parts run one after another (the
// split the pool would run). Returns 0, or -1 for a bad format, or an `in` of
// partial blocks.
extern "C" int jaxserve_gguf_matmul(int fmt, const float* x, int64_t T, int64_t in,
                                    const uint8_t* w, int64_t out, float* y, int64_t parts) {
  if (fmt < 0 || fmt >= jaxserve_cpu::kGgufFormats || parts < 1 ||
      in % jaxserve_cpu::gguf_block_weights(fmt))
    return -1;
  const int64_t bpr = jaxserve_cpu::gguf_row_bytes(fmt, in);
  jaxserve_cpu::GgufX xq;
  jaxserve_cpu::gguf_quantize_x(x, T, in, &xq);
  const std::vector<jaxserve_cpu::GgufSegment> segs{{w, y, out}};
  for (int64_t p = 0; p < parts; ++p) jaxserve_cpu::gguf_run_part(fmt, segs, bpr, xq, T, out, p, parts);
  return 0;
}

// Which instruction set the GGUF kernel was compiled for: "avx512vnni", "avx2" or "scalar".
extern "C" const char* jaxserve_gguf_isa() { return jaxserve_cpu::gguf_isa(); }
