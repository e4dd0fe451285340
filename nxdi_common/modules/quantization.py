"""Weight quantization (NxD Inference feature guide, "Model Weight Quantization"): the linear layers'
weights stored as int8 with a symmetric scale, per tensor or per output channel, and multiplied by
torch's weight-only int8 kernel (`aten._weight_int8pack_mm`), which reads half the bytes of bf16.

A quantized checkpoint keeps the Hugging Face names: for every quantized projection `X.weight` is
int8 [out, in] and `X.scale` holds the float32 scale ([1] per tensor, [out] per channel), so
weight ~= int8 * scale. `modules_to_not_convert` names modules kept in full precision, by dotted
prefix ("lm_head", "layers.0.self_attn", "layers.1.mlp.down_proj")."""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from nxdi_common.modules.linear import (ONEDNN, PANELS, Linear, normed_product, onednn_ops,
                                        pack_panels, pack_weight)

INT8_MAX = 127
# Projections a Llama-family decoder quantizes; q/k/v and gate/up are fused in the model, so
# they are quantized (or kept) together.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_GROUPS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
           "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
SUPPORTED_DTYPES = ("int8",)


def check_supported(neuron_config) -> None:
    """ValueError unless the config's quantization can run on the CPU backends."""
    if neuron_config.quantization_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"quantization_dtype {neuron_config.quantization_dtype!r} is not supported "
                         f"on the CPU backends; use one of {SUPPORTED_DTYPES}")
    if not neuron_config.quantized_checkpoints_path:
        raise ValueError("quantized=True needs quantized_checkpoints_path (write it with "
                         "save_quantized_state_dict(model_path, config))")


