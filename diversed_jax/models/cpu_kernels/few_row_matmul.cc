// y[m, o] = sum_i x[m, i] * w[o, i] for a few rows m: an XLA:CPU FFI custom call.
//
// Why: XLA:CPU runs a product over one row as a GEMV near memory bandwidth but sends 2+ rows
// to GEMM kernels (or, via `products.matmul_oi`'s fused form, a multiply-and-reduce loop)
// that take 1.5-2.5x as long, though all read the same weights once. Verifying K drafted
// tokens is such a product, so its cost sets the speed-up of speculative decoding on CPU.
// This kernel streams each weight row once, multiplies it into every row of x (read from
// L1), and splits the output rows over XLA's intra-op thread pool; on AVX-512 hosts, rows
// go through register tiles instead (`Tiles`: from 3 rows on AMD, from 1 on Intel, as
// measured). It also serves one row, as fast as XLA's GEMV or faster, so decoding and
// verification share one product.
//
// Every y[m, o] is accumulated in the same order whatever the number of rows and however
// the work is split: two 8-lane accumulators over alternate 8-float steps of i (a last
// lone step goes to the first), their sum, a fixed lane reduction, then the scalar tail.
// So one row's result is bitwise the same alone or among others (a token's products do not
// depend on how many tokens are verified with it).
//
// The weights may also be stored as float16, or as int8 with a float32 scale per 32
// weights (two more FFI targets): each weight is widened to float32 exactly as it is
// loaded (int8 read by several groups of rows: once per column, into a buffer that every
// group reads), so the results are bitwise those of the float32 kernel on the widened weights,
// for a half or about a quarter of the bytes (a distilled draft stored in float16, and its
// head: rows of the target's GGUF Q8_0 embedding).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "parallel_chunks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using diversed_jax::LaneSum;

// How the kernel reads a weight matrix [out, in]: `Row(o)` gives a view of one row that
// loads 8 or 16 consecutive weights widened to float32 (exactly, so every storage gives the
// float32 kernel's bits on the widened weights) and one weight for the scalar tail.
// `Address(o)` and `RowBytes()` locate the stored rows for prefetching.

// Rows stored as float32, or as float16 bits (T = uint16_t).
template <typename T>
struct PlainRow {
  const T* w;
  __m256 Load8(int64_t i) const {
    if constexpr (sizeof(T) == 4) {
      return _mm256_loadu_ps(w + i);
    } else {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i)));
    }
  }
  __attribute__((target("avx512f"))) __m512 Load16(int64_t i) const {
    if constexpr (sizeof(T) == 4) {
      return _mm512_loadu_ps(w + i);
    } else {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i)));
    }
  }
  float At(int64_t i) const {
    if constexpr (sizeof(T) == 4) {
      return w[i];
    } else {
      return _cvtsh_ss(w[i]);
    }
  }
};

template <typename T>
struct PlainMatrix {
  const T* w;
  int64_t in;
  PlainRow<T> Row(int64_t o) const { return {w + o * in}; }
  const char* Address(int64_t o) const { return reinterpret_cast<const char*>(w + o * in); }
  int64_t RowBytes() const { return in * static_cast<int64_t>(sizeof(T)); }
};

// Rows stored as int8 q with one float32 scale d per 32 weights: weight = q * d, exact in
// float32 when d has at most 16 significant bits (a float16 scale, as GGUF's Q8_0). A
// 16-weight step never straddles two blocks (steps start at multiples of 16).
constexpr int64_t kInt8Block = 32;

struct Int8Row {
  const int8_t* q;
  const float* scale;
  __m256 Load8(int64_t i) const {
    const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)),
                         _mm256_set1_ps(scale[i / kInt8Block]));
  }
  __attribute__((target("avx512f"))) __m512 Load16(int64_t i) const {
    const __m128i q16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q16)),
                         _mm512_set1_ps(scale[i / kInt8Block]));
  }
  float At(int64_t i) const { return static_cast<float>(q[i]) * scale[i / kInt8Block]; }
};

struct Int8Matrix {
  const int8_t* q;
  const float* scale;
  int64_t in;
  Int8Row Row(int64_t o) const { return {q + o * in, scale + o * (in / kInt8Block)}; }
  const char* Address(int64_t o) const { return reinterpret_cast<const char*>(q + o * in); }
  int64_t RowBytes() const { return in; }
};

// A row's weights i..i+7 in lanes 0-7, zeros above (a tile's last lone 8-weight step).
template <typename R>
__attribute__((target("avx512f"))) inline __m512 LoadEven8(const R& row, int64_t i) {
  return _mm512_zextps256_ps512(row.Load8(i));
}

