// One decoder layer of token generation as one op, for the CPU backends.
//
// Why: at batch 1 a decode step is ~121 weight-bound products (~9 ms for the bundled model's
// 269 MB) plus the ops between them. Called one by one from a traced graph, a layer's nine ops
// (norm, QKV product, RoPE + cache store, paged attention, output product + residual, norm,
// gate/up product, silu * up, down product + residual) and the views between them cost ~50 us
// of interpreter, dispatcher and bookkeeping per layer, ~1.5 ms a step: the gap between the
// products' time and the step's. Here the same ops are plain C++ calls (ops.h), so the layer
// computes exactly what the op-by-op graph computes, with the same kernels and roundings.
//
// Registered as torch.ops.nxdi.decode_layer in the same library as the ops it calls.
#include "ops.h"

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

namespace {

// x [B, S, hidden] -> x after one pre-norm Llama decoder layer of token generation, with every
// linear weight in panels (pack_panels) and no biases: attention reads the block KV cache
// [layers, 2, blocks, block_size, kv_heads, D] in place, after this call's keys and values are
// stored at slots [B, S]; query s of row b attends to positions 0..position_ids[b, s] through
// block_table [B, W]. intermediate is the MLP's width (gate_up has 2 * intermediate outputs).
at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& qkv,
                        const at::Tensor& o, const at::Tensor& post_norm,
                        const at::Tensor& gate_up, const at::Tensor& down, double eps,
                        const at::Tensor& cos, const at::Tensor& sin, int64_t q_heads,
                        int64_t intermediate, at::Tensor& cache, int64_t layer,
                        const at::Tensor& slots, const at::Tensor& block_table,
                        const at::Tensor& position_ids, double scale) {
  TORCH_CHECK(x.dim() == 3, "decode_layer: x must be [B, S, hidden], got ", x.sizes());
  TORCH_CHECK(cache.dim() == 6 && cache.size(1) == 2,
              "decode_layer: cache must be [layers, 2, blocks, block_size, kv_heads, D], got ",
              cache.sizes());
  TORCH_CHECK(q_heads >= 1 && intermediate >= 1, "decode_layer: q_heads (", q_heads,
              ") and intermediate (", intermediate, ") must be positive");
  const int64_t batch = x.size(0), queries = x.size(1), hidden = x.size(2);
  const int64_t kv_heads = cache.size(4), dim = cache.size(5);
  // what attention would refuse after the store, refused before it: a failed call writes nothing
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == batch,
              "decode_layer: block_table must be [B, W] with B = ", batch, ", got ",
              block_table.sizes());
  TORCH_CHECK(position_ids.dim() == 2 && position_ids.size(0) == batch &&
              position_ids.size(1) == queries, "decode_layer: position_ids must be [", batch,
              ", ", queries, "], got ", position_ids.sizes());
  const std::optional<at::Tensor> none;

  const at::Tensor heads =
      nxdi_ops::panel_linear(nxdi_ops::rms_norm(x, input_norm, eps), qkv,
                             (q_heads + 2 * kv_heads) * dim, none, none, none)
          .view({batch, queries, q_heads + 2 * kv_heads, dim});
  // checks layer and the cache's shape and dtype before anything reads it
  const at::Tensor q = nxdi_ops::rope_qk_store(heads, cos, sin, q_heads, cache, layer, slots);
  const at::Tensor kv = cache.select(0, layer);
  const at::Tensor attn = nxdi_ops::paged_decode_attention(
      q.transpose(1, 2), kv.select(0, 0), kv.select(0, 1), block_table, position_ids, scale);
  const at::Tensor mid = nxdi_ops::panel_linear(
      attn.transpose(1, 2).reshape({batch, queries, q_heads * dim}), o, hidden, none, x, none);

  const at::Tensor act = nxdi_ops::silu_mul(nxdi_ops::panel_linear(
      nxdi_ops::rms_norm(mid, post_norm, eps), gate_up, 2 * intermediate, none, none, none));
  return nxdi_ops::panel_linear(act, down, hidden, none, mid, none);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nxdi, m) {
  m.def("decode_layer(Tensor x, Tensor input_norm, Tensor qkv, Tensor o, Tensor post_norm, "
        "Tensor gate_up, Tensor down, float eps, Tensor cos, Tensor sin, int q_heads, "
        "int intermediate, Tensor(a!) cache, int layer, Tensor slots, Tensor block_table, "
        "Tensor position_ids, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(nxdi, CPU, m) { m.impl("decode_layer", &decode_layer); }
