// Paged decode attention for the CPU backends: token-generation queries attend to their sequence's
// cached keys and values where they lie, in the block KV cache, through the block table.
//
// Why a kernel: with static-shape graphs, the torch path gathers every row's blocks up to the call's
// length bucket into a dense [B, Hkv, T, D] copy and runs SDPA over the whole bucket under a mask, so
// one long sequence makes every row of the step read and copy T positions. Here each row reads only
// positions 0..position_ids[b, s] of its own blocks: the cost follows the real lengths, not the
// bucket, and nothing is copied.
//
// Registered as torch.ops.nxdi.paged_decode_attention, so torch.jit.trace records it as one graph op
// and a traced graph that uses it loads in any process that has loaded this library first.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::Float8_e4m3fn x) { return static_cast<float>(x); }

template <typename T>
inline void load_row(const T* src, float* dst, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) dst[i] = to_float(src[i]);
}

inline float dot(const float* a, const float* b, int64_t d) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < d; ++i) acc += a[i] * b[i];
  return acc;
}

inline void axpy(float p, const float* x, float* y, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) y[i] += p * x[i];
}

struct Shapes {
  int64_t batch, heads, queries, dim, kv_heads, block_size, num_blocks, table_width;
};

// One (row b, kv head hk) pair: its G = heads / kv_heads query heads times `queries` positions.
template <typename q_t, typename kv_t>
void attend(const Shapes& s, const q_t* q, const kv_t* kc, const kv_t* vc, const int64_t* table,
            const int64_t* pos, float scale, q_t* out, int64_t b, int64_t hk) {
  const int64_t d = s.dim, group = s.heads / s.kv_heads, nq = group * s.queries;
  const int64_t token_stride = s.kv_heads * d;
  std::vector<float> qf(nq * d), row(d), acc(nq * d, 0.f);
  std::vector<int64_t> last(nq);
  int64_t n = 0;
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = hk * group + g;
    for (int64_t i = 0; i < s.queries; ++i) {
      const int64_t qi = g * s.queries + i;
      load_row(q + ((b * s.heads + h) * s.queries + i) * d, qf.data() + qi * d, d);
      for (int64_t j = 0; j < d; ++j) qf[qi * d + j] *= scale;
      last[qi] = pos[b * s.queries + i];
      n = std::max(n, last[qi] + 1);
    }
  }
  std::vector<float> scores(nq * std::max<int64_t>(n, 1));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  auto token_row = [&](const kv_t* cache, int64_t t) {
    const int64_t block = table[b * s.table_width + t / s.block_size];
    return cache + (block * s.block_size + t % s.block_size) * token_stride + hk * d;
  };
  for (int64_t t = 0; t < n; ++t) {
    load_row(token_row(kc, t), row.data(), d);
    for (int64_t qi = 0; qi < nq; ++qi)
      scores[qi * n + t] = t <= last[qi] ? dot(qf.data() + qi * d, row.data(), d) : neg_inf;
  }
  std::vector<float> inv_sum(nq);
  for (int64_t qi = 0; qi < nq; ++qi) {
    float* sc = scores.data() + qi * n;
    const int64_t len = last[qi] + 1;
    float mx = neg_inf;
    for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sc[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      sc[t] = std::exp(sc[t] - mx);
      sum += sc[t];
    }
    inv_sum[qi] = 1.f / sum;
  }
  for (int64_t t = 0; t < n; ++t) {
    load_row(token_row(vc, t), row.data(), d);
    for (int64_t qi = 0; qi < nq; ++qi)
      if (t <= last[qi]) axpy(scores[qi * n + t], row.data(), acc.data() + qi * d, d);
  }
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = hk * group + g;
    for (int64_t i = 0; i < s.queries; ++i) {
      const int64_t qi = g * s.queries + i;
      q_t* dst = out + ((b * s.heads + h) * s.queries + i) * d;
      for (int64_t j = 0; j < d; ++j) dst[j] = static_cast<q_t>(acc[qi * d + j] * inv_sum[qi]);
    }
  }
}

