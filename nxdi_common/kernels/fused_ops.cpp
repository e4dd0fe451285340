// Fused element-wise ops for the CPU backends: each replaces a chain of small torch ops that a
// decode step runs per layer (a 32-row step spends ~11 ms in ~1,900 such ops). Every op computes
// exactly what the torch chain it replaces computes, rounding to the tensor dtype wherever the
// chain rounds, so the fused and torch paths differ only where a float32 sum is added up in
// another order or e^x is evaluated by another polynomial (within an ulp of float32).
//
// Registered as torch.ops.nxdi.{rms_norm, rope_qk, rope_qk_store, silu_mul, topk} in the same library as the paged
// attention kernel, so traced graphs record them as single ops.
#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using namespace nxdi_simd;

template <typename T> float round_scalar(float x) { return to_float(from_float<T>(x)); }

// f(T{}) for the tensor dtype T of `type` (float32, bfloat16, float16); `op` names the caller.
template <typename F>
void dispatch_float(at::ScalarType type, const char* op, F&& f) {
  switch (type) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: TORCH_CHECK(false, op, ": dtype ", type, " is not supported");
  }
}

// RMSNorm as modules/norm.py computes it: in float32, x * rsqrt(mean(x^2) + eps), rounded to the
// dtype, then times the weight (a product of two dtype values, rounded again). Rows [begin, end)
// on the calling thread.
template <typename T>
void rms_norm_range(const T* x, const T* w, T* out, int64_t begin, int64_t end, int64_t n,
                    float eps) {
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + r * n;
    T* yr = out + r * n;
    int64_t i = 0;
    float ss = 0.f;
#if defined(__AVX512F__)
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (; i + 32 <= n; i += 32) {
      const __m512 a = load16(xr + i), b = load16(xr + i + 16);
      acc0 = _mm512_fmadd_ps(a, a, acc0);
      acc1 = _mm512_fmadd_ps(b, b, acc1);
    }
    for (; i + 16 <= n; i += 16) {
      const __m512 a = load16(xr + i);
      acc0 = _mm512_fmadd_ps(a, a, acc0);
    }
    ss = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      const __m256 a = load8(xr + i), b = load8(xr + i + 8);
      acc0 = _mm256_fmadd_ps(a, a, acc0);
      acc1 = _mm256_fmadd_ps(b, b, acc1);
    }
    for (; i + 8 <= n; i += 8) {
      const __m256 a = load8(xr + i);
      acc0 = _mm256_fmadd_ps(a, a, acc0);
    }
    ss = reduce_add8(_mm256_add_ps(acc0, acc1));
#endif
    for (; i < n; ++i) ss += to_float(xr[i]) * to_float(xr[i]);
    const float scale = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    i = 0;
#if defined(__AVX512F__)
    const __m512 vs = _mm512_set1_ps(scale);
    for (; i + 16 <= n; i += 16) {
      const __m512 normed = round16<T>(_mm512_mul_ps(load16(xr + i), vs));
      store16(yr + i, _mm512_mul_ps(load16(w + i), normed));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 vs = _mm256_set1_ps(scale);
    for (; i + 8 <= n; i += 8) {
      const __m256 normed = round8<T>(_mm256_mul_ps(load8(xr + i), vs));
      store8(yr + i, _mm256_mul_ps(load8(w + i), normed));
    }
#endif
    for (; i < n; ++i)
      yr[i] = from_float<T>(to_float(w[i]) * round_scalar<T>(to_float(xr[i]) * scale));
  }
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    rms_norm_range(x, w, out, begin, end, n, eps);
  });
}

// x [..., n] -> weight * normalized x, in x's dtype.
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x_in.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x_in.size(-1),
              "rms_norm: weight must be [n] for x [..., n]; got x ", x_in.sizes(), ", weight ",
              weight.sizes());
  TORCH_CHECK(x_in.scalar_type() == weight.scalar_type(), "rms_norm: x and weight dtypes differ");
  const at::Tensor x = x_in.contiguous(), w = weight.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  dispatch_float(x.scalar_type(), "rms_norm", [&](auto t) {
    using T = decltype(t);
    rms_norm_rows(x.const_data_ptr<T>(), w.const_data_ptr<T>(), out.mutable_data_ptr<T>(), rows,
                  n, static_cast<float>(eps));
  });
  return out;
}

