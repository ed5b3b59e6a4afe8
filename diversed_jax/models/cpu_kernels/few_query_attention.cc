// Attention of a few new queries per sequence over a KV cache: an XLA:CPU FFI custom call.
//
//   out[b, t, j, g] = sum_{s <= pos[b, t]} softmax_s(scale * q[b, t, j, g] . k[b, s, j]) v[b, s, j]
//
// q [B, T, Hkv, G, Dh], k and v [B, S, Hkv, Dh] (the cache's stored layout), pos [B, T].
//
// Why: XLA:CPU has no grouped-query product that reads the cache in place, so the model's
// flat form scores every query head against every kv head (Hkv times the work) and its
// per-layer fusions took 3.5 of a 19 ms decoding step at batch 1, 7.5 of 28 ms when
// verifying 3 drafts, and ~20 of 57 ms at batch 8 on a 2-core host. Here each (sequence,
// token, kv head) is one unit of work that reads only the visible slots of its head once
// per query and stays in L1/L2.
//
// Every output is computed in the same order whatever the number of tokens, rows or
// threads: scores over aligned blocks of 8 slots (one 8-lane FMA chain per slot over Dh, a
// fixed horizontal reduction), a max, exp and an in-order sum of the visible slots, then the
// values accumulated slot by slot. So a query's result is bitwise the same alone or among
// others (decoding and verifying a token give the same bits).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "parallel_chunks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using diversed_jax::LaneSum;

inline float LaneMax(__m256 v) {
  __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_max_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// The 8 lane sums of a[0..7], as one vector (lane i = sum of a[i]'s lanes).
inline __m256 Transpose8Sum(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]);
  const __m256 t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]);
  const __m256 t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);  // a0..a3: low-half sums | high-half sums
  const __m256 u1 = _mm256_hadd_ps(t2, t3);  // a4..a7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

// exp(x) for x <= 0 (scores minus their max), Cephes' single-precision polynomial (about 1
// ulp); exp(x) below e^-87 is 0.
inline __m256 ExpNonPositive(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i exponent =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(exponent)));
}

struct Shape {
  int64_t batch, tokens, kv_heads, group, head_dim, slots;
};

// One unit: the G queries of token t of row b that share kv head j. `scratch` holds G
// rows of `padded` floats (scores, then probabilities).
void Unit(const Shape& d, const float* q, const float* k, const float* v, int32_t position,
          float scale, float* out, float* scratch, const float* zeros) {
  const int64_t dh = d.head_dim, vecs = dh / 8, stride = d.kv_heads * dh;  // slot stride
  const int64_t visible = std::clamp<int64_t>(int64_t{position} + 1, 0, d.slots);
  const int64_t blocks = (visible + 7) / 8, padded = blocks * 8;
  if (visible == 0) {
    std::fill(out, out + d.group * dh, 0.0f);
    return;
  }
  for (int64_t g = 0; g < d.group; ++g) {
    const float* q_g = q + g * dh;
    float* scores = scratch + g * padded;
    // Scores, 8 slots at a time: one FMA chain per slot over Dh, then one reduction. Slots
    // past the visible ones in the last block are computed (from the cache, or zeros past
    // its end) and masked below.
    for (int64_t block = 0; block < blocks; ++block) {
      __m256 acc[8];
      for (int i = 0; i < 8; ++i) {
        const int64_t s = block * 8 + i;
        const float* k_s = s < d.slots ? k + s * stride : zeros;
        acc[i] = _mm256_mul_ps(_mm256_loadu_ps(q_g), _mm256_loadu_ps(k_s));
        for (int64_t c = 1; c < vecs; ++c) {
          acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q_g + 8 * c), _mm256_loadu_ps(k_s + 8 * c),
                                   acc[i]);
        }
      }
      _mm256_storeu_ps(scores + block * 8,
                       _mm256_mul_ps(Transpose8Sum(acc), _mm256_set1_ps(scale)));
    }
    // Softmax over the visible slots; the masked tail of the last block gets probability 0.
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 tail_visible = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
        _mm256_set1_epi32(static_cast<int32_t>(visible - (blocks - 1) * 8)), lane));
    const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
    __m256 max_v = minus_inf;
    for (int64_t block = 0; block < blocks; ++block) {
      __m256 s = _mm256_loadu_ps(scores + block * 8);
      if (block == blocks - 1) s = _mm256_blendv_ps(minus_inf, s, tail_visible);
      max_v = _mm256_max_ps(max_v, s);
    }
    const __m256 max_s = _mm256_set1_ps(LaneMax(max_v));
    __m256 sum_v = _mm256_setzero_ps();
    for (int64_t block = 0; block < blocks; ++block) {
      __m256 e = ExpNonPositive(_mm256_sub_ps(_mm256_loadu_ps(scores + block * 8), max_s));
      if (block == blocks - 1) e = _mm256_and_ps(e, tail_visible);
      _mm256_storeu_ps(scores + block * 8, e);
      sum_v = _mm256_add_ps(sum_v, e);
    }
    const __m256 inv_sum = _mm256_set1_ps(1.0f / LaneSum(sum_v));
    for (int64_t block = 0; block < blocks; ++block) {
      _mm256_storeu_ps(scores + block * 8,
                       _mm256_mul_ps(_mm256_loadu_ps(scores + block * 8), inv_sum));
    }
  }
  // Values, slot by slot, for Dh in slices of up to 8 vectors (the accumulators stay in
  // registers); each output lane's sum runs over the slots in order.
  for (int64_t g = 0; g < d.group; ++g) {
    const float* probs = scratch + g * padded;
    float* out_g = out + g * dh;
    for (int64_t c0 = 0; c0 < vecs; c0 += 8) {
      const int64_t width = std::min<int64_t>(8, vecs - c0);
      __m256 acc[8];
      for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
      for (int64_t s = 0; s < visible; ++s) {
        const __m256 p = _mm256_broadcast_ss(probs + s);
        const float* v_s = v + s * stride + 8 * c0;
        for (int c = 0; c < width; ++c) {
          acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v_s + 8 * c), acc[c]);
        }
      }
      for (int c = 0; c < width; ++c) _mm256_storeu_ps(out_g + 8 * (c0 + c), acc[c]);
    }
  }
}