#if defined(__AVX512F__)
// The AVX-512 path: head_dim = 16 * NV, one K or V row loaded as NV vectors of 16 floats.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const c10::Float8_e4m3fn* p) {
  alignas(64) float tmp[16];
  for (int i = 0; i < 16; ++i) tmp[i] = static_cast<float>(p[i]);
  return _mm512_load_ps(tmp);
}

// e^x for x <= 0 (softmax after subtracting the maximum): x = n ln2 + r, |r| <= ln2 / 2,
// e^r by its Taylor series to r^7 (relative error < 1e-8), times 2^n with scalef.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2, high bits
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);  // ln2, low bits
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  for (float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// Softmax numerators of sc[0..len) in place; returns 1 / their sum.
inline float softmax_in_place(float* sc, int64_t len) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sc[t]);
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + 16 <= len; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + t), vmx));
    _mm512_storeu_ps(sc + t, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (t < len) {
    const __mmask16 m = static_cast<__mmask16>((1u << (len - t)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + t), vmx));
    _mm512_mask_storeu_ps(sc + t, m, e);
    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(m, e));
  }
  return 1.f / _mm512_reduce_add_ps(vsum);
}

// Row b, KV heads [hk0, hk1) (their query heads h0..h1 are contiguous, h = hk * group + g):
// per token, each KV head's K (then V) row is read once for all of its query heads and positions.
// Taking all KV heads of a row in one task reads its blocks front to back.
template <int NV, typename q_t, typename kv_t>
void attend_avx512(const Shapes& s, const q_t* q, const kv_t* kc, const kv_t* vc,
                   const int64_t* table, const int64_t* pos, float scale, q_t* out, int64_t b,
                   int64_t hk0, int64_t hk1) {
  constexpr int64_t d = NV * 16;
  const int64_t group = s.heads / s.kv_heads, h0 = hk0 * group;
  const int64_t per_kv = group * s.queries, nq = (hk1 - hk0) * per_kv;
  const int64_t token_stride = s.kv_heads * d;
  // Query qi = (h - h0) * queries + i: contiguous in q and out from row b, head h0.
  const q_t* q_row = q + (b * s.heads + h0) * s.queries * d;
  q_t* out_row = out + (b * s.heads + h0) * s.queries * d;
  std::vector<__m512> qv(nq * NV), acc(nq * NV, _mm512_setzero_ps());
  std::vector<int64_t> last(nq);
  int64_t n = 0;
  for (int64_t qi = 0; qi < nq; ++qi) {
    alignas(64) float tmp[d];
    for (int64_t j = 0; j < d; ++j) tmp[j] = to_float(q_row[qi * d + j]) * scale;
    for (int j = 0; j < NV; ++j) qv[qi * NV + j] = _mm512_load_ps(tmp + 16 * j);
    last[qi] = pos[b * s.queries + qi % s.queries];
    n = std::max(n, last[qi] + 1);
  }
  std::vector<float> scores(nq * std::max<int64_t>(n, 1));
  // Positions go block by block (t = first + o): no division per token.
  auto for_each_token = [&](const kv_t* cache, auto&& visit) {
    for (int64_t first = 0; first < n; first += s.block_size) {
      const int64_t block = table[b * s.table_width + first / s.block_size];
      const kv_t* base = cache + block * s.block_size * token_stride;
      const int64_t count = std::min(s.block_size, n - first);
      for (int64_t o = 0; o < count; ++o) visit(first + o, base + o * token_stride);
    }
  };
  __m512 row[NV];
  for_each_token(kc, [&](int64_t t, const kv_t* token) {
    for (int64_t hk = hk0; hk < hk1; ++hk) {
      for (int j = 0; j < NV; ++j) row[j] = load16(token + hk * d + 16 * j);
      for (int64_t qi = (hk - hk0) * per_kv, end = qi + per_kv; qi < end; ++qi) {
        if (t > last[qi]) continue;
        const __m512* qq = qv.data() + qi * NV;
        __m512 dot = _mm512_mul_ps(qq[0], row[0]);
        for (int j = 1; j < NV; ++j) dot = _mm512_fmadd_ps(qq[j], row[j], dot);
        scores[qi * n + t] = _mm512_reduce_add_ps(dot);
      }
    }
  });
  std::vector<float> inv_sum(nq);
  for (int64_t qi = 0; qi < nq; ++qi) inv_sum[qi] = softmax_in_place(scores.data() + qi * n, last[qi] + 1);
  for_each_token(vc, [&](int64_t t, const kv_t* token) {
    for (int64_t hk = hk0; hk < hk1; ++hk) {
      for (int j = 0; j < NV; ++j) row[j] = load16(token + hk * d + 16 * j);
      for (int64_t qi = (hk - hk0) * per_kv, end = qi + per_kv; qi < end; ++qi) {
        if (t > last[qi]) continue;
        const __m512 p = _mm512_set1_ps(scores[qi * n + t]);
        __m512* a = acc.data() + qi * NV;
        for (int j = 0; j < NV; ++j) a[j] = _mm512_fmadd_ps(p, row[j], a[j]);
      }
    }
  });
  for (int64_t qi = 0; qi < nq; ++qi) {
    alignas(64) float tmp[d];
    const __m512 inv = _mm512_set1_ps(inv_sum[qi]);
    for (int j = 0; j < NV; ++j) _mm512_store_ps(tmp + 16 * j, _mm512_mul_ps(acc[qi * NV + j], inv));
    for (int64_t j = 0; j < d; ++j) out_row[qi * d + j] = static_cast<q_t>(tmp[j]);
  }
}
#endif