// RoPE of one head as modules/rope.py's apply_rope computes it: x * cos + roll(x, D/2) *
// signed_sin, each product and the sum rounded to the dtype.
template <typename T>
inline void rope_head(const T* xr, const T* c, const T* sn, T* yr, int64_t d) {
  const int64_t half = d / 2;
  int64_t i = 0;
#if defined(__AVX512F__)
  if (half % 16 == 0)
    for (; i < d; i += 16) {
      const int64_t j = i < half ? i + half : i - half;  // roll by half: x[i - half mod d]
      const __m512 a = round16<T>(_mm512_mul_ps(load16(xr + i), load16(c + i)));
      const __m512 b = round16<T>(_mm512_mul_ps(load16(xr + j), load16(sn + i)));
      store16(yr + i, _mm512_add_ps(a, b));
    }
#elif defined(__AVX2__) && defined(__FMA__)
  if (half % 8 == 0)
    for (; i < d; i += 8) {
      const int64_t j = i < half ? i + half : i - half;
      const __m256 a = round8<T>(_mm256_mul_ps(load8(xr + i), load8(c + i)));
      const __m256 b = round8<T>(_mm256_mul_ps(load8(xr + j), load8(sn + i)));
      store8(yr + i, _mm256_add_ps(a, b));
    }
#endif
  for (; i < d; ++i) {
    const int64_t j = i < half ? i + half : i - half;
    const float a = round_scalar<T>(to_float(xr[i]) * to_float(c[i]));
    const float b = round_scalar<T>(to_float(xr[j]) * to_float(sn[i]));
    yr[i] = from_float<T>(a + b);
  }
}

// Rows (b, s) of x [B, S, heads, D]: the first `rotated` heads rotated, the rest copied, head h
// of row bs to dest(bs, h). cos/sin [B, 1, S, D]: row (b, s) is bs.
template <typename T, typename Dest>
void rope_rows(const T* x, const T* cos, const T* sin, int64_t rows, int64_t heads,
               int64_t rotated, int64_t d, Dest&& dest) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t bs = begin; bs < end; ++bs) {
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + (bs * heads + h) * d;
        if (h < rotated)
          rope_head(xr, cos + bs * d, sin + bs * d, dest(bs, h), d);
        else
          std::copy(xr, xr + d, dest(bs, h));
      }
    }
  });
}

// Shapes rope_qk and rope_qk_store share: x [B, S, heads, D] (or, where `flat_dim` is given,
// [B, S, heads * flat_dim]), cos and sin [B, 1, S, D] in x's dtype. Returns D.
int64_t check_rope_inputs(const char* op, const at::Tensor& x, const at::Tensor& cos,
                          const at::Tensor& sin, int64_t flat_dim = 0) {
  if (flat_dim > 0 && x.dim() == 3) {
    TORCH_CHECK(x.size(2) % flat_dim == 0, op, ": x [B, S, ", x.size(2), "] is not whole heads of ",
                flat_dim);
  } else {
    TORCH_CHECK(x.dim() == 4, op, ": x must be [B, S, heads, D]",
                flat_dim > 0 ? " or [B, S, heads * D]" : "", ", got ", x.sizes());
  }
  const int64_t b = x.size(0), s = x.size(1), d = x.dim() == 4 ? x.size(3) : flat_dim;
  TORCH_CHECK(d % 2 == 0, op, ": head_dim must be even, got ", d);
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 4 && t->size(0) == b && t->size(1) == 1 && t->size(2) == s &&
                t->size(3) == d, op, ": cos and sin must be [", b, ", 1, ", s, ", ", d,
                "], got ", t->sizes());
    TORCH_CHECK(t->scalar_type() == x.scalar_type(), op, ": cos/sin dtype differs from x");
  }
  return d;
}

