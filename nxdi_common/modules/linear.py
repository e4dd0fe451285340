"""Linear layers for the CPU backends.

Two fast paths, both static per traced bucket:

* **oneDNN-packed weights.** `pack_linear_weights` reorders every projection's weight once, at
  load, into oneDNN's blocked layout (`mkldnn._reorder_linear_weight`); `Linear` then multiplies
  through `mkldnn._linear_pointwise`. A plain bfloat16 GEMM reorders the weight on every call:
  one decode step's 121 products on one thread took 37-40 ms at 4-16 rows against 25 ms packed
  (bench/bench_projections.py), and prefill gains too. The packed tensors are graph inputs like
  any weight (backends/weights.py), so a traced graph holds the packed call.
* **Panels** for x86 CPUs. Without bfloat16 dot products (AVX2; AVX-512 without
  avx512_bf16) torch's bfloat16 GEMM is 5-8x slower than its float32 one and oneDNN cannot pack
  bfloat16; with AVX512-BF16 but no AMX (AMD Zen 4) oneDNN packs it, but our kernel reads a
  one-row product's weights 1.5-1.8x faster and keeps up from 16 rows on; with AMX (Intel
  Sapphire Rapids) our kernel runs the pairs on AMX tiles, faster than oneDNN's packed weights
  from 1 to 512 rows. `pack_panels`
  reorders each weight once into [ceil(out / 16), in, 16] panels in its own dtype, multiplied by
  our kernel (`torch.ops.nxdi.panel_linear`, kernels/panel_linear.cpp): in float32, or on the
  CPU's bfloat16 dot products for bfloat16 inputs where it has them. `pack_linear_weights`
  packs all panels into one runtime.HugePageArena: on 2 MiB pages a batch-1 decode step's
  products read their weights ~10% faster (BENCHMARKS.md, session 28).
* **Matrix-vector products** for one row of reduced-precision input with plain weights (the
  layout when neither applies): torch.mv reads the weights about 30% faster than F.linear.

Shapes are rebuilt from Python ints the module knows (never from `x.shape`): a traced graph then
holds constants instead of size/NumToTensor/Int bookkeeping nodes, which at batch 1 cost about as
much as the arithmetic around them."""
from __future__ import annotations

import functools
import warnings
from typing import List, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from nxdi_common.runtime import HugePageArena

_MV_DTYPES = (torch.bfloat16, torch.float16)
# The layouts a CPU model's linear weights can have (NeuronConfig.cpu_weight_layout resolves to one).
PLAIN, ONEDNN, PANELS = "plain", "onednn", "panels"
PANEL_WIDTH = 16  # output columns per panel (kernels/panel_linear.cpp)
# Rows the packed layout is chosen for; oneDNN's choice barely depends on it (1 to 128 rows all ran
# within 5% of each other for decode and prefill shapes).
_PACK_ROWS_HINT = 16


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    scalars: List[Optional[Union[int, float, complex]]] = []  # TorchScript's Scalar?[]
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", scalars, "")


def _onednn_linear_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, residual, weight, None, "add")


@functools.cache
def onednn_ops():
    """The two packed products as TorchScript functions (scripted on first use: the tracer cannot
    record the op's Scalar?[] argument itself, but it can call a scripted function)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript is what the CPU backend runs
        return torch.jit.script(_onednn_linear), torch.jit.script(_onednn_linear_add)


@functools.cache
def onednn_unavailable_reason(dtype: torch.dtype) -> str | None:
    """None when weights of `dtype` can be packed and multiplied here, else why not."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (torch.backends.mkldnn)"
    try:
        w = torch.ones(8, 8, dtype=dtype)
        linear, _ = onednn_ops()
        y = linear(torch.ones(2, 8, dtype=dtype), pack_weight(w), None)
    except (RuntimeError, AttributeError) as exc:
        return f"oneDNN cannot multiply packed {dtype} weights here: {exc}"
    if not torch.equal(y.float(), torch.full((2, 8), 8.0)):
        return f"oneDNN's packed {dtype} product gave wrong results here"
    return None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight reordered into oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_ROWS_HINT)