// The attention of row b for KV heads [hk0, hk1), by the fastest path for this head_dim.
template <typename q_t, typename kv_t>
void attend_heads(const Shapes& s, const q_t* q, const kv_t* kc, const kv_t* vc,
                  const int64_t* table, const int64_t* pos, float scale, q_t* out, int64_t b,
                  int64_t hk0, int64_t hk1) {
#if defined(__AVX512F__)
  switch (s.dim) {
    case 32: return attend_avx512<2>(s, q, kc, vc, table, pos, scale, out, b, hk0, hk1);
    case 64: return attend_avx512<4>(s, q, kc, vc, table, pos, scale, out, b, hk0, hk1);
    case 80: return attend_avx512<5>(s, q, kc, vc, table, pos, scale, out, b, hk0, hk1);
    case 96: return attend_avx512<6>(s, q, kc, vc, table, pos, scale, out, b, hk0, hk1);
    case 128: return attend_avx512<8>(s, q, kc, vc, table, pos, scale, out, b, hk0, hk1);
    default: break;
  }
#endif
  for (int64_t hk = hk0; hk < hk1; ++hk) attend<q_t, kv_t>(s, q, kc, vc, table, pos, scale, out, b, hk);
}

template <typename q_t, typename kv_t>
void run(const Shapes& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         const at::Tensor& table, const at::Tensor& pos, double scale, at::Tensor& out) {
  const q_t* qp = q.const_data_ptr<q_t>();
  const kv_t* kp = k.const_data_ptr<kv_t>();
  const kv_t* vp = v.const_data_ptr<kv_t>();
  const int64_t* tp = table.const_data_ptr<int64_t>();
  const int64_t* pp = pos.const_data_ptr<int64_t>();
  q_t* op = out.mutable_data_ptr<q_t>();
  // A task is a row's KV heads: all of them (its blocks read front to back) when there are
  // enough rows for every thread, else one each.
  const int64_t heads_per_task = s.batch >= at::get_num_threads() ? s.kv_heads : 1;
  const int64_t tasks_per_row = s.kv_heads / heads_per_task;
  at::parallel_for(0, s.batch * tasks_per_row, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / tasks_per_row, hk0 = task % tasks_per_row * heads_per_task;
      attend_heads<q_t, kv_t>(s, qp, kp, vp, tp, pp, static_cast<float>(scale), op, b, hk0,
                              hk0 + heads_per_task);
    }
  });
}

