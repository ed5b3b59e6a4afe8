// Attention of a few new queries per sequence over a KV cache: an XLA:CPU FFI custom call.
//
//   out[b, t, j, g] = sum_{s <= pos[b, t]} softmax_s(scale * q[b, t, j, g] . k[b, s, j]) v[b, s, j]
//
// q [B, T, Hkv, G, Dh], pos [B, T], and layer `layer` of k and v [L, B, S, Hkv, Dh] (the
// cache's stored layout, read in place; one layer's cache comes as a stack of one).
//
// Why: XLA:CPU has no grouped-query product that reads the cache in place, so the model's
// flat form scores every query head against every kv head (Hkv times the work) and its
// per-layer fusions took 3.5 of a 19 ms decoding step at batch 1, 7.5 of 28 ms when
// verifying 3 drafts, and ~20 of 57 ms at batch 8 on a 2-core host. Here a unit of work
// (a row's kv head) reads only the visible slots, block by block, each block once for all
// of its queries (every token and query head).
//
// Every output is computed in the same order whatever the number of tokens, rows or
// threads: scores over aligned blocks of 8 slots (one 8-lane FMA chain per slot over Dh, a
// fixed horizontal reduction), a max, exp and a sum of the visible slots in eight lanes
// reduced in a fixed order, then the values accumulated slot by slot. So a query's result is bitwise the same alone or among
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

// The scores of one query over the 8 slots of `block`: one FMA chain per slot over Dh, the
// 8 chains interleaved (one after the other, each waited on its FMAs' latency: 4x slower),
// then one reduction. Slots past the visible ones in a query's last block are computed
// (from the cache, or zeros past its end) and masked by the softmax.
inline void BlockScores(const Shape& d, const float* q, const float* k, int64_t block,
                        float scale, float* scores, const float* zeros) {
  const int64_t vecs = d.head_dim / 8, stride = d.kv_heads * d.head_dim;  // slot stride
  const float* k_s[8];
  for (int i = 0; i < 8; ++i) {
    const int64_t s = block * 8 + i;
    k_s[i] = s < d.slots ? k + s * stride : zeros;
  }
  __m256 acc[8];
  const __m256 q0 = _mm256_loadu_ps(q);
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_mul_ps(q0, _mm256_loadu_ps(k_s[i]));
  for (int64_t c = 1; c < vecs; ++c) {
    const __m256 q_c = _mm256_loadu_ps(q + 8 * c);
    for (int i = 0; i < 8; ++i) {
      acc[i] = _mm256_fmadd_ps(q_c, _mm256_loadu_ps(k_s[i] + 8 * c), acc[i]);
    }
  }
  _mm256_storeu_ps(scores + block * 8,
                   _mm256_mul_ps(Transpose8Sum(acc), _mm256_set1_ps(scale)));
}

// Scores [blocks * 8] of `visible` slots (> 0) to probabilities in place; the masked tail
// of the last block gets probability 0.
inline void Softmax(float* scores, int64_t visible) {
  const int64_t blocks = (visible + 7) / 8;
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

// out[0, 8 W) += sum over slots [s_begin, s_end) of probs[s] * v[s, 0:8 W), in slot
// order, W accumulators in registers; out starts at 0 with the first slot (s_begin == 0).
template <int W>
inline void AddValueSlice(const float* probs, const float* v, int64_t stride, int64_t s_begin,
                          int64_t s_end, float* out) {
  __m256 acc[W];
  for (int c = 0; c < W; ++c) {
    acc[c] = s_begin == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out + 8 * c);
  }
  for (int64_t s = s_begin; s < s_end; ++s) {
    const __m256 p = _mm256_broadcast_ss(probs + s);
    for (int c = 0; c < W; ++c) {
      acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + s * stride + 8 * c), acc[c]);
    }
  }
  for (int c = 0; c < W; ++c) _mm256_storeu_ps(out + 8 * c, acc[c]);
}