// x [B, S, heads, D]; cos, sin [B, 1, S, D] from rope_cos_sin: the first `rotated` heads rotated.
at::Tensor rope_qk(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                   int64_t rotated) {
  check_rope_inputs("rope_qk", x_in, cos_in, sin_in);
  const int64_t heads = x_in.size(2), d = x_in.size(3);
  TORCH_CHECK(rotated >= 0 && rotated <= heads, "rope_qk: rotated heads must lie in 0..", heads);
  const at::Tensor x = x_in.contiguous(), c = cos_in.contiguous(), sn = sin_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  dispatch_float(x.scalar_type(), "rope_qk", [&](auto t) {
    using T = decltype(t);
    T* y = out.mutable_data_ptr<T>();
    rope_rows(x.const_data_ptr<T>(), c.const_data_ptr<T>(), sn.const_data_ptr<T>(),
              x.size(0) * x.size(1), heads, rotated, d,
              [&](int64_t bs, int64_t h) { return y + (bs * heads + h) * d; });
  });
  return out;
}

// A fused attention's q, k, v heads x [B, S, q_heads + 2 * kv_heads, D] (q, then k, then v), or
// the QKV projection's output [B, S, (q_heads + 2 * kv_heads) * D] as it is (D: the cache's; no
// view of it made, which in a decode step's graph was an unflatten node per layer, ~3.7 us each
// right after the projection's weight stream; the Intel VM with AMX, session 56):
// q and k rotated as rope_qk rotates them, k and v stored in layer `layer` of the block KV cache
// [layers, 2, blocks, block_size, kv_heads, D] at slots [B, S] (slot = block * block_size +
// offset), as the block cache manager's write stores them. Returns the rotated q [B, S, q_heads,
// D]. One op instead of rope, split, transposes, stack and index_copy_ per layer.
at::Tensor rope_qk_store(const at::Tensor& x_in, const at::Tensor& cos_in,
                         const at::Tensor& sin_in, int64_t q_heads, at::Tensor& cache,
                         int64_t layer, const at::Tensor& slots_in) {
  TORCH_CHECK(cache.dim() == 6, "rope_qk_store: cache must be [layers, 2, blocks, block_size, "
              "kv_heads, D], got ", cache.sizes());
  const int64_t d = check_rope_inputs("rope_qk_store", x_in, cos_in, sin_in, cache.size(5));
  const int64_t b = x_in.size(0), s = x_in.size(1);
  const int64_t heads = x_in.dim() == 4 ? x_in.size(2) : x_in.size(2) / d;
  const int64_t kv_heads = (heads - q_heads) / 2;
  TORCH_CHECK(q_heads >= 1 && kv_heads >= 1 && q_heads + 2 * kv_heads == heads,
              "rope_qk_store: x's ", heads, " heads are not q_heads (", q_heads,
              ") + 2 equal numbers of key and value heads");
  TORCH_CHECK(cache.dim() == 6 && cache.size(1) == 2 && cache.size(4) == kv_heads &&
              cache.size(5) == d && cache.is_contiguous(),
              "rope_qk_store: cache must be a contiguous [layers, 2, blocks, block_size, ",
              kv_heads, ", ", d, "], got ", cache.sizes());
  TORCH_CHECK(cache.scalar_type() == x_in.scalar_type(), "rope_qk_store: cache dtype ",
              cache.scalar_type(), " differs from x's ", x_in.scalar_type());
  TORCH_CHECK(layer >= 0 && layer < cache.size(0), "rope_qk_store: layer ", layer,
              " is not in 0..", cache.size(0) - 1);
  TORCH_CHECK(slots_in.dim() == 2 && slots_in.size(0) == b && slots_in.size(1) == s &&
              slots_in.scalar_type() == at::kLong,
              "rope_qk_store: slots must be int64 [", b, ", ", s, "], got ",
              slots_in.scalar_type(), " ", slots_in.sizes());
  const at::Tensor x = x_in.contiguous(), c = cos_in.contiguous(), sn = sin_in.contiguous();
  const at::Tensor slots = slots_in.contiguous();
  const int64_t num_slots = cache.size(2) * cache.size(3);
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < b * s; ++i)
    TORCH_CHECK(slot[i] >= 0 && slot[i] < num_slots, "rope_qk_store: slot ", slot[i],
                " is not in 0..", num_slots - 1);
  at::Tensor q = at::empty({b, s, q_heads, d}, x.options());
  dispatch_float(x.scalar_type(), "rope_qk_store", [&](auto t) {
    using T = decltype(t);
    T* qp = q.mutable_data_ptr<T>();
    T* k_cache = cache.mutable_data_ptr<T>() + layer * 2 * num_slots * kv_heads * d;
    T* v_cache = k_cache + num_slots * kv_heads * d;
    rope_rows(x.const_data_ptr<T>(), c.const_data_ptr<T>(), sn.const_data_ptr<T>(), b * s,
              heads, q_heads + kv_heads, d, [&](int64_t bs, int64_t h) {
                if (h < q_heads) return qp + (bs * q_heads + h) * d;
                T* base = h < q_heads + kv_heads ? k_cache : v_cache;
                const int64_t head = h < q_heads + kv_heads ? h - q_heads : h - q_heads - kv_heads;
                return base + (slot[bs] * kv_heads + head) * d;
              });
  });
  return q;
}