def quantize_tensor(weight: torch.Tensor, quantization_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of a [out, in] weight: (int8 weight, float32 scale), the
    scale [1] for per_tensor_symmetric or [out] for per_channel_symmetric."""
    w = weight.detach().float()
    if quantization_type == "per_tensor_symmetric":
        absmax = w.abs().max().reshape(1)
    elif quantization_type == "per_channel_symmetric":
        absmax = w.abs().amax(dim=1)
    else:
        raise ValueError(f"quantization_type {quantization_type!r} is not supported; use "
                         "'per_tensor_symmetric' or 'per_channel_symmetric'")
    scale = (absmax / INT8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    rows = scale if scale.numel() == 1 else scale.unsqueeze(1)
    q = torch.round(w / rows).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.contiguous(), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 weight from an int8 weight and its [1] or [out] scale."""
    return q.float() * (scale.float() if scale.numel() == 1 else scale.float().unsqueeze(1))


def _normalized(name: str) -> str:
    """A module path in the model's terms: no "model." prefix, fused projection names."""
    name = name.removeprefix("model.")
    parts = name.split(".")
    parts = [_GROUPS.get(p, p) for p in parts]
    return ".".join(parts)


def is_excluded(module_path: str, modules_to_not_convert) -> bool:
    """True when module_path is, or lies inside, one of modules_to_not_convert."""
    path = _normalized(module_path)
    for entry in modules_to_not_convert or ():
        prefix = _normalized(entry)
        if path == prefix or path.startswith(prefix + "."):
            return True
    return False


_PROJECTION_KEY = re.compile(r"^(?:model\.)?layers\.\d+\.(?:self_attn|mlp)\.(%s)\.weight$"
                             % "|".join(PROJECTIONS))


def quantize_state_dict(state_dict: dict, neuron_config, tie_word_embeddings: bool) -> dict:
    """A quantized copy of an HF-named state dict: every decoder projection and the LM head not in
    modules_to_not_convert becomes int8 + scale; everything else is kept as it is. A tied LM head
    gets its own quantized copy of the embedding matrix (the embedding stays in full precision)."""
    out = dict(state_dict)
    if tie_word_embeddings and "lm_head.weight" not in out:
        embed = next((k for k in ("model.embed_tokens.weight", "embed_tokens.weight") if k in out),
                     None)
        if embed is not None:
            out["lm_head.weight"] = out[embed]
    for key in list(out):
        is_head = key == "lm_head.weight"
        if not (is_head or _PROJECTION_KEY.match(key)):
            continue
        if is_excluded(key.removesuffix(".weight"), neuron_config.modules_to_not_convert):
            if is_head and tie_word_embeddings:
                del out[key]  # kept tied: the model ties it to the embedding again
            continue
        q, scale = quantize_tensor(out[key], neuron_config.quantization_type)
        out[key], out[key.removesuffix("weight") + "scale"] = q, scale
    return out


def expand_scales(state_dict: dict) -> dict:
    """Per-tensor scales ([1]) repeated to one per output row, so that fusing projections (and
    replicating KV heads) can treat every scale as a per-row vector. Returns a new dict."""
    out = dict(state_dict)
    for key, scale in state_dict.items():
        if key.endswith(".scale") and scale.numel() == 1:
            rows = state_dict[key.removesuffix("scale") + "weight"].shape[0]
            out[key] = scale.reshape(1).expand(rows).contiguous()
    return out


KERNEL_ALIGNMENT = 64


def aligned_int8(state_dict: dict) -> dict:
    """int8 tensors copied to fresh (64-byte aligned) memory where they are not aligned. Tensors
    read from a safetensors file sit at arbitrary byte offsets, and torch's int8 kernel uses
    aligned vector loads: a 512-row product on a misaligned weight crashed the process (SIGSEGV,
    torch 2.13)."""
    return {k: v.clone() if v.dtype == torch.int8 and v.data_ptr() % KERNEL_ALIGNMENT else v
            for k, v in state_dict.items()}


# Rows up to which the int8 kernel is used. Its cost grows with the rows (one decode step's
# products, one thread, bench/bench_projections.py: 19 ms at 1 row, 25 at 4, 43 at 8, 72 at 16),
# while a bf16 product with oneDNN-packed weights costs 25-26 ms at any of those rows. So with a
# packed copy (pack(), the CPU default) rows above 4 go through it. Without one, the weight is
# dequantized on every call above 32 rows: two extra passes over the weights, which lose for
# decode (139 against 86 ms for a 16-row step, two threads) but win for prefill (a 512-token
# prompt was 5x slower through the kernel).
INT8_KERNEL_MAX_ROWS_PACKED = 4
INT8_KERNEL_MAX_ROWS = 32


class QuantizedLinear(nn.Module):
    """A linear layer with an int8 weight [out, in] and one scale per output row (in the compute
    dtype, as the kernel wants it). `pack(ONEDNN)` adds `packed`, the dequantized weight in
    oneDNN's layout, for products of many rows (it costs the memory of a bf16 copy);
    `pack(PANELS)` reorders the int8 weight itself into panels (modules/linear.py), which our
    kernel multiplies at any row count, reading int8 (CPUs without bfloat16 dot products)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.int8,
                                               device=device), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(out_features, dtype=dtype, device=device),
                                  requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None
        self.register_parameter("packed", None)

    def pack(self, layout: str = ONEDNN, panels=pack_panels) -> list[nn.Parameter]:
        """Pack for `layout` (ONEDNN or PANELS; anything else leaves the module as it is) once;
        returns the parameters it added. `panels(weight)` makes the int8 panels
        (pack_linear_weights passes its huge-page arena's)."""
        if self.packed is not None or self._panels() or layout not in (ONEDNN, PANELS):
            return []
        if layout == PANELS:
            self.weight = nn.Parameter(panels(self.weight), requires_grad=False)
            return [self.weight]
        dense = dequantize(self.weight, self.scale).to(self.scale.dtype)
        self.packed = nn.Parameter(pack_weight(dense), requires_grad=False)
        return [self.packed]

    def _panels(self) -> bool:
        return self.weight.dim() == 3  # pack_panels' layout

    def _use_packed(self, x: torch.Tensor) -> bool:
        """Rows past the int8 kernel's range go to the packed copy (static per traced bucket)."""
        return self.packed is not None and x.numel() // self.in_features > INT8_KERNEL_MAX_ROWS_PACKED

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._panels():
            return torch.ops.nxdi.panel_linear(x, self.weight, self.out_features, self.bias, None,
                                               self.scale)
        if self._use_packed(x):
            return onednn_ops()[0](x, self.packed, self.bias)
        if self.packed is None and x.numel() // self.in_features > INT8_KERNEL_MAX_ROWS:
            weight = self.weight.to(x.dtype) * self.scale.unsqueeze(1)
            return F.linear(x, weight, self.bias)
        y = torch.ops.aten._weight_int8pack_mm(x.flatten(0, -2), self.weight, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.view(list(x.shape[:-1]) + [self.out_features]) if x.dim() != 2 else y

    def normed(self, x: torch.Tensor, norm) -> torch.Tensor:
        """self(norm(x)), the norm inside the product on panels (linear.normed_product)."""
        return normed_product(self, x, norm, self.scale)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None and self._panels():
            return torch.ops.nxdi.panel_linear(x, self.weight, self.out_features, None, residual,
                                               self.scale)
        if self.bias is None and self._use_packed(x):
            return onednn_ops()[1](x, residual, self.packed)
        return residual + self(x)


def quantize_linear_modules(model: nn.Module, neuron_config) -> list[str]:
    """Replace every Linear of `model` (built on the meta device) outside modules_to_not_convert
    with a QuantizedLinear; returns the replaced module paths."""
    replaced = []
    for path, module in list(model.named_modules()):
        if not isinstance(module, Linear) or is_excluded(path, neuron_config.modules_to_not_convert):
            continue
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, leaf, QuantizedLinear(module.in_features, module.out_features,
                                              module.bias is not None, module.weight.dtype,
                                              device=module.weight.device))
        replaced.append(path)
    return replaced
