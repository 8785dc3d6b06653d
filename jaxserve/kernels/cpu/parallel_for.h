// The parallel loop on XLA's intra-op thread pool that the kernels of this library
// (jaxserve/attention/cpu/paged_attention.cc, matmul.cc) share. Header-only: each .cc gets its own copy in
// an anonymous namespace.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxserve_cpu {
namespace {

namespace ffi = xla::ffi;

// ---------------------------------------------------------------------------
// Parallel loop on XLA's intra-op pool. The caller takes tasks too; a helper that
// starts after the caller has finished (pool busy) returns without touching them.
// ---------------------------------------------------------------------------

struct LoopState {
  std::atomic<int64_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  int active = 0;
  bool closed = false;
};

template <typename Body>
void parallel_for(ffi::ThreadPool& pool, int64_t n, int64_t workers, const Body& body) {
  if (workers <= 1 || n <= 1) {
    for (int64_t i = 0; i < n; ++i) body(i, 0);
    return;
  }
  auto state = std::make_shared<LoopState>();
  const Body* fn = &body;
  auto drain = [n](LoopState& st, const Body& f, int64_t worker) {
    for (int64_t i = st.next.fetch_add(1); i < n; i = st.next.fetch_add(1)) f(i, worker);
  };
  for (int64_t w = 1; w < workers; ++w) {
    pool.Schedule([state, fn, drain, w] {
      {
        std::lock_guard<std::mutex> lock(state->mu);
        if (state->closed) return;
        ++state->active;
      }
      drain(*state, *fn, w);
      std::lock_guard<std::mutex> lock(state->mu);
      if (--state->active == 0) state->cv.notify_all();
    });
  }
  drain(*state, body, 0);
  std::unique_lock<std::mutex> lock(state->mu);
  state->closed = true;
  state->cv.wait(lock, [&] { return state->active == 0; });
}

// Workers for a pass over `elements` floats of weights split into at most `parts` ranges:
// below ~256 KB one core is quicker than waking another.
inline int64_t streaming_workers(ffi::ThreadPool& pool, int64_t elements, int64_t parts) {
  const int64_t workers = elements < (int64_t(1) << 16) ? 1 : pool.num_threads();
  return std::max<int64_t>(1, std::min<int64_t>(workers, parts));
}

inline std::string dims_str(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

}  // namespace
}  // namespace jaxserve_cpu
