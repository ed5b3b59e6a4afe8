// y[m, o] = sum_i x[m, i] * w[o, i] for a few rows m: an XLA:CPU FFI custom call.
//
// Why: XLA:CPU runs a product over one row as a GEMV near memory bandwidth but sends 2+ rows
// to GEMM kernels (or, via `products.matmul_oi`'s fused form, a multiply-and-reduce loop)
// that take 1.5-2.5x as long, though all read the same weights once. Verifying K drafted
// tokens is such a product, so its cost sets the speed-up of speculative decoding on CPU.
// This kernel streams each weight row once and multiplies it into every row of x while it
// is in registers, splitting the output rows over XLA's intra-op thread pool.
//
// Every y[m, o] is accumulated in the same order whatever the number of rows and however
// the work is split: 8 lanes over i in steps of 8, a fixed lane reduction, then the tail.
// So one row's result is bitwise the same alone or among others (a token's products do not
// depend on how many tokens are verified with it).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float LaneSum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);                   // lanes (0+4, 1+5, 2+6, 3+7)
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));  // (0+4+2+6, 1+5+3+7)
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// How far ahead (floats) each weight stream of a several-row tile is prefetched. Without it
// the 3-4 row tiles, busy with their FMAs, leave the memory idle and 4 rows cost 1.5x one
// row; with it about the same (2-core Zen host; 1,024 and 2,048 measured equal). Prefetches
// past the end of `w` are harmless: a prefetch never faults.
constexpr int64_t kPrefetchFloats = 1024;

// ROWS rows of x against OUTS consecutive weight rows starting at `o`. The accumulators
// (ROWS * OUTS) and the ROWS vectors of x stay in registers, so each weight vector is
// loaded once for all rows and each x vector once for all OUTS weight rows.
template <int ROWS, int OUTS>
inline void Tile(const float* x, const float* w, float* y, int64_t in, int64_t out,
                 int64_t o) {
  const int64_t in8 = in & ~int64_t{7};
  __m256 acc[OUTS][ROWS];
  for (int b = 0; b < OUTS; ++b)
    for (int m = 0; m < ROWS; ++m) acc[b][m] = _mm256_setzero_ps();
  for (int64_t i = 0; i < in8; i += 8) {
    __m256 xv[ROWS];
    for (int m = 0; m < ROWS; ++m) {
      xv[m] = _mm256_loadu_ps(x + m * in + i);
      // Pinned to a register: GCC would otherwise reload it for every weight row.
      if (ROWS >= 2) asm("" : "+x"(xv[m]));
    }
    if (ROWS >= 2 && (i & 15) == 0) {  // one prefetch per 64-byte line of each stream
      for (int b = 0; b < OUTS; ++b) {
        _mm_prefetch(reinterpret_cast<const char*>(w + (o + b) * in + i + kPrefetchFloats),
                     _MM_HINT_T0);
      }
    }
    for (int b = 0; b < OUTS; ++b) {
      const __m256 wv = _mm256_loadu_ps(w + (o + b) * in + i);
      for (int m = 0; m < ROWS; ++m) acc[b][m] = _mm256_fmadd_ps(wv, xv[m], acc[b][m]);
    }
  }
  for (int b = 0; b < OUTS; ++b) {
    for (int m = 0; m < ROWS; ++m) {
      float s = LaneSum(acc[b][m]);
      for (int64_t i = in8; i < in; ++i) s += x[m * in + i] * w[(o + b) * in + i];
      y[m * out + o + b] = s;
    }
  }
}

// Output rows [o_begin, o_end) for ROWS rows of x. Two weight rows per tile for several
// rows (measured fastest for 2-4 rows, and it fits the 16 vector registers), four for one.
template <int ROWS>
void RowGroup(const float* x, const float* w, float* y, int64_t in, int64_t out,
              int64_t o_begin, int64_t o_end) {
  constexpr int kOuts = ROWS == 1 ? 4 : 2;
  int64_t o = o_begin;
  for (; o + kOuts <= o_end; o += kOuts) Tile<ROWS, kOuts>(x, w, y, in, out, o);
  for (; o < o_end; ++o) Tile<ROWS, 1>(x, w, y, in, out, o);
}

