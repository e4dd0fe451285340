// Linear layers for CPUs without bfloat16 dot products (AVX2, or AVX-512 without avx512_bf16):
// there torch's bfloat16 GEMM converts element by element and runs 5-8x slower than its float32
// one (a 512-row prefill projection 55 ms against 7 ms on an AMD EPYC with AVX2), and oneDNN
// cannot pack bfloat16 weights at all. Here the weights stay in their 16-bit dtype, reordered once
// at load into panels of 16 output columns, k-major:
//
//     panels [P, K, 16]: panels[p, k, j] = W[16p + j, k]  (zero past the last output)
//
// so one 32-byte load brings the k-th input's weights for 16 outputs, widened to float32 with a
// shift (bf16) or F16C (fp16), and a 6-row x 16-column tile of float32 sums is kept in registers:
// each weight loaded is used for up to 6 input rows, each input value for 16 outputs. Sums are
// float32; the result is rounded once to the dtype after bias and residual are added, as torch's
// addmm does.
//
// int8 weights (modules/quantization.py) use the same panels, 16 bytes a row, and a float32 scale
// per output that multiplies the sums before bias and residual: w = int8 * scale, so the product
// reads half the bytes of bfloat16, which is what a one-row (decode) product is bound by.
//
// Registered as torch.ops.nxdi.panel_linear in the same library as our other kernels.
#include "panel_tile.h"
#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using namespace nxdi_simd;
using nxdi_tile::kMR;
using nxdi_tile::kNR;
using nxdi_tile::tile_rows;

constexpr int64_t kPanelsPerTask = 4;  // a task: 64 output columns
constexpr int64_t kRowBlockBytes = 256 * 1024;  // float32 input rows a task keeps near the core
constexpr int64_t kWidenRows = kMR + 1;  // from this many rows a panel is widened once (run)

struct Problem {
  int64_t M, K, N, P;  // rows, inputs, outputs, panels
  const float* scale;  // [N] per-output multipliers of the sums, or null
};

// out[m, n] = dtype(c * scale[n] + bias[n] + residual[m, n]) for the tile's rows and its panel's
// valid columns; scale, bias and residual may be null.
template <typename T>
void store_tile(const float* c, int rows, int64_t m0, int64_t n0, const Problem& pb,
                const T* bias, const T* residual, T* out) {
  const int64_t cols = std::min(kNR, pb.N - n0);
  for (int r = 0; r < rows; ++r) {
    const int64_t row = (m0 + r) * pb.N + n0;
    for (int64_t j = 0; j < cols; ++j) {
      float v = c[r * kNR + j];
      if (pb.scale != nullptr) v *= pb.scale[n0 + j];
      if (bias != nullptr) v += to_float(bias[n0 + j]);
      if (residual != nullptr) v += to_float(residual[row + j]);
      out[row + j] = from_float<T>(v);
    }
  }
}

// One panel times rows [m0, m1) of x into out. With many rows the panel is widened to float32 once
// (wide, 16 x K) and the tiles read that: the widening then costs once per panel instead of once
// per 6 rows.
template <typename T, typename W>
void panel_rows(const Problem& pb, const float* x, const W* panel, int64_t p, int64_t m0,
                int64_t m1, const T* bias, const T* residual, T* out, std::vector<float>& wide) {
  float c[kMR * kNR];
  const bool widen = !std::is_same_v<W, float> && m1 - m0 >= kWidenRows;
  if (widen) {
    wide.resize(pb.K * kNR);
    for (int64_t i = 0; i < pb.K * kNR; ++i) wide[i] = to_float(panel[i]);
  }
  for (int64_t m = m0; m < m1; m += kMR) {
    const int rows = static_cast<int>(std::min<int64_t>(kMR, m1 - m));
    if (widen)
      tile_rows(rows, x + m * pb.K, pb.K, wide.data(), pb.K, c);
    else
      tile_rows(rows, x + m * pb.K, pb.K, panel, pb.K, c);
    store_tile(c, rows, m, p * kNR, pb, bias, residual, out);
  }
}