template <typename q_t>
void dispatch_kv(const Shapes& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& table, const at::Tensor& pos, double scale, at::Tensor& out) {
  switch (k.scalar_type()) {
    case at::kFloat: return run<q_t, float>(s, q, k, v, table, pos, scale, out);
    case at::kBFloat16: return run<q_t, c10::BFloat16>(s, q, k, v, table, pos, scale, out);
    case at::kHalf: return run<q_t, c10::Half>(s, q, k, v, table, pos, scale, out);
    case at::kFloat8_e4m3fn: return run<q_t, c10::Float8_e4m3fn>(s, q, k, v, table, pos, scale, out);
    default: TORCH_CHECK(false, "paged_decode_attention: k_cache dtype ", k.scalar_type(),
                         " is not supported (float32, bfloat16, float16, float8_e4m3fn)");
  }
}

// q [B, H, S, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_table [B, W];
// position_ids [B, S]: query s of row b attends to positions 0..position_ids[b, s], position p
// lying in block block_table[b, p / block_size] at offset p % block_size. Query head h reads KV
// head h / (H / Hkv), as SDPA's enable_gqa does. Returns [B, H, S, D] in q's dtype.
at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_table,
                                  const at::Tensor& position_ids, double scale) {
  TORCH_CHECK(q_in.dim() == 4, "paged_decode_attention: q must be [B, H, S, D], got ", q_in.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "paged_decode_attention: k_cache and v_cache must both be [blocks, block_size, Hkv, D]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_decode_attention: k_cache and v_cache dtypes differ");
  const at::Tensor q = q_in.contiguous(), k = k_cache.contiguous(), v = v_cache.contiguous();
  const at::Tensor table = block_table.to(at::kLong).contiguous();
  const at::Tensor pos = position_ids.to(at::kLong).contiguous();
  Shapes s{q.size(0), q.size(1), q.size(2), q.size(3), k.size(2), k.size(1), k.size(0),
           table.size(1)};
  TORCH_CHECK(k.size(3) == s.dim, "paged_decode_attention: head_dim of q (", s.dim,
              ") and of the cache (", k.size(3), ") differ");
  TORCH_CHECK(s.kv_heads > 0 && s.heads % s.kv_heads == 0, "paged_decode_attention: ", s.heads,
              " query heads are not a multiple of ", s.kv_heads, " KV heads");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == s.batch,
              "paged_decode_attention: block_table must be [B, W] with B = ", s.batch);
  TORCH_CHECK(pos.dim() == 2 && pos.size(0) == s.batch && pos.size(1) == s.queries,
              "paged_decode_attention: position_ids must be [B, S] = [", s.batch, ", ", s.queries, "]");
  if (pos.numel() > 0) {
    const int64_t lo = pos.min().item<int64_t>(), hi = pos.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < s.table_width * s.block_size, "paged_decode_attention: positions ",
                lo, "..", hi, " outside the block table's ", s.table_width * s.block_size);
  }
  if (table.numel() > 0) {
    const int64_t lo = table.min().item<int64_t>(), hi = table.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < s.num_blocks, "paged_decode_attention: block ids ", lo, "..", hi,
                " outside the cache's ", s.num_blocks, " blocks");
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_kv<float>(s, q, k, v, table, pos, scale, out); break;
    case at::kBFloat16: dispatch_kv<c10::BFloat16>(s, q, k, v, table, pos, scale, out); break;
    case at::kHalf: dispatch_kv<c10::Half>(s, q, k, v, table, pos, scale, out); break;
    default: TORCH_CHECK(false, "paged_decode_attention: q dtype ", q.scalar_type(),
                         " is not supported (float32, bfloat16, float16)");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(nxdi, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor position_ids, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(nxdi, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