// The same over all of Dh, in slices of up to 8 vectors.
inline void AddValues(const Shape& d, const float* probs, const float* v, int64_t s_begin,
                      int64_t s_end, float* out) {
  const int64_t vecs = d.head_dim / 8, stride = d.kv_heads * d.head_dim;
  for (int64_t c0 = 0; c0 < vecs; c0 += 8) {
    const float* v_c = v + 8 * c0;
    float* out_c = out + 8 * c0;
    switch (std::min<int64_t>(8, vecs - c0)) {
      case 1: AddValueSlice<1>(probs, v_c, stride, s_begin, s_end, out_c); break;
      case 2: AddValueSlice<2>(probs, v_c, stride, s_begin, s_end, out_c); break;
      case 3: AddValueSlice<3>(probs, v_c, stride, s_begin, s_end, out_c); break;
      case 4: AddValueSlice<4>(probs, v_c, stride, s_begin, s_end, out_c); break;
      case 5: AddValueSlice<5>(probs, v_c, stride, s_begin, s_end, out_c); break;
      case 6: AddValueSlice<6>(probs, v_c, stride, s_begin, s_end, out_c); break;
      case 7: AddValueSlice<7>(probs, v_c, stride, s_begin, s_end, out_c); break;
      default: AddValueSlice<8>(probs, v_c, stride, s_begin, s_end, out_c); break;
    }
  }
}

// Slots of values per pass over a unit's queries: 32 slots (8 KB at Dh = 64) stay in L1
// while every query adds them.
constexpr int64_t kValueBlock = 32;

// One unit: tokens [t_begin, t_end) of one row with the G query heads that share its kv
// head. Keys and values are read block by block, each block once for all of the unit's
// queries and reused from L1 (a pass over the cache per query made verifying T tokens cost
// T decoding steps' attention: 8 rows verifying 1 draft took 9.2 ms over 30 layers, 6.8
// now). `scratch` holds a row of `padded` floats per query (scores, then
// probabilities). Every query's arithmetic is the same as alone: the loops over its slots
// keep their order, only interleaved with other queries'.
// q, out: the row's [T, Hkv, G, Dh] at kv head j; k, v: its [S, Hkv, Dh] at head j;
// positions: its [T].
void Unit(const Shape& d, int64_t t_begin, int64_t t_end, const float* q, const float* k,
          const float* v, const int32_t* positions, float scale, float* out, float* scratch,
          const float* zeros) {
  const int64_t dh = d.head_dim, padded = (d.slots + 7) / 8 * 8;
  auto visible_of = [&](int64_t t) {
    return std::clamp<int64_t>(int64_t{positions[t]} + 1, 0, d.slots);
  };
  // Query (t, g): its offset in q and out, and its row of scratch.
  auto offset = [&](int64_t t, int64_t g) { return (t * d.kv_heads * d.group + g) * dh; };
  auto probs = [&](int64_t t, int64_t g) {
    return scratch + ((t - t_begin) * d.group + g) * padded;
  };
  int64_t most_visible = 0;
  for (int64_t t = t_begin; t < t_end; ++t) most_visible = std::max(most_visible, visible_of(t));
  for (int64_t block = 0; block * 8 < most_visible; ++block) {
    for (int64_t t = t_begin; t < t_end; ++t) {
      if (block * 8 >= visible_of(t)) continue;
      for (int64_t g = 0; g < d.group; ++g) {
        BlockScores(d, q + offset(t, g), k, block, scale, probs(t, g), zeros);
      }
    }
  }
  for (int64_t t = t_begin; t < t_end; ++t) {
    const int64_t visible = visible_of(t);
    for (int64_t g = 0; g < d.group; ++g) {
      if (visible == 0) {
        std::fill(out + offset(t, g), out + offset(t, g) + dh, 0.0f);
      } else {
        Softmax(probs(t, g), visible);
      }
    }
  }
  for (int64_t s0 = 0; s0 < most_visible; s0 += kValueBlock) {
    for (int64_t t = t_begin; t < t_end; ++t) {
      const int64_t s_end = std::min(s0 + kValueBlock, visible_of(t));
      if (s0 >= s_end) continue;
      for (int64_t g = 0; g < d.group; ++g) {
        AddValues(d, probs(t, g), v, s0, s_end, out + offset(t, g));
      }
    }
  }
}