// F.silu(gate) * up for x = [gate | up] on the last dimension, as the MLP computes it: silu in
// float32 (gate / (1 + e^-gate)) rounded to the dtype, then the product rounded.
template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = x + r * 2 * n;
      const T* u = g + n;
      T* y = out + r * n;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + 16 <= n; i += 16) {
        const __m512 gv = load16(g + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 silu = round16<T>(_mm512_div_ps(gv, _mm512_add_ps(one, e)));
        store16(y + i, _mm512_mul_ps(silu, load16(u + i)));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      const __m256 one = _mm256_set1_ps(1.f);
      for (; i + 8 <= n; i += 8) {
        const __m256 gv = load8(g + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        const __m256 silu = round8<T>(_mm256_div_ps(gv, _mm256_add_ps(one, e)));
        store8(y + i, _mm256_mul_ps(silu, load8(u + i)));
      }
#endif
      for (; i < n; ++i) {
        const float gv = to_float(g[i]);
        y[i] = from_float<T>(round_scalar<T>(gv / (1.f + std::exp(-gv))) * to_float(u[i]));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) % 2 == 0,
              "silu_mul: the last dimension must be [gate | up], even, got ", x_in.sizes());
  const at::Tensor x = x_in.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  const int64_t n = shape.back() / 2, rows = n ? x.numel() / (2 * n) : 0;
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  dispatch_float(x.scalar_type(), "silu_mul", [&](auto t) {
    using T = decltype(t);
    silu_mul_rows(x.const_data_ptr<T>(), out.mutable_data_ptr<T>(), rows, n);
  });
  return out;
}

// Top-k of one float32 row, sorted by value (descending), equal values by index (ascending);
// NaN counts as larger than any number, as in torch.topk. With AVX-512 or AVX2 and a row of at
// least 8k values: the row is cut into c >= k equal chunks, and the k-th largest of their maxima
// bounds the k-th largest value from below (k chunks each hold a value >= it), so only the
// values >= that bound are sorted. More chunks than k give a higher bound and fewer candidates
// (kChunksPerK; with c = k the bound was the smallest chunk maximum).
constexpr int64_t kChunksPerK = 4;

// The k-th largest of `v` (no NaN; 1 <= k <= v.size()); reorders v.
float kth_largest(std::vector<float>& v, int64_t k) {
  std::nth_element(v.begin(), v.begin() + (k - 1), v.end(), std::greater<float>());
  return v[k - 1];
}

// The top k of a row of n logits (float32, or bf16 / float16 read as their float32 values, so
// the decode graph's bf16 logits are not converted to a float32 copy first: that copy took
// 0.25 ms a step for 16 rows of 49152 on the Intel VM with AMX, session 57).
template <typename T>
void topk_row(const T* x, int64_t n, int64_t k, float* values, int64_t* indices,
              std::vector<std::pair<float, int64_t>>& cand, std::vector<float>& maxima) {
  auto at = [&](int64_t i) { return to_float(x[i]); };
  auto before = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
    const bool an = std::isnan(a.first), bn = std::isnan(b.first);
    if (an != bn) return an;
    if (!an && a.first != b.first) return a.first > b.first;
    return a.second < b.second;
  };
  cand.clear();
  cand.reserve(static_cast<size_t>(std::min<int64_t>(n, 16 * k)));
  bool all = true;
#if defined(__AVX512F__)
  if (n >= 8 * k) {
    const int64_t chunks = std::min(kChunksPerK * k, n / 8);
    const int64_t chunk = n / chunks;  // rounded down: at least `chunks` chunks, each >= 8
    maxima.clear();
    __mmask16 nan = 0;
    for (int64_t c0 = 0; c0 < n; c0 += chunk) {
      const int64_t c1 = std::min(n, c0 + chunk);
      __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      int64_t i = c0;
      for (; i + 16 <= c1; i += 16) {
        const __m512 v = load16(x + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, v);
      }
      float m = _mm512_reduce_max_ps(mx);
      for (; i < c1; ++i) {
        nan |= std::isnan(at(i)) ? 1 : 0;
        m = std::max(m, at(i));
      }
      maxima.push_back(m);
    }
    if (!nan) {  // every value >= bound is a candidate
      const float bound = kth_largest(maxima, k);
      all = false;
      const __m512 vb = _mm512_set1_ps(bound);
      alignas(64) int32_t idx[16];
      alignas(64) float val[16];
      const __m512i step = _mm512_set1_epi32(16);
      __m512i pos = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      int64_t i = 0;
      for (; i + 16 <= n; i += 16, pos = _mm512_add_epi32(pos, step)) {
        const __m512 v = load16(x + i);
        const __mmask16 m = _mm512_cmp_ps_mask(v, vb, _CMP_GE_OQ);
        if (m == 0) continue;
        const int cnt = __builtin_popcount(m);
        _mm512_mask_compressstoreu_epi32(idx, m, pos);
        _mm512_mask_compressstoreu_ps(val, m, v);
        for (int j = 0; j < cnt; ++j) cand.emplace_back(val[j], idx[j]);
      }
      for (; i < n; ++i)
        if (at(i) >= bound) cand.emplace_back(at(i), i);
    }
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (n >= 8 * k) {  // as above, 8 at a time
    const int64_t chunks = std::min(kChunksPerK * k, n / 8);
    const int64_t chunk = n / chunks;  // rounded down: at least `chunks` chunks, each >= 8
    maxima.clear();
    __m256 nan = _mm256_setzero_ps();
    for (int64_t c0 = 0; c0 < n; c0 += chunk) {
      const int64_t c1 = std::min(n, c0 + chunk);
      __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      int64_t i = c0;
      for (; i + 8 <= c1; i += 8) {
        const __m256 v = load8(x + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        mx = _mm256_max_ps(mx, v);
      }
      float m = reduce_max8(mx);
      bool tail_nan = false;
      for (; i < c1; ++i) {
        tail_nan |= std::isnan(at(i));
        m = std::max(m, at(i));
      }
      if (tail_nan) nan = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
      maxima.push_back(m);
    }
    if (_mm256_movemask_ps(nan) == 0) {  // every value >= bound is a candidate
      const float bound = kth_largest(maxima, k);
      all = false;
      const __m256 vb = _mm256_set1_ps(bound);
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) {
        int m = _mm256_movemask_ps(_mm256_cmp_ps(load8(x + i), vb, _CMP_GE_OQ));
        for (; m != 0; m &= m - 1) {
          const int64_t j = i + __builtin_ctz(m);
          cand.emplace_back(at(j), j);
        }
      }
      for (; i < n; ++i)
        if (at(i) >= bound) cand.emplace_back(at(i), i);
    }
  }
#endif
  if (all)
    for (int64_t i = 0; i < n; ++i) cand.emplace_back(at(i), i);
  std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end(), before);  // top k first
  std::sort(cand.begin(), cand.begin() + k, before);
  for (int64_t j = 0; j < k; ++j) values[j] = cand[j].first, indices[j] = cand[j].second;
}