// An output's last steps, shared by every path so all round alike: its even and odd
// 8-lane accumulators added, their lanes summed, then the scalar tail past in8 in order.
template <typename R>
inline float FinishDot(__m256 even, __m256 odd, const float* x_row, const R& w_row,
                       int64_t in8, int64_t in) {
  float s = LaneSum(_mm256_add_ps(even, odd));
  for (int64_t i = in8; i < in; ++i) s += x_row[i] * w_row.At(i);
  return s;
}

// ROWS rows of x against weight rows [o_begin, o_end), one weight row after the other: each
// thread's weights stream forward through memory in one sequence, the hardware prefetcher's
// best case, while the few rows of x are read from L1. (Tiles of 2 weight rows x ROWS rows
// with x held in registers issue fewer loads, but their short interleaved streams ran at
// 60-75% of this on a 2-core Zen 4 host.) Two accumulators per row, over alternate 8-float
// steps, keep two FMA chains in flight.
template <int ROWS, typename M>
void RowGroup(const float* x, const M& w, float* y, int64_t in, int64_t out,
              int64_t o_begin, int64_t o_end) {
  const int64_t in16 = in & ~int64_t{15};
  const int64_t in8 = in & ~int64_t{7};
  for (int64_t o = o_begin; o < o_end; ++o) {
    const auto w_row = w.Row(o);
    __m256 even[ROWS], odd[ROWS];
    for (int m = 0; m < ROWS; ++m) even[m] = odd[m] = _mm256_setzero_ps();
    for (int64_t i = 0; i < in16; i += 16) {
      const __m256 w_even = w_row.Load8(i);
      const __m256 w_odd = w_row.Load8(i + 8);
      for (int m = 0; m < ROWS; ++m) {
        even[m] = _mm256_fmadd_ps(w_even, _mm256_loadu_ps(x + m * in + i), even[m]);
        odd[m] = _mm256_fmadd_ps(w_odd, _mm256_loadu_ps(x + m * in + i + 8), odd[m]);
      }
    }
    if (in8 > in16) {
      const __m256 w_even = w_row.Load8(in16);
      for (int m = 0; m < ROWS; ++m)
        even[m] = _mm256_fmadd_ps(w_even, _mm256_loadu_ps(x + m * in + in16), even[m]);
    }
    for (int m = 0; m < ROWS; ++m) {
      y[m * out + o] = FinishDot(even[m], odd[m], x + m * in, w_row, in8, in);
    }
  }
}

// Up to 4 rows of x against output rows [o_begin, o_end) in one pass over the weights.
template <typename M>
void RowGroups(const float* x, const M& w, float* y, int64_t rows, int64_t in,
               int64_t out, int64_t o_begin, int64_t o_end) {
  switch (rows) {
    case 1: RowGroup<1>(x, w, y, in, out, o_begin, o_end); break;
    case 2: RowGroup<2>(x, w, y, in, out, o_begin, o_end); break;
    case 3: RowGroup<3>(x, w, y, in, out, o_begin, o_end); break;
    default: RowGroup<4>(x, w, y, in, out, o_begin, o_end); break;
  }
}

// Bytes of x that one pass over the weights reads alongside them: kept well inside a 32 KB
// L1 so the weight stream does not evict them (4 rows of 1,536 floats, 24 KB, ran 1.6x
// slower than 2 + 2 rows over cached weight blocks).
constexpr int64_t kRowBytesPerPass = 16384;

// Weights per block when more rows than one group share them in RowGroups: 64 KB, so later
// groups read the block from L2.
constexpr int64_t kBlockFloats = 16384;

