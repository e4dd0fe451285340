"""Rotary position embeddings (RoPE): inverse frequencies for the rope types Llama-family checkpoints
use ("default", "linear", "llama3"), and the rotation applied to queries and keys."""
from __future__ import annotations

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config) -> dict:
    """The rope settings of an HF-style config as one dict (transformers 5 `rope_parameters`, or the
    older `rope_theta` + `rope_scaling` pair)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None) or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def rope_inv_freq(config, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32 for the config's rope type."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (float(params["rope_theta"]) ** exponents)
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, params)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, short ones kept, and a
    smooth interpolation between the two bands."""
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos and signed sin [B, 1, S, head_dim] (broadcast over heads) for position_ids [B, S],
    computed in float32. The sin's first half is negated, so that `apply_rope` rotates with a
    roll instead of a negate-and-concatenate (the same arithmetic, fewer graph ops)."""
    freqs = position_ids.float().unsqueeze(-1) * inv_freq  # [B, S, D/2]
    cos, sin = freqs.cos(), freqs.sin()
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)  # [B, S, D]
    return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
               half: int) -> torch.Tensor:
    """Rotate x [B, H, S, D] by the output of rope_cos_sin; half = D // 2. Equal to the reference
    x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x2, x1) = roll(x, half) * sign."""
    return x * cos + x.roll(half, dims=-1) * signed_sin