// logits [B, V] -> (values [B, k] float32, indices [B, k] int64): torch.topk(logits.float(), k)
// with its ordering made exact (ties by index). Rows where `greedy` [B] (optional) is true get
// only their first candidate (the argmax: one scan of the row where k = 256 sorts hundreds of
// values); their other k - 1 values are -inf and their indices the first's. The dynamic sampler
// reads nothing else of a greedy row.
std::tuple<at::Tensor, at::Tensor> topk(const at::Tensor& logits_in, int64_t k,
                                        const std::optional<at::Tensor>& greedy) {
  TORCH_CHECK(logits_in.dim() == 2, "topk: logits must be [B, V], got ", logits_in.sizes());
  const int64_t b = logits_in.size(0), n = logits_in.size(1);
  TORCH_CHECK(k >= 1 && k <= n, "topk: k must lie in 1..", n, ", got ", k);
  at::Tensor greedy_rows;
  if (greedy.has_value()) {
    TORCH_CHECK(greedy->dim() == 1 && greedy->size(0) == b, "topk: greedy must be [", b,
                "] (one flag a row), got ", greedy->sizes());
    greedy_rows = greedy->to(at::kBool).contiguous();
  }
  const bool* gp = greedy_rows.defined() ? greedy_rows.const_data_ptr<bool>() : nullptr;
  const at::ScalarType type = logits_in.scalar_type();
  const at::Tensor x = type == at::kFloat || type == at::kBFloat16 || type == at::kHalf
                           ? logits_in.contiguous() : logits_in.to(at::kFloat).contiguous();
  at::Tensor values = at::empty({b, k}, x.options().dtype(at::kFloat));
  at::Tensor indices = at::empty({b, k}, x.options().dtype(at::kLong));
  float* vp = values.mutable_data_ptr<float>();
  int64_t* ip = indices.mutable_data_ptr<int64_t>();
  dispatch_float(x.scalar_type(), "topk", [&](auto t) {
    using T = decltype(t);
    const T* xp = x.const_data_ptr<T>();
    at::parallel_for(0, b, 1, [&](int64_t begin, int64_t end) {
      std::vector<std::pair<float, int64_t>> cand;
      std::vector<float> maxima;
      for (int64_t r = begin; r < end; ++r) {
        const bool first_only = gp != nullptr && gp[r];
        topk_row(xp + r * n, n, first_only ? 1 : k, vp + r * k, ip + r * k, cand, maxima);
        if (first_only)
          for (int64_t j = 1; j < k; ++j)
            vp[r * k + j] = -std::numeric_limits<float>::infinity(), ip[r * k + j] = ip[r * k];
      }
    });
  });
  return {values, indices};
}