// From MinTileRows() rows on AVX-512 hosts: tiles of MR rows of x by NR weight rows, one
// 16-lane accumulator per output. Its lanes 0-7 and 8-15 are exactly RowGroup's even and
// odd accumulators (a 16-float step is an even and an odd 8-float step), so every output
// has the same bits as in RowGroup. A 4 x 4 tile issues 16 FMAs per 8 loads (6 x 4: 24 per
// 10), against one load per FMA in RowGroup, where rows share only the weight loads.
// Compute-bound products (verifying a batch) run at close to the FMA rate.
template <int MR, int NR, typename M>
__attribute__((target("avx512f"))) void Tile(const float* x, const M& w, float* y,
                                             int64_t in, int64_t out, int64_t o0,
                                             const char* prefetch, int64_t prefetch_lines) {
  const int64_t in16 = in & ~int64_t{15};
  const int64_t in8 = in & ~int64_t{7};
  decltype(w.Row(0)) w_rows[NR];
  for (int n = 0; n < NR; ++n) w_rows[n] = w.Row(o0 + n);
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
  // The prefetches spread evenly over the steps: issued in a burst they stall the loads.
  const int64_t steps = in16 / 16;
  const int64_t per_step = steps > 0 ? (prefetch_lines + steps - 1) / steps : 0;
  int64_t line = 0;
  for (int64_t i = 0; i < in16; i += 16) {
    for (int64_t end = std::min(prefetch_lines, line + per_step); line < end; ++line)
      _mm_prefetch(prefetch + 64 * line, _MM_HINT_T1);
    __m512 w_n[NR];
    for (int n = 0; n < NR; ++n) w_n[n] = w_rows[n].Load16(i);
    for (int m = 0; m < MR; ++m) {
      const __m512 x_m = _mm512_loadu_ps(x + m * in + i);
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_fmadd_ps(w_n[n], x_m, acc[m][n]);
    }
  }
  for (; line < prefetch_lines; ++line) _mm_prefetch(prefetch + 64 * line, _MM_HINT_T1);
  if (in8 > in16) {  // a last lone 8-float step: the even lanes only
    const __mmask16 even = 0x00FF;
    __m512 w_n[NR];
    for (int n = 0; n < NR; ++n) w_n[n] = LoadEven8(w_rows[n], in16);
    for (int m = 0; m < MR; ++m) {
      const __m512 x_m = _mm512_maskz_loadu_ps(even, x + m * in + in16);
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_mask3_fmadd_ps(w_n[n], x_m, acc[m][n], even);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int n = 0; n < NR; ++n) {
      const __m256 even = _mm512_castps512_ps256(acc[m][n]);
      const __m256 odd = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[m][n]), 1));
      y[m * out + o0 + n] = FinishDot(even, odd, x + m * in, w_rows[n], in8, in);
    }
  }
}

template <int MR, typename M>
void TileColumns(const float* x, const M& w, float* y, int64_t in, int64_t out,
                 int64_t o0, int64_t nr, const char* prefetch, int64_t lines) {
  switch (nr) {
    case 1: Tile<MR, 1>(x, w, y, in, out, o0, prefetch, lines); break;
    case 2: Tile<MR, 2>(x, w, y, in, out, o0, prefetch, lines); break;
    case 3: Tile<MR, 3>(x, w, y, in, out, o0, prefetch, lines); break;
    default: Tile<MR, 4>(x, w, y, in, out, o0, prefetch, lines); break;
  }
}

// Rows of x per tile at most: 6 x 4 accumulators, 4 weight vectors and one row of x fill
// 29 of the 32 registers.
constexpr int64_t kMaxTileRows = 6;

// A column of int8 weights widened once into a float32 buffer, read by every group of rows
// in its place: `Row(o)` of output rows [o0, o0 + 4) (the widening is exact, so the
// results keep their bits).
struct WidenedColumn {
  const float* rows;  // [4, in]
  int64_t o0, in;
  PlainRow<float> Row(int64_t o) const { return {rows + (o - o0) * in}; }
};

// Int8 rows are whole 32-weight blocks, so 16-weight steps cover them (no scalar tail).
__attribute__((target("avx512f"))) void Widen(const Int8Matrix& w, int64_t o0, int64_t nr,
                                              int64_t in, float* rows) {
  for (int64_t n = 0; n < nr; ++n) {
    const Int8Row w_row = w.Row(o0 + n);
    for (int64_t i = 0; i < in; i += 16) _mm512_storeu_ps(rows + n * in + i, w_row.Load16(i));
  }
}

// Every group of rows against one column of weight rows [o0, o0 + nr), read through
// `column` (the weights themselves, or their widened copy); the groups share the prefetch
// of the next column of `w` within [o0, o_end).
template <typename M, typename C>
void TileGroups(const float* x, const M& w, const C& column, float* y, int64_t rows,
                int64_t groups, int64_t in, int64_t out, int64_t o0, int64_t nr, int64_t o_end) {
  const char* next = w.Address(o0 + nr);
  const int64_t next_lines = std::min<int64_t>(4, o_end - o0 - nr) * w.RowBytes() / 64;
  const int64_t lines_per_group = (next_lines + groups - 1) / groups;
  int64_t m0 = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t size = rows / groups + (g < rows % groups ? 1 : 0);
    const int64_t first = std::min(next_lines, g * lines_per_group);
    const int64_t n = std::min(next_lines, first + lines_per_group) - first;
    const float* x_m = x + m0 * in;
    float* y_m = y + m0 * out;
    const char* pf = next + 64 * first;
    switch (size) {
      case 1: TileColumns<1>(x_m, column, y_m, in, out, o0, nr, pf, n); break;
      case 2: TileColumns<2>(x_m, column, y_m, in, out, o0, nr, pf, n); break;
      case 3: TileColumns<3>(x_m, column, y_m, in, out, o0, nr, pf, n); break;
      case 4: TileColumns<4>(x_m, column, y_m, in, out, o0, nr, pf, n); break;
      case 5: TileColumns<5>(x_m, column, y_m, in, out, o0, nr, pf, n); break;
      default: TileColumns<6>(x_m, column, y_m, in, out, o0, nr, pf, n); break;
    }
    m0 += size;
  }
}

