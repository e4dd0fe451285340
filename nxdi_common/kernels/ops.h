// The ops other kernels call directly (decode_layer.cpp), without the dispatcher: each is
// defined in its own source and registered there as torch.ops.nxdi.<name>.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace nxdi_ops {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rope_qk_store(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                         int64_t q_heads, at::Tensor& cache, int64_t layer,
                         const at::Tensor& slots);
at::Tensor silu_mul(const at::Tensor& x);
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                        const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& residual,
                        const std::optional<at::Tensor>& scale);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_table,
                                  const at::Tensor& position_ids, double scale);

}  // namespace nxdi_ops