// Copy one block row with non-temporal stores where the destination is 64-byte aligned and the
// row a multiple of 64 bytes: a received KV block goes to a cold, scattered place in a large
// pool, and plain stores first read every destination line (read-for-ownership), which made
// such copies run at about half the speed (bench in BENCHMARKS.md, session 16).
inline void copy_row_streaming(char* d, const char* s, int64_t bytes) {
#if defined(__AVX512F__)
  if (reinterpret_cast<uintptr_t>(d) % 64 == 0 && bytes % 64 == 0) {
    for (int64_t o = 0; o < bytes; o += 64)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(d + o),
                          _mm512_loadu_si512(reinterpret_cast<const void*>(s + o)));
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)  // (simd.h includes immintrin.h for these two)
  if (reinterpret_cast<uintptr_t>(d) % 32 == 0 && bytes % 32 == 0) {
    for (int64_t o = 0; o < bytes; o += 32)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + o),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + o)));
    return;
  }
#endif
  std::memcpy(d, s, bytes);
}

// dst [L, N, ...] and src [L, n, ...] (same dtype and trailing shape, each [l, i] slice one
// contiguous row): dst[l, blocks[i]] = src[l, i] for every l and i. A KV transfer writes a
// received chunk into its sequence's (scattered) cache blocks with this.
void copy_blocks(at::Tensor& dst, const at::Tensor& blocks_in, const at::Tensor& src) {
  TORCH_CHECK(dst.dim() >= 2 && src.dim() == dst.dim(), "copy_blocks: dst [L, N, ...] and src "
              "[L, n, ...] must have the same rank >= 2, got ", dst.sizes(), " and ", src.sizes());
  TORCH_CHECK(dst.scalar_type() == src.scalar_type(), "copy_blocks: dst and src dtypes differ");
  TORCH_CHECK(dst.size(0) == src.size(0) && dst.sizes().slice(2) == src.sizes().slice(2),
              "copy_blocks: shapes ", dst.sizes(), " and ", src.sizes(), " disagree");
  const at::Tensor blocks = blocks_in.to(at::kLong).contiguous();
  TORCH_CHECK(blocks.dim() == 1 && blocks.size(0) == src.size(1), "copy_blocks: blocks must be "
              "[", src.size(1), "], got ", blocks_in.sizes());
  const int64_t layers = src.size(0), n = src.size(1), num_blocks = dst.size(1);
  int64_t row = 1;
  for (int64_t d = 2; d < src.dim(); ++d) row *= src.size(d);
  const at::Tensor* both[] = {&dst, &src};
  for (const at::Tensor* t : both) {  // each [l, i] slice one contiguous row
    int64_t expected = 1;
    for (int64_t d = t->dim() - 1; d >= 2; --d) {
      TORCH_CHECK(t->size(d) == 1 || t->stride(d) == expected,
                  "copy_blocks: the rows of a tensor of shape ", t->sizes(), " and strides ",
                  t->strides(), " are not contiguous");
      expected *= t->size(d);
    }
  }
  const int64_t* bp = blocks.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(bp[i] >= 0 && bp[i] < num_blocks, "copy_blocks: block ", bp[i], " outside 0..",
                num_blocks - 1);
  const int64_t item = src.element_size(), bytes = row * item;
  char* dp = static_cast<char*>(dst.data_ptr());
  const char* sp = static_cast<const char*>(src.const_data_ptr());
  const int64_t ds0 = dst.stride(0) * item, ds1 = dst.stride(1) * item;
  const int64_t ss0 = src.stride(0) * item, ss1 = src.stride(1) * item;
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t i = 0; i < n; ++i)
      copy_row_streaming(dp + l * ds0 + bp[i] * ds1, sp + l * ss0 + i * ss1, bytes);
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  _mm_sfence();  // the streamed stores are visible before anyone reads the blocks
#endif
}