// All rows of x against output rows [o_begin, o_end) in tiles of up to 6 rows by 4 weight
// rows, one column of 4 weight rows at a time: every group of rows of x passes over the
// column (later groups read it from cache), and the column's tiles prefetch the next column
// into L2 as they go. (4 interleaved weight rows are a poor stream for the hardware
// prefetcher: 1.2-1.4x slower without. Prefetching 64 KB blocks ahead instead made 3-4
// rows 1.15-1.2x slower.) The rows split into as few groups as the tile allows, of even
// sizes: 5 rows as one group of 5 ran 1.09x a one-row pass over the target's weights,
// against 1.19x as 4 + 1; 12 rows as 6 + 6 took 14% less time than 4 + 4 + 4, 16 rows as
// 6 + 5 + 5 5% less. (Tiles of 7-8 rows by 3 weight rows were slower from 16 rows on.)
template <typename M>
void Tiles(const float* x, const M& w, float* y, int64_t rows, int64_t in, int64_t out,
           int64_t o_begin, int64_t o_end) {
  const int64_t groups = (rows + kMaxTileRows - 1) / kMaxTileRows;
  // Int8 weights read by several groups of rows are widened once per column (each group
  // widening them again made the target's int8 head 1.1x slower at 16 rows, 1.25x at 64).
  // Float16's one-instruction widening is cheaper than the buffer's stores and loads.
  if constexpr (std::is_same_v<M, Int8Matrix>) {
    if (groups > 1) {
      thread_local std::vector<float> widened;
      widened.resize(std::max<size_t>(widened.size(), 4 * in));
      for (int64_t o0 = o_begin; o0 < o_end; o0 += 4) {
        const int64_t nr = std::min<int64_t>(4, o_end - o0);
        Widen(w, o0, nr, in, widened.data());
        TileGroups(x, w, WidenedColumn{widened.data(), o0, in}, y, rows, groups, in, out, o0,
                   nr, o_end);
      }
      return;
    }
  }
  for (int64_t o0 = o_begin; o0 < o_end; o0 += 4) {
    TileGroups(x, w, w, y, rows, groups, in, out, o0, std::min<int64_t>(4, o_end - o0), o_end);
  }
}

bool HasAvx512() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return has;
}

// Rows from which AVX-512 hosts use Tiles, chosen by measurement on each vendor's cores:
// - AMD (2-core Zen 4, 256-bit FMA units): 3. One or two rows are bound by the weights'
//   memory stream, which RowGroup's single forward stream serves best (2 rows: 18.8 ms
//   against 20.6 as tiles); from three rows RowGroup's load per FMA makes its compute fall
//   behind the stream (3-4 rows took 1.3-1.4x one row's time, the tiles 1.08-1.11x).
// - Intel (2-core Xeon, Emerald Rapids, two 512-bit FMA ports): 1. The tiles' prefetched
//   4-row columns stream the weights faster than RowGroup even for one row: a one-row
//   target forward 15.4-17.8 ms against 21.3, two rows 17.1-17.9 against 25.3-25.8.
// FewRowMatmulSetMinTileRows overrides it (tests compare both paths' bits on one host).
std::atomic<int64_t> min_tile_rows{0};  // 0: the vendor's default

int64_t MinTileRows() {
  static const int64_t vendor_default = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") ? int64_t{1} : int64_t{3};
  }();
  const int64_t rows = min_tile_rows.load(std::memory_order_relaxed);
  return rows > 0 ? rows : vendor_default;
}

