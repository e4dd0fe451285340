// Fused element-wise ops for the CPU backends: each replaces a chain of small torch ops that a
// decode step runs per layer (a 32-row step spends ~11 ms in ~1,900 such ops). Every op computes
// exactly what the torch chain it replaces computes, rounding to the tensor dtype wherever the
// chain rounds, so the fused and torch paths differ only where a float32 sum is added up in
// another order or e^x is evaluated by another polynomial (within an ulp of float32).
//
// Registered as torch.ops.nxdi.{rms_norm, rope_qk, silu_mul} in the same library as the paged
// attention kernel, so traced graphs record them as single ops.
#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace {

using namespace nxdi_simd;

template <typename T> float round_scalar(float x) { return to_float(from_float<T>(x)); }

// RMSNorm as modules/norm.py computes it: in float32, x * rsqrt(mean(x^2) + eps), rounded to the
// dtype, then times the weight (a product of two dtype values, rounded again).
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
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
#endif
      for (; i < n; ++i) ss += to_float(xr[i]) * to_float(xr[i]);
      const float scale = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      i = 0;
#if defined(__AVX512F__)
      const __m512 vs = _mm512_set1_ps(scale);
      for (; i + 16 <= n; i += 16)
        store16(yr + i, _mm512_mul_ps(load16(w + i), round16<T>(_mm512_mul_ps(load16(xr + i), vs))));
#endif
      for (; i < n; ++i)
        yr[i] = from_float<T>(to_float(w[i]) * round_scalar<T>(to_float(xr[i]) * scale));
    }
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
  const float e = static_cast<float>(eps);
  switch (x.scalar_type()) {
    case at::kFloat:
      rms_norm_rows(x.const_data_ptr<float>(), w.const_data_ptr<float>(),
                    out.mutable_data_ptr<float>(), rows, n, e);
      break;
    case at::kBFloat16:
      rms_norm_rows(x.const_data_ptr<c10::BFloat16>(), w.const_data_ptr<c10::BFloat16>(),
                    out.mutable_data_ptr<c10::BFloat16>(), rows, n, e);
      break;
    case at::kHalf:
      rms_norm_rows(x.const_data_ptr<c10::Half>(), w.const_data_ptr<c10::Half>(),
                    out.mutable_data_ptr<c10::Half>(), rows, n, e);
      break;
    default: TORCH_CHECK(false, "rms_norm: dtype ", x.scalar_type(), " is not supported");
  }
  return out;
}

// RoPE as modules/rope.py's apply_rope computes it: x * cos + roll(x, D/2) * signed_sin, each
// product and the sum rounded to the dtype; heads past `rotated` (the values) are copied.
template <typename T>
void rope_rows(const T* x, const T* cos, const T* sin, T* out, int64_t batch, int64_t seq,
               int64_t heads, int64_t rotated, int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, batch * seq, 16, [&](int64_t begin, int64_t end) {
    for (int64_t bs = begin; bs < end; ++bs) {
      const T* c = cos + bs * d;  // cos/sin [B, 1, S, D]: row (b, s) is bs
      const T* sn = sin + bs * d;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + (bs * heads + h) * d;
        T* yr = out + (bs * heads + h) * d;
        if (h >= rotated) {
          std::copy(xr, xr + d, yr);
          continue;
        }
        int64_t i = 0;
#if defined(__AVX512F__)
        if (half % 16 == 0)
          for (; i < d; i += 16) {
            const int64_t j = i < half ? i + half : i - half;  // roll by half: x[i - half mod d]
            const __m512 a = round16<T>(_mm512_mul_ps(load16(xr + i), load16(c + i)));
            const __m512 b = round16<T>(_mm512_mul_ps(load16(xr + j), load16(sn + i)));
            store16(yr + i, _mm512_add_ps(a, b));
          }
#endif
        for (; i < d; ++i) {
          const int64_t j = i < half ? i + half : i - half;
          const float a = round_scalar<T>(to_float(xr[i]) * to_float(c[i]));
          const float b = round_scalar<T>(to_float(xr[j]) * to_float(sn[i]));
          yr[i] = from_float<T>(a + b);
        }
      }
    }
  });
}

// x [B, S, heads, D]; cos, sin [B, 1, S, D] from rope_cos_sin: the first `rotated` heads rotated.
at::Tensor rope_qk(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                   int64_t rotated) {
  TORCH_CHECK(x_in.dim() == 4, "rope_qk: x must be [B, S, heads, D], got ", x_in.sizes());
  const int64_t b = x_in.size(0), s = x_in.size(1), heads = x_in.size(2), d = x_in.size(3);
  TORCH_CHECK(d % 2 == 0, "rope_qk: head_dim must be even, got ", d);
  TORCH_CHECK(rotated >= 0 && rotated <= heads, "rope_qk: rotated heads must lie in 0..", heads);
  for (const at::Tensor* t : {&cos_in, &sin_in}) {
    TORCH_CHECK(t->dim() == 4 && t->size(0) == b && t->size(1) == 1 && t->size(2) == s &&
                t->size(3) == d, "rope_qk: cos and sin must be [", b, ", 1, ", s, ", ", d,
                "], got ", t->sizes());
    TORCH_CHECK(t->scalar_type() == x_in.scalar_type(), "rope_qk: cos/sin dtype differs from x");
  }
  const at::Tensor x = x_in.contiguous(), c = cos_in.contiguous(), sn = sin_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  switch (x.scalar_type()) {
#define NXDI_ROPE(T)                                                                      \
    rope_rows(x.const_data_ptr<T>(), c.const_data_ptr<T>(), sn.const_data_ptr<T>(),       \
              out.mutable_data_ptr<T>(), b, s, heads, rotated, d);                        \
    break;
    case at::kFloat: NXDI_ROPE(float)
    case at::kBFloat16: NXDI_ROPE(c10::BFloat16)
    case at::kHalf: NXDI_ROPE(c10::Half)
#undef NXDI_ROPE
    default: TORCH_CHECK(false, "rope_qk: dtype ", x.scalar_type(), " is not supported");
  }
  return out;
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
  switch (x.scalar_type()) {
    case at::kFloat:
      silu_mul_rows(x.const_data_ptr<float>(), out.mutable_data_ptr<float>(), rows, n);
      break;
    case at::kBFloat16:
      silu_mul_rows(x.const_data_ptr<c10::BFloat16>(), out.mutable_data_ptr<c10::BFloat16>(),
                    rows, n);
      break;
    case at::kHalf:
      silu_mul_rows(x.const_data_ptr<c10::Half>(), out.mutable_data_ptr<c10::Half>(), rows, n);
      break;
    default: TORCH_CHECK(false, "silu_mul: dtype ", x.scalar_type(), " is not supported");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nxdi, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_qk(Tensor x, Tensor cos, Tensor sin, int rotated) -> Tensor");
  m.def("silu_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(nxdi, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_qk", &rope_qk);
  m.impl("silu_mul", &silu_mul);
}