// Every row's queries against its cache: units (b, j, part), a row's tokens split in two
// parts only where rows x kv heads are too few to give every thread two units (one row
// verifying drafts, a one-row prefill).
void Attend(ffi::ThreadPool& pool, const Shape& d, const float* q_data, const float* k_data,
            const float* v_data, const int32_t* pos_data, float scale, float* out_data) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t parts =
      d.batch * d.kv_heads < 2 * threads ? std::clamp<int64_t>(d.tokens, 1, 2) : 1;
  const int64_t tokens_per_part = (d.tokens + parts - 1) / parts;
  const int64_t num_units = d.batch * d.kv_heads * parts;
  const int64_t chunk = std::max<int64_t>(1, num_units / (threads * 4));
  diversed_jax::ParallelChunks(pool, (num_units + chunk - 1) / chunk, [=](int64_t c) {
    thread_local std::vector<float> scratch, zeros;
    scratch.resize(std::max<size_t>(scratch.size(),
                                    tokens_per_part * d.group * ((d.slots + 7) / 8 * 8)));
    zeros.resize(std::max<size_t>(zeros.size(), d.head_dim), 0.0f);
    for (int64_t unit = c * chunk; unit < std::min(num_units, (c + 1) * chunk); ++unit) {
      const int64_t part = unit % parts, j = unit / parts % d.kv_heads;
      const int64_t b = unit / parts / d.kv_heads;
      const int64_t t_begin = part * tokens_per_part;
      const int64_t t_end = std::min(d.tokens, t_begin + tokens_per_part);
      const int64_t qo = (b * d.tokens * d.kv_heads + j) * d.group * d.head_dim;
      const int64_t ko = (b * d.slots * d.kv_heads + j) * d.head_dim;
      Unit(d, t_begin, t_end, q_data + qo, k_data + ko, v_data + ko, pos_data + b * d.tokens,
           scale, out_data + qo, scratch.data(), zeros.data());
    }
  });
}

// Layer `layer` of stacked caches k and v [L, B, S, Hkv, Dh], read in place: a layer
// sliced out of the stack would be a copy of it (at batch 1, where the decoder keeps the
// cache stacked, every layer of every forward copied its keys and values). A cache of one
// layer [B, S, Hkv, Dh] comes as a stack of one (a free reshape) with layer 0.
ffi::Error FewQueryAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                             ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                             ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> layer,
                             ffi::ResultBuffer<ffi::F32> out, float scale) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(),
             pd = positions.dimensions();
  if (qd.size() != 5 || kd.size() != 5 || pd.size() != 2 || layer.element_count() != 1 ||
      kd[1] != qd[0] || kd[3] != qd[2] || kd[4] != qd[4] ||
      !std::equal(kd.begin(), kd.end(), vd.begin(), vd.end()) || pd[0] != qd[0] ||
      pd[1] != qd[1] || qd[4] % 8 != 0 || qd[4] == 0) {
    return ffi::Error::InvalidArgument(
        "few_query_attention: expected q [B, T, Hkv, G, Dh], k and v [L, B, S, Hkv, Dh], "
        "positions [B, T], one layer index, Dh a multiple of 8");
  }
  const int64_t index = *layer.typed_data();
  if (index < 0 || index >= kd[0]) {
    return ffi::Error::InvalidArgument("few_query_attention: layer index out of range");
  }
  const Shape d{qd[0], qd[1], qd[2], qd[3], qd[4], kd[2]};
  const int64_t layer_floats = kd[1] * kd[2] * kd[3] * kd[4];
  Attend(pool, d, q.typed_data(), k.typed_data() + index * layer_floats,
         v.typed_data() + index * layer_floats, positions.typed_data(), scale,
         out->typed_data());
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
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