// Tasks are (group of panels, block of rows), panel-major: a thread's tasks walk its panels once
// and the input rows (float32, kept within kRowBlockBytes a block) again for each group.
template <typename T, typename W>
void run(const Problem& pb, const float* x, const W* panels, const T* bias, const T* residual,
         T* out) {
  const int64_t block_rows =
      std::max<int64_t>(kMR, kRowBlockBytes / (4 * std::max<int64_t>(pb.K, 1)) / kMR * kMR);
  const int64_t row_blocks = (pb.M + block_rows - 1) / block_rows;
  const int64_t groups = (pb.P + kPanelsPerTask - 1) / kPanelsPerTask;
  at::parallel_for(0, groups * row_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wide;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / row_blocks, rb = task % row_blocks;
      const int64_t m_end = std::min(pb.M, (rb + 1) * block_rows);
      for (int64_t p = g * kPanelsPerTask; p < std::min(pb.P, (g + 1) * kPanelsPerTask); ++p)
        panel_rows(pb, x, panels + p * pb.K * kNR, p, rb * block_rows, m_end, bias, residual,
                   out, wide);
    }
  });
}

template <typename F>
void dispatch_16_or_32(at::ScalarType type, const char* what, const char* allowed, F&& f) {
  switch (type) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: TORCH_CHECK(false, "panel_linear: ", what, " dtype ", type,
                         " is not supported (", allowed, ")");
  }
}

// x [..., K] -> [..., out_features] in x's dtype: x @ (W * scale)^T (+ bias) (+ residual), W
// given as panels [P, K, 16] (pack_panels) with P = ceil(out_features / 16); scale ([1] or
// [out_features], any floating dtype) is required for int8 panels, optional for the others.
at::Tensor panel_linear(const at::Tensor& x_in, const at::Tensor& panels_in, int64_t out_features,
                        const std::optional<at::Tensor>& bias_in,
                        const std::optional<at::Tensor>& residual_in,
                        const std::optional<at::Tensor>& scale_in) {
  TORCH_CHECK(panels_in.dim() == 3 && panels_in.size(2) == kNR,
              "panel_linear: panels must be [P, K, 16], got ", panels_in.sizes());
  const int64_t K = panels_in.size(1), P = panels_in.size(0);
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == K, "panel_linear: x must be [..., ", K,
              "], got ", x_in.sizes());
  TORCH_CHECK(out_features > 0 && (out_features + kNR - 1) / kNR == P, "panel_linear: ", P,
              " panels cannot hold ", out_features, " outputs");
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = out_features;
  at::Tensor out = at::empty(out_shape, x_in.options());
  at::Tensor scale;
  if (scale_in.has_value()) {
    const int64_t n = scale_in->dim() == 1 ? scale_in->size(0) : -1;
    TORCH_CHECK((n == 1 || n == out_features) && scale_in->is_floating_point(),
                "panel_linear: scale must be a floating [1] or [", out_features, "], got ",
                scale_in->scalar_type(), " ", scale_in->sizes());
    scale = scale_in->to(at::kFloat).expand({out_features}).contiguous();
  }
  TORCH_CHECK(panels_in.scalar_type() != at::kChar || scale.defined(),
              "panel_linear: int8 panels need a scale");
  const Problem pb{K ? x_in.numel() / K : 0, K, out_features, P,
                   scale.defined() ? scale.const_data_ptr<float>() : nullptr};
  const at::Tensor xf = x_in.to(at::kFloat).contiguous(), panels = panels_in.contiguous();
  at::Tensor bias, residual;
  if (bias_in.has_value()) {
    bias = bias_in->contiguous();
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == out_features &&
                bias.scalar_type() == x_in.scalar_type(),
                "panel_linear: bias must be [", out_features, "] in x's dtype");
  }
  if (residual_in.has_value()) {
    residual = residual_in->contiguous();
    TORCH_CHECK(residual.sizes() == out.sizes() && residual.scalar_type() == x_in.scalar_type(),
                "panel_linear: residual must be ", out.sizes(), " in x's dtype");
  }
  if (pb.M == 0) return out;
  dispatch_16_or_32(x_in.scalar_type(), "x", "float32, bfloat16, float16", [&](auto t) {
    using T = decltype(t);
    auto multiply = [&](auto w) {
      using W = decltype(w);
      run<T, W>(pb, xf.const_data_ptr<float>(), panels.const_data_ptr<W>(),
                bias.defined() ? bias.const_data_ptr<T>() : nullptr,
                residual.defined() ? residual.const_data_ptr<T>() : nullptr,
                out.mutable_data_ptr<T>());
    };
    if (panels.scalar_type() == at::kChar)
      multiply(int8_t{});
    else
      dispatch_16_or_32(panels.scalar_type(), "weight", "float32, bfloat16, float16, int8",
                        multiply);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nxdi, m) {
  m.def("panel_linear(Tensor x, Tensor panels, int out_features, Tensor? bias=None, "
        "Tensor? residual=None, Tensor? scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(nxdi, CPU, m) { m.impl("panel_linear", &panel_linear); }