// One sequence's prompt KV for layers [layer_start, layer_start + l) and positions
// [start, start + T) into a block cache: cache [L, 2, N, BS, H, D] (K at [:, 0], V at [:, 1];
// each block's [BS, H, D] contiguous), table [>= ceil((start + T) / BS)] the sequence's block ids,
// k and v [l, T, H, D] (each layer's [T, H, D] contiguous). Whole blocks are streamed, the
// partial ones at the ends copied; everything is checked before the first byte is written. A
// decode worker writes each received KV chunk with one call of this.
void write_prompt_kv(at::Tensor& cache, int64_t layer_start, const at::Tensor& table_in,
                     int64_t start, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(cache.dim() == 6 && cache.size(1) == 2, "write_prompt_kv: cache must be [L, 2, N, "
              "BS, H, D], got ", cache.sizes());
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes(), "write_prompt_kv: k and v must be one "
              "[l, T, H, D] shape, got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.scalar_type() == cache.scalar_type() && v.scalar_type() == cache.scalar_type(),
              "write_prompt_kv: k, v and cache dtypes differ");
  TORCH_CHECK(k.size(2) == cache.size(4) && k.size(3) == cache.size(5), "write_prompt_kv: k "
              "heads and head_dim ", k.sizes(), " do not match the cache ", cache.sizes());
  const int64_t layers = k.size(0), tokens = k.size(1), bs = cache.size(3);
  const int64_t row = cache.size(4) * cache.size(5);  // elements of one position
  TORCH_CHECK(layer_start >= 0 && layer_start + layers <= cache.size(0), "write_prompt_kv: "
              "layers ", layer_start, "..", layer_start + layers, " outside 0..", cache.size(0));
  TORCH_CHECK(cache.stride(5) == 1 && cache.stride(4) == cache.size(5) &&
              cache.stride(3) == row, "write_prompt_kv: the cache's blocks are not contiguous");
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->stride(3) == 1 && t->stride(2) == t->size(3) &&
                (t->size(1) == 1 || t->stride(1) == row),
                "write_prompt_kv: each layer of k and v must be contiguous");
  const at::Tensor table = table_in.to(at::kLong).contiguous();
  TORCH_CHECK(start >= 0 && table.dim() == 1 && (tokens == 0 ||
              (start + tokens - 1) / bs < table.size(0)), "write_prompt_kv: positions ", start,
              "..", start + tokens, " need ", (start + tokens + bs - 1) / bs, " blocks, the table "
              "has ", table.numel());
  const int64_t* tp = table.const_data_ptr<int64_t>();
  const int64_t first = start / bs, last = tokens ? (start + tokens - 1) / bs : first - 1;
  for (int64_t b = first; b <= last; ++b)
    TORCH_CHECK(tp[b] >= 0 && tp[b] < cache.size(2), "write_prompt_kv: block ", tp[b],
                " outside 0..", cache.size(2) - 1);
  const int64_t item = cache.element_size(), pos_bytes = row * item;
  char* cp = static_cast<char*>(cache.data_ptr());
  const int64_t c0 = cache.stride(0) * item, c1 = cache.stride(1) * item, c2 = cache.stride(2) * item;
  const at::Tensor* src[] = {&k, &v};
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t w = 0; w < 2; ++w) {
      const char* sp = static_cast<const char*>(src[w]->const_data_ptr()) +
                       l * src[w]->stride(0) * item;
      char* layer = cp + (layer_start + l) * c0 + w * c1;
      for (int64_t p = start, end = start + tokens; p < end;) {
        const int64_t off = p % bs, n = std::min(bs - off, end - p);
        copy_row_streaming(layer + tp[p / bs] * c2 + off * pos_bytes, sp + (p - start) * pos_bytes,
                           n * pos_bytes);
        p += n;
      }
    }
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  _mm_sfence();
#endif
}