// All `rows` rows of x against output rows [o_begin, o_end). From MinTileRows() rows on
// AVX-512 hosts: Tiles. Otherwise, rows whose x fits in kRowBytesPerPass (at most 4): one
// pass; more: blocks of ~64 KB of weights, each multiplied by every group of rows before
// the next, so groups after the first read it from cache.
template <typename M>
void Chunk(const float* x, const M& w, float* y, int64_t rows, int64_t in, int64_t out,
           int64_t o_begin, int64_t o_end) {
  if (HasAvx512() && rows >= MinTileRows()) {
    Tiles(x, w, y, rows, in, out, o_begin, o_end);
    return;
  }
  const int64_t group = std::clamp<int64_t>(kRowBytesPerPass / (in * 4), 1, 4);
  if (rows <= group) {
    RowGroups(x, w, y, rows, in, out, o_begin, o_end);
    return;
  }
  const int64_t block = std::max<int64_t>(1, kBlockFloats / in);
  for (int64_t b_begin = o_begin; b_begin < o_end; b_begin += block) {
    const int64_t b_end = std::min(o_end, b_begin + block);
    for (int64_t m = 0; m < rows; m += group) {
      RowGroups(x + m * in, w, y + m * out, std::min(rows - m, group), in, out, b_begin,
                b_end);
    }
  }
}

// Contiguous chunks of output rows, a few per thread (contiguous, so each thread's weight
// stream stays sequential for the hardware prefetcher, which interleaved small blocks
// defeat: 1.3x slower; a few, so a thread that starts late can take a share).
constexpr int64_t kChunksPerThread = 4;

template <typename M>
ffi::Error FewRowMatmulOf(ffi::ThreadPool& pool, const float* x_data, const M& w_data,
                          float* y_data, ffi::Span<const int64_t> x_dims,
                          ffi::Span<const int64_t> w_dims) {
  if (x_dims.size() != 2 || w_dims.size() != 2 || x_dims[1] != w_dims[1] || x_dims[1] == 0) {
    return ffi::Error::InvalidArgument("few_row_matmul: expected x [rows, in], w [out, in]");
  }
  const int64_t rows = x_dims[0], in = x_dims[1], out = w_dims[0];
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t chunk = (out + threads * kChunksPerThread - 1) / (threads * kChunksPerThread);
  diversed_jax::ParallelChunks(pool, (out + chunk - 1) / chunk, [=](int64_t c) {
    Chunk(x_data, w_data, y_data, rows, in, out, c * chunk, std::min(out, (c + 1) * chunk));
  });
  return ffi::Error::Success();
}

ffi::Error FewRowMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                        ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  const PlainMatrix<float> w_rows{w.typed_data(), w.dimensions().back()};
  return FewRowMatmulOf(pool, x.typed_data(), w_rows, y->typed_data(), x.dimensions(),
                        w.dimensions());
}

ffi::Error FewRowMatmulF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::F16> w, ffi::ResultBuffer<ffi::F32> y) {
  const PlainMatrix<uint16_t> w_rows{static_cast<const uint16_t*>(w.untyped_data()),
                                     w.dimensions().back()};
  return FewRowMatmulOf(pool, x.typed_data(), w_rows, y->typed_data(), x.dimensions(),
                        w.dimensions());
}

ffi::Error FewRowMatmulInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scale,
                            ffi::ResultBuffer<ffi::F32> y) {
  const auto q_dims = q.dimensions();
  const auto s_dims = scale.dimensions();
  if (q_dims.size() != 2 || q_dims[1] % kInt8Block != 0 || s_dims.size() != 2 ||
      s_dims[0] != q_dims[0] || s_dims[1] * kInt8Block != q_dims[1]) {
    return ffi::Error::InvalidArgument(
        "few_row_matmul_int8: expected q [out, in] with in a multiple of 32, scale "
        "[out, in / 32]");
  }
  const Int8Matrix w_rows{q.typed_data(), scale.typed_data(), q_dims[1]};
  return FewRowMatmulOf(pool, x.typed_data(), w_rows, y->typed_data(), x.dimensions(), q_dims);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FewRowMatmulHandler, FewRowMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FewRowMatmulF16Handler, FewRowMatmulF16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FewRowMatmulInt8Handler, FewRowMatmulInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The rows from which products use register tiles (0 if this host has no AVX-512, where
// they never do), and an override of it: rows > 0 sets it, 0 restores the vendor's
// default. For tests and measurements; set it between calls, not during one.
extern "C" int64_t FewRowMatmulMinTileRows() { return HasAvx512() ? MinTileRows() : 0; }

extern "C" void FewRowMatmulSetMinTileRows(int64_t rows) {
  min_tile_rows.store(std::max<int64_t>(rows, 0), std::memory_order_relaxed);
}

// Whether this CPU runs the kernel (AVX2, FMA and F16C), asked before registering it.
extern "C" int FewRowMatmulSupported() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}