ffi::Error FewQueryAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                             ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                             ffi::Buffer<ffi::S32> positions, ffi::ResultBuffer<ffi::F32> out,
                             float scale) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(),
             pd = positions.dimensions();
  if (qd.size() != 5 || kd.size() != 4 || vd.size() != 4 || pd.size() != 2 ||
      kd[0] != qd[0] || kd[2] != qd[2] || kd[3] != qd[4] ||
      !std::equal(kd.begin(), kd.end(), vd.begin()) || pd[0] != qd[0] || pd[1] != qd[1] ||
      qd[4] % 8 != 0 || qd[4] == 0) {
    return ffi::Error::InvalidArgument(
        "few_query_attention: expected q [B, T, Hkv, G, Dh], k and v [B, S, Hkv, Dh], "
        "positions [B, T], Dh a multiple of 8");
  }
  const Shape d{qd[0], qd[1], qd[2], qd[3], qd[4], kd[1]};
  const float* q_data = q.typed_data();
  const float* k_data = k.typed_data();
  const float* v_data = v.typed_data();
  const int32_t* pos_data = positions.typed_data();
  float* out_data = out->typed_data();
  // Units (b, t, j) in chunks, a few per thread; a unit's result does not depend on
  // which thread runs it.
  const int64_t num_units = d.batch * d.tokens * d.kv_heads;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t chunk = std::max<int64_t>(1, num_units / (threads * 4));
  diversed_jax::ParallelChunks(pool, (num_units + chunk - 1) / chunk, [=](int64_t c) {
    thread_local std::vector<float> scratch, zeros;
    scratch.resize(std::max<size_t>(scratch.size(), d.group * ((d.slots + 7) / 8 * 8)));
    zeros.resize(std::max<size_t>(zeros.size(), d.head_dim), 0.0f);
    for (int64_t u = c * chunk; u < std::min(num_units, (c + 1) * chunk); ++u) {
      const int64_t j = u % d.kv_heads, bt = u / d.kv_heads, b = bt / d.tokens;
      const int64_t qo = (bt * d.kv_heads + j) * d.group * d.head_dim;
      const int64_t ko = b * d.slots * d.kv_heads * d.head_dim + j * d.head_dim;
      Unit(d, q_data + qo, k_data + ko, v_data + ko, pos_data[bt], scale, out_data + qo,
           scratch.data(), zeros.data());
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FewQueryAttentionHandler, FewQueryAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
