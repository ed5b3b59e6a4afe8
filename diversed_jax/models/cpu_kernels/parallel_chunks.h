// Shared by the kernels: a lane sum in one fixed order, and work split into chunks over
// XLA's intra-op thread pool.

#ifndef DIVERSED_JAX_CPU_KERNELS_PARALLEL_CHUNKS_H_
#define DIVERSED_JAX_CPU_KERNELS_PARALLEL_CHUNKS_H_

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace diversed_jax {

// The sum of v's 8 lanes, always in the same order: (0+4, 1+5, 2+6, 3+7), then pairs.
inline float LaneSum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// Calls body(c) once for every chunk c in [0, num_chunks), on the calling thread and up
// to num_threads - 1 of the pool's tasks, and returns when all are done. Chunks are
// claimed from a shared counter, so a task that starts late only takes what is left; a
// chunk's result must not depend on which thread runs it. Tasks that start after every
// chunk is claimed touch only the shared state, which they co-own.
template <typename Body>
void ParallelChunks(xla::ffi::ThreadPool& pool, int64_t num_chunks, Body body) {
  struct State {
    Body body;
    int64_t num_chunks;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};

    State(Body b, int64_t n) : body(std::move(b)), num_chunks(n) {}

    void Drain() {
      for (int64_t c; (c = next.fetch_add(1)) < num_chunks;) {
        body(c);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto state = std::make_shared<State>(std::move(body), num_chunks);
  const int64_t helpers = std::min(std::max<int64_t>(1, pool.num_threads()), num_chunks) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([state] { state->Drain(); });
  state->Drain();
  // The last chunks are in a helper's hands: a short wait, spinning, then yielding.
  for (int spins = 0; state->done.load(std::memory_order_acquire) < num_chunks;) {
    if (++spins < 4096) {
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }
}

}  // namespace diversed_jax

#endif  // DIVERSED_JAX_CPU_KERNELS_PARALLEL_CHUNKS_H_