// Up to 4 rows of x against output rows [o_begin, o_end) in one pass over the weights.
void RowGroups(const float* x, const float* w, float* y, int64_t rows, int64_t in,
               int64_t out, int64_t o_begin, int64_t o_end) {
  switch (rows) {
    case 1: RowGroup<1>(x, w, y, in, out, o_begin, o_end); break;
    case 2: RowGroup<2>(x, w, y, in, out, o_begin, o_end); break;
    case 3: RowGroup<3>(x, w, y, in, out, o_begin, o_end); break;
    default: RowGroup<4>(x, w, y, in, out, o_begin, o_end); break;
  }
}

// All `rows` rows of x against output rows [o_begin, o_end). Up to 4 rows: one pass (the
// blocked loop below measured ~2x slower for 3-4 rows, a code-generation effect that was
// not pinned down). More: blocks of ~64 KB of weights, each multiplied by every group of up
// to 4 rows before the next, so groups after the first read it from cache.
void Chunk(const float* x, const float* w, float* y, int64_t rows, int64_t in, int64_t out,
           int64_t o_begin, int64_t o_end) {
  if (rows <= 4) {
    RowGroups(x, w, y, rows, in, out, o_begin, o_end);
    return;
  }
  const int64_t block = std::max<int64_t>(12, int64_t{16384} / in / 12 * 12);
  for (int64_t b_begin = o_begin; b_begin < o_end; b_begin += block) {
    const int64_t b_end = std::min(o_end, b_begin + block);
    for (int64_t m = 0; m < rows; m += 4) {
      RowGroups(x + m * in, w, y + m * out, std::min<int64_t>(rows - m, 4), in, out,
                b_begin, b_end);
    }
  }
}

// Work shared by the calling thread and the pool's tasks: contiguous chunks of output rows
// (a few per thread; contiguous, so each thread's weight stream stays sequential for the
// hardware prefetcher, which interleaved small blocks defeat: 1.3x slower) are claimed
// from `next`; the caller returns once `done` counts every chunk. Tasks that start after
// all chunks are claimed touch only this state, which they co-own.
struct Work {
  const float* x;
  const float* w;
  float* y;
  int64_t rows, in, out, chunk, num_chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Drain() {
    for (int64_t c; (c = next.fetch_add(1)) < num_chunks;) {
      const int64_t o_begin = c * chunk;
      Chunk(x, w, y, rows, in, out, o_begin, std::min(out, o_begin + chunk));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

constexpr int64_t kChunksPerThread = 4;  // lets a thread that starts late take a share

ffi::Error FewRowMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                        ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 2 || x_dims[1] != w_dims[1] || x_dims[1] == 0) {
    return ffi::Error::InvalidArgument("few_row_matmul: expected x [rows, in], w [out, in]");
  }
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->w = w.typed_data();
  work->y = y->typed_data();
  work->rows = x_dims[0];
  work->in = x_dims[1];
  work->out = w_dims[0];
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // A multiple of 12 output rows, every tile's width.
  work->chunk = (work->out / (threads * kChunksPerThread) / 12 + 1) * 12;
  work->num_chunks = (work->out + work->chunk - 1) / work->chunk;
  const int64_t helpers = std::min(threads, work->num_chunks) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  // The last chunks are in a helper's hands: a short wait, spinning, then yielding.
  for (int spins = 0; work->done.load(std::memory_order_acquire) < work->num_chunks;) {
    if (++spins < 4096) {
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FewRowMatmulHandler, FewRowMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Whether this CPU runs the kernel (AVX2 and FMA), asked before registering it.
extern "C" int FewRowMatmulSupported() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