// The calling thread's torch intra-op thread count as this library's at::parallel_for uses it.
// at::parallel_for gives a thread its count on its first call, from torch's process-wide default
// (the last count set on any thread), through an inline function with a per-thread "done" flag:
// this library has its own copy of that flag, apart from libtorch's. A thread whose count must
// not follow that default (nxdi_common/serving/compute.py) calls this right after setting it.
int64_t thread_count() {
  at::internal::lazy_init_num_threads();
  return at::get_num_threads();
}

}  // namespace

namespace nxdi_fused {
// nxdi::rms_norm for panel_linear's `norm` argument (one op where a norm feeds a product).
at::Tensor rms_norm_of(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm(x, weight, eps);
}
void rms_norm_here(const c10::BFloat16* x, const c10::BFloat16* w, c10::BFloat16* out,
                   int64_t rows, int64_t n, float eps) {
  rms_norm_range(x, w, out, 0, rows, n, eps);
}
}  // namespace nxdi_fused

TORCH_LIBRARY_FRAGMENT(nxdi, m) {
  m.def("thread_count() -> int");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_qk(Tensor x, Tensor cos, Tensor sin, int rotated) -> Tensor");
  m.def("rope_qk_store(Tensor x, Tensor cos, Tensor sin, int q_heads, Tensor(a!) cache, "
        "int layer, Tensor slots) -> Tensor");
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("topk(Tensor logits, int k, Tensor? greedy=None) -> (Tensor, Tensor)");
  m.def("copy_blocks(Tensor(a!) dst, Tensor blocks, Tensor src) -> ()");
  m.def("write_prompt_kv(Tensor(a!) cache, int layer_start, Tensor table, int start, Tensor k, "
        "Tensor v) -> ()");
}

TORCH_LIBRARY_IMPL(nxdi, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_qk", &rope_qk);
  m.impl("rope_qk_store", &rope_qk_store);
  m.impl("silu_mul", &silu_mul);
  m.impl("topk", &topk);
  m.impl("copy_blocks", &copy_blocks);
  m.impl("write_prompt_kv", &write_prompt_kv);
}

TORCH_LIBRARY_IMPL(nxdi, CatchAll, m) {
  m.impl("thread_count", &thread_count);
}