def panels_shape(out_features: int, in_features: int, pairs: bool) -> tuple[int, int, int]:
    """The shape pack_panels gives an [out_features, in_features] weight."""
    panels = -(-out_features // PANEL_WIDTH)
    if pairs:
        return panels, -(-in_features // 2), 2 * PANEL_WIDTH
    return panels, in_features, PANEL_WIDTH


def pack_panels(weight: torch.Tensor, pairs: Optional[bool] = None,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A [out, in] weight as [ceil(out / 16), in, 16] panels: panels[p, k, j] = weight[16p + j, k],
    zero past the last output. With `pairs` (bfloat16 only; by default where our kernel multiplies
    bfloat16 on the CPU's dot products, kernels.panel_pairs_native) each panel's rows come two
    by two, as the dot products take them: [ceil(out / 16), ceil(in / 2), 32] with
    pairs[p, i, 2j + h] = weight[16p + j, 2i + h], zero past the last input too. The kernel then
    loads a pair as it is instead of interleaving it in every tile (the 121 products of a decode
    step 3-10% faster at 8-16 rows, ~15% at 64 and more; BENCHMARKS.md, session 19). Copied
    straight into the result: no padded or transposed temporary, which for the LM head would be
    another 57 MB that the allocator (runtime.py keeps large blocks) need not give back. `out`:
    where to write them (shape panels_shape(...), the weight's dtype), e.g. a HugePageArena's."""
    w = weight.detach()
    out_features, in_features = w.shape
    full, rest = divmod(out_features, PANEL_WIDTH)
    if pairs is None:
        pairs = w.dtype == torch.bfloat16 and panel_pairs_native()
    if pairs and w.dtype != torch.bfloat16:
        raise ValueError(f"pack_panels: only bfloat16 weights come in pairs, got {w.dtype}")
    shape = panels_shape(out_features, in_features, pairs)
    if out is not None and (tuple(out.shape) != shape or out.dtype != w.dtype):
        raise ValueError(f"pack_panels: out must be {w.dtype} of shape {shape}, got "
                         f"{out.dtype} of shape {tuple(out.shape)}")
    panels = w.new_empty(shape) if out is None else out
    if not pairs:
        panels[:full].transpose(1, 2).copy_(
            w[:full * PANEL_WIDTH].view(full, PANEL_WIDTH, in_features))
        if rest:
            panels[full].zero_()
            panels[full, :, :rest].copy_(w[full * PANEL_WIDTH:].t())
        return panels
    half, odd = divmod(in_features, 2)
    if rest or odd:  # zeros past the last output / input
        panels.zero_()
    by_column = panels.view(-1, half + odd, PANEL_WIDTH, 2).transpose(1, 2)  # [P, 16, pairs, 2]
    split = full * PANEL_WIDTH
    for dst, src in ((by_column[:full], w[:split]), (by_column[full:, :rest], w[split:])):
        if src.numel():  # the whole panels, then the partial one
            src = src.view(dst.shape[0], dst.shape[1], in_features)
            dst[..., :half, :].copy_(src[..., :2 * half].unflatten(-1, (half, 2)))
            if odd:
                dst[..., half, 0].copy_(src[..., -1])
    return panels


def panel_pairs_native() -> bool:
    """True where our kernel library is loaded and multiplies bfloat16 panels on the CPU's
    dot products (AVX512-BF16), which is the layout pack_panels' pairs are made for."""
    from nxdi_common import kernels
    return kernels.kernels_unavailable_reason() is None and torch.ops.nxdi.panel_pairs_native()


def normed_product(layer, x: torch.Tensor, norm, scale=None) -> torch.Tensor:
    """layer(norm(x)) for a Linear or QuantizedLinear `layer` (its int8 `scale`) and an RMSNorm
    `norm`: on panels, with the norm's fused op, one panel_linear that normalizes x's rows first
    (nxdi::rms_norm's code), one graph node where there were two."""
    if layer._panels() and norm.fused is not None:
        return torch.ops.nxdi.panel_linear(x, layer.weight, layer.out_features, layer.bias, None,
                                           scale, norm.weight, norm.eps)
    return layer(norm(x))


class Linear(nn.Linear):
    """nn.Linear with the packed and matrix-vector fast paths (module doc), and `add_to`, which
    folds a residual addition into the same kernel."""

    def _single_row(self, x: torch.Tensor) -> bool:
        return x.dtype in _MV_DTYPES and x.numel() == self.in_features

    def _unflatten(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return y.view([1] * (x.dim() - 1) + [self.out_features])

    def _panels(self) -> bool:
        return self.weight.dim() == 3  # pack_panels' layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.is_mkldnn:
            return onednn_ops()[0](x, self.weight, self.bias)
        if self._panels():
            return torch.ops.nxdi.panel_linear(x, self.weight, self.out_features, self.bias)
        if not self._single_row(x):
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            return self._unflatten(torch.mv(self.weight, x.view(-1)), x)
        return self._unflatten(torch.addmv(self.bias, self.weight, x.view(-1)), x)

    def normed(self, x: torch.Tensor, norm) -> torch.Tensor:
        """self(norm(x)) for an RMSNorm `norm` (normed_product)."""
        return normed_product(self, x, norm)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + self(x), as one kernel when there is no bias."""
        if self.bias is not None:
            return residual + self(x)
        if self.weight.is_mkldnn:
            return onednn_ops()[1](x, residual, self.weight)
        if self._panels():
            return torch.ops.nxdi.panel_linear(x, self.weight, self.out_features, None, residual)
        if self._single_row(x):
            return self._unflatten(torch.addmv(residual.view(-1), self.weight, x.view(-1)), x)
        out = torch.addmm(residual.flatten(0, -2), x.flatten(0, -2), self.weight.t())
        return out.view_as(residual)


def _arena_packer(weights: list[torch.Tensor]):
    """pack_panels for these weights (each in the pairs layout where that is native), into one
    runtime.HugePageArena sized for all of them: packed straight into it, no second copy."""
    pairs_native = panel_pairs_native()

    def shape_of(w: torch.Tensor) -> tuple[tuple[int, int, int], bool]:
        paired = pairs_native and w.dtype == torch.bfloat16
        return panels_shape(*w.shape, paired), paired

    arena = HugePageArena(HugePageArena.size_of([(shape_of(w)[0], w.dtype) for w in weights]))

    def pack(weight: torch.Tensor) -> torch.Tensor:
        shape, paired = shape_of(weight)
        return pack_panels(weight, paired, arena.take(shape, weight.dtype))
    return pack


def pack_linear_weights(model: nn.Module, layout: str = ONEDNN) -> int:
    """Give every Linear of `model` a copy of its weight in `layout` (ONEDNN: oneDNN-packed;
    PANELS: pack_panels, all into one HugePageArena) in place of the plain one (modules that own
    a `pack(layout, panels)` method, such as QuantizedLinear, pack themselves, with `panels` as
    their pack_panels, and return the new parameters); returns how many modules were packed. A
    weight shared with a module that is not a Linear (the embedding of a tied LM head) stays
    plain there: the Linear gets its own packed copy.

    The plain parameters left (embedding, norms, biases, int8 weights) are then copied out of the
    checkpoint: they are views of one memory-mapped file, whose pages packing has read, so a
    single one of them would keep the whole file resident next to the packed copies."""
    def unpacked(module) -> bool:
        return isinstance(module, Linear) and not module.weight.is_mkldnn and not module._panels()

    def packs_itself(module) -> bool:
        return hasattr(module, "pack") and callable(module.pack)

    panels = pack_panels
    if layout != ONEDNN:  # every panel, bf16 or int8, in one arena on huge pages
        panels = _arena_packer([m.weight for m in model.modules()
                                if unpacked(m) or (packs_itself(m) and m.weight.dim() == 2)])
    pack = pack_weight if layout == ONEDNN else panels
    packed, done = 0, set()  # ids of the packed copies
    for module in model.modules():
        if unpacked(module):
            module.weight = nn.Parameter(pack(module.weight), requires_grad=False)
            done.add(id(module.weight))
            packed += 1
        elif packs_itself(module):
            new = module.pack(layout, panels=panels)
            done.update(id(p) for p in new)
            packed += bool(new)
    copies: dict[int, nn.Parameter] = {}  # one copy per distinct parameter: aliases stay aliases
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and not param.is_mkldnn and id(param) not in done:
                if id(param) not in copies:
                    copies[id(param)] = nn.Parameter(param.detach().clone(), requires_grad=False)
                module._parameters[name] = copies[id(param)]
    return packed
