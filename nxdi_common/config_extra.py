"""Configs for mixture-of-experts models, multi-LoRA serving and fused speculation.

Every class here follows ``config_base.ConfigBase``: keyword construction with documented defaults,
ValueErrors that say what to change, and a lossless ``to_dict``/``from_dict`` (which is how they
travel inside ``neuron_config.json``). Classes and functions held in a config (a worker class, a
weight-init function) are saved as ``"module:qualname"`` strings and imported back on load.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import importlib
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from nxdi_common.config import InferenceConfig, NeuronConfig
from nxdi_common.config_base import (
    ConfigBase,
    check_int,
    coerce_nested,
    object_path,
    to_torch_dtype,
)

_ROUTER_ACTIVATIONS = ("softmax", "sigmoid")
_LORA_JSON_KEYS = ("lora-ckpt-dir", "lora-ckpt-paths", "lora-ckpt-paths-cpu")


class BlockShardStrategy(enum.Enum):
    """How the block-parallel blockwise-matmul kernel spreads blocks over logical cores."""

    HI_LO = "HI_LO"  # upper half and lower half of the blocks on different cores
    PING_PONG = "PING_PONG"  # odd blocks on NC0, even blocks on NC1


class GLUType(str, enum.Enum):
    """The gated-linear-unit variant of an expert MLP."""

    GLU = "glu"
    SWIGLU = "swiglu"


def import_object(path: str) -> Any:
    """Import the object named by ``"module:qualname"`` (the inverse of
    ``config_base.object_path``). Only used on paths this library wrote into a config file, which
    is trusted like code."""
    module_name, _, qualname = path.partition(":")
    if not module_name or not qualname:
        raise ValueError(f"expected 'module:qualname', got {path!r}")
    try:
        obj = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as err:
        raise ImportError(f"cannot import {path!r} named in the config: {err}") from err
    return obj


def _parse_enum(enum_cls: type, name: str, value: Any) -> Any:
    """Accept an enum member, or its value or name as a string (case-insensitive)."""
    if isinstance(value, enum_cls):
        return value
    for member in enum_cls:
        if isinstance(value, str) and value.lower() in (member.name.lower(), member.value.lower()):
            return member
    raise ValueError(f"{name} must be one of {[m.value for m in enum_cls]}, got {value!r}")


def _resolve_callable(name: str, value: Any) -> Any:
    """None, a callable, or a ``"module:qualname"`` string naming one."""
    if isinstance(value, str):
        value = import_object(value)
    if value is not None and not callable(value):
        raise ValueError(f"{name} must be callable or a 'module:qualname' string, got {value!r}")
    return value


def _check_clamps(owner: Any) -> None:
    """Lower clamp limits must not exceed upper ones when both are set."""
    for kind in ("gate", "up"):
        low = getattr(owner, f"{kind}_clamp_lower_limit")
        high = getattr(owner, f"{kind}_clamp_upper_limit")
        if low is not None and high is not None and low > high:
            raise ValueError(f"{kind}_clamp_lower_limit ({low}) must be <= "
                             f"{kind}_clamp_upper_limit ({high})")


def _check_capacity_factor(value: Any) -> None:
    if value is not None and not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"capacity_factor must be > 0 (or None: no token dropping), got {value!r}")


def _pick(cls: type, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The subset of ``kwargs`` naming fields of ``cls`` (for ``from_kwargs``)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in kwargs.items() if k in names}


# ---------------------------------------------------------------------------- MoE building blocks
@dataclass(init=False)
class RouterConfig(ConfigBase):
    """The expert router: activation over router logits and the dtype it computes in."""

    act_fn: str = "softmax"
    dtype: Any = torch.float32

    def _derive(self) -> None:
        self.dtype = to_torch_dtype(self.dtype, "router_config.dtype")

    def validate(self) -> None:
        if isinstance(self.act_fn, str) and self.act_fn in _ROUTER_ACTIVATIONS:
            return
        from transformers.activations import ACT2FN

        if not isinstance(self.act_fn, str) or self.act_fn not in ACT2FN:
            raise ValueError(f"router_config.act_fn must be 'softmax', 'sigmoid' or a transformers "
                             f"ACT2FN name, got {self.act_fn!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "RouterConfig":
        """Build from flat MoENeuronConfig-style keywords ``router_act_fn``/``router_dtype``."""
        picked = {"act_fn": kwargs.get("router_act_fn"), "dtype": kwargs.get("router_dtype")}
        return cls(**{k: v for k, v in picked.items() if v is not None})


@dataclass(init=False)
class RoutedExpertsMLPOpsConfig(ConfigBase):
    """Shapes and options of the routed expert MLPs (the first six attributes are required)."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    hidden_act: str
    glu_mlp: bool
    bias: bool = False
    glu_type: Any = GLUType.GLU
    hidden_act_scaling_factor: float = 1.0
    hidden_act_bias: float = 0.0
    capacity_factor: Optional[float] = None
    use_index_calc_kernel: bool = False
    gate_clamp_upper_limit: Optional[float] = None
    gate_clamp_lower_limit: Optional[float] = None
    up_clamp_upper_limit: Optional[float] = None
    up_clamp_lower_limit: Optional[float] = None
    normalize_top_k_affinities: bool = False
    early_expert_affinity_modulation: bool = False
    input_layer_init_method: Optional[Callable] = None
    output_layer_init_method: Optional[Callable] = None
    enable_spmd_rank: bool = False
    is_prefill: Optional[bool] = None

    def _derive(self) -> None:
        self.glu_type = _parse_enum(GLUType, "glu_type", self.glu_type)
        for name in ("input_layer_init_method", "output_layer_init_method"):
            setattr(self, name, _resolve_callable(name, getattr(self, name)))

    def validate(self) -> None:
        for name in ("num_experts", "hidden_size", "intermediate_size", "top_k"):
            check_int(name, getattr(self, name))
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        if not isinstance(self.hidden_act, str):
            raise ValueError(f"hidden_act must be an activation name, got {self.hidden_act!r}")
        _check_capacity_factor(self.capacity_factor)
        _check_clamps(self)

    @classmethod
    def from_neuron_config(cls, neuron_config: "MoENeuronConfig",
                           **kwargs: Any) -> "RoutedExpertsMLPOpsConfig":
        """Take the flags shared with a MoENeuronConfig; ``kwargs`` give shapes and overrides."""
        shared = ("glu_mlp", "glu_type", "hidden_act_scaling_factor", "hidden_act_bias",
                  "capacity_factor", "use_index_calc_kernel", "gate_clamp_upper_limit",
                  "gate_clamp_lower_limit", "up_clamp_upper_limit", "up_clamp_lower_limit",
                  "normalize_top_k_affinities", "early_expert_affinity_modulation")
        return cls(**{**{name: getattr(neuron_config, name) for name in shared}, **kwargs})


@dataclass(init=False)
class BlockwiseMatmulConfig(ConfigBase):
    """Blockwise matmul of expert MLPs. ``logical_nc_config=None`` means "same as the owning
    MoENeuronConfig", which fills it in."""

    block_size: int = 512
    use_block_parallel: bool = False
    block_sharding_strategy: Any = BlockShardStrategy.HI_LO
    skip_dma_token: bool = False
    skip_dma_weight: bool = False
    logical_nc_config: Optional[int] = None
    blockwise_nki_autograd_cls: Any = None
    use_torch_block_wise: bool = False
    parallelize_token_to_block_mapping: bool = True
    optimized_block_to_token_mapping: bool = True
    always_augment_inputs_for_blockwise_matmul: bool = False
    use_shard_on_intermediate_dynamic_while: bool = False
    use_shard_on_block_dynamic_while: bool = False
    num_static_blocks: Optional[int] = None

    def _derive(self) -> None:
        self.block_sharding_strategy = _parse_enum(
            BlockShardStrategy, "block_sharding_strategy", self.block_sharding_strategy)
        self.blockwise_nki_autograd_cls = _resolve_callable(
            "blockwise_nki_autograd_cls", self.blockwise_nki_autograd_cls)

    def validate(self) -> None:
        check_int("block_size", self.block_size)
        check_int("logical_nc_config", self.logical_nc_config, optional=True)
        check_int("num_static_blocks", self.num_static_blocks, minimum=0, optional=True)
        if self.use_shard_on_intermediate_dynamic_while and self.use_shard_on_block_dynamic_while:
            raise ValueError("enable at most one of use_shard_on_intermediate_dynamic_while and "
                             "use_shard_on_block_dynamic_while")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "BlockwiseMatmulConfig":
        """Build from keywords, ignoring those that are not attributes of this config."""
        return cls(**_pick(cls, kwargs))


@dataclass(init=False)
class MoEFusedTKGConfig(ConfigBase):
    """Kernel fusion switches for MoE token generation (None: let the model decide)."""

    quantized: bool = False
    moe_fused_kernel_enabled: Optional[bool] = None
    router_topk_kernel_enabled: Optional[bool] = None
    expert_mlp_kernel_enabled: Optional[bool] = None
    shared_mlp_kernel_enabled: Optional[bool] = None

    def validate(self) -> None:
        if not isinstance(self.quantized, bool):
            raise ValueError(f"quantized must be True or False, got {self.quantized!r}")
        for f in dataclasses.fields(self)[1:]:
            value = getattr(self, f.name)
            if not (value is None or isinstance(value, bool)):
                raise ValueError(f"{f.name} must be True, False or None, got {value!r}")


@dataclass(init=False)
class HybridShardingConfig(ConfigBase):
    """Separate MoE tensor/expert parallel degrees for context encoding and token generation."""

    moe_cte_tp_degree: int = 1
    moe_cte_ep_degree: int = 1
    moe_tkg_tp_degree: int = 1
    moe_tkg_ep_degree: int = 1

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            check_int(f.name, getattr(self, f.name))


def _check_moe_degrees(label: str, tp: int, ep: int, tp_degree: int) -> None:
    """The MoE parallel group (tp x ep) must divide the model's tp_degree."""
    if tp_degree % (tp * ep):
        raise ValueError(f"{label} tp x ep ({tp} x {ep}) must divide tp_degree ({tp_degree})")


# ---------------------------------------------------------------------------- MoENeuronConfig
@dataclass(init=False)
class MoENeuronConfig(NeuronConfig):
    """NeuronConfig for mixture-of-experts models. Nested configs accept an instance or a dict;
    the router may also be given flat as ``router_act_fn``/``router_dtype``."""

    moe_tp_degree: int = 1
    moe_ep_degree: int = 1
    hybrid_sharding_config: Optional[HybridShardingConfig] = None
    router_config: Optional[RouterConfig] = None
    return_expert_index: bool = False
    return_router_logits: bool = False
    blockwise_matmul_config: Optional[BlockwiseMatmulConfig] = None
    moe_fused_tkg_config: Optional[MoEFusedTKGConfig] = None  # extension: not in the reference
    capacity_factor: Optional[float] = None
    glu_mlp: bool = False
    glu_type: Any = GLUType.GLU
    hidden_act_scaling_factor: float = 1.0
    hidden_act_bias: float = 0.0
    gate_clamp_upper_limit: Optional[float] = None
    gate_clamp_lower_limit: Optional[float] = None
    up_clamp_upper_limit: Optional[float] = None
    up_clamp_lower_limit: Optional[float] = None
    use_index_calc_kernel: bool = False
    early_expert_affinity_modulation: bool = False
    normalize_top_k_affinities: bool = True
    fused_shared_experts: bool = False
    shared_experts_sequence_parallel_enabled: bool = False
    transpose_shared_experts_weights: bool = False

    def __init__(self, **kwargs: Any) -> None:
        flat = {k: kwargs.pop(k) for k in ("router_act_fn", "router_dtype") if k in kwargs}
        if flat and kwargs.get("router_config") is not None:
            raise ValueError("give the router either as router_config or as router_act_fn/"
                             "router_dtype, not both")
        if flat:
            kwargs["router_config"] = RouterConfig.from_kwargs(**flat)
        super().__init__(**kwargs)

    def _derive(self) -> None:
        super()._derive()
        self.router_config = (coerce_nested("router_config", self.router_config, RouterConfig)
                              or RouterConfig())
        self.blockwise_matmul_config = coerce_nested(
            "blockwise_matmul_config", self.blockwise_matmul_config, BlockwiseMatmulConfig
        ) or BlockwiseMatmulConfig()
        if self.blockwise_matmul_config.logical_nc_config is None:  # inherit, leaving the caller's
            self.blockwise_matmul_config = copy.copy(self.blockwise_matmul_config)  # object as is
            self.blockwise_matmul_config.logical_nc_config = self.logical_nc_config
        self.hybrid_sharding_config = coerce_nested(
            "hybrid_sharding_config", self.hybrid_sharding_config, HybridShardingConfig)
        self.moe_fused_tkg_config = coerce_nested(
            "moe_fused_tkg_config", self.moe_fused_tkg_config, MoEFusedTKGConfig)
        self.glu_type = _parse_enum(GLUType, "glu_type", self.glu_type)

    def validate(self) -> None:
        super().validate()
        check_int("moe_tp_degree", self.moe_tp_degree)
        check_int("moe_ep_degree", self.moe_ep_degree)
        _check_moe_degrees("moe", self.moe_tp_degree, self.moe_ep_degree, self.tp_degree)
        hybrid = self.hybrid_sharding_config
        for phase in ("cte", "tkg") if hybrid is not None else ():
            _check_moe_degrees(f"moe_{phase}", getattr(hybrid, f"moe_{phase}_tp_degree"),
                               getattr(hybrid, f"moe_{phase}_ep_degree"), self.tp_degree)
        _check_capacity_factor(self.capacity_factor)
        _check_clamps(self)


# ---------------------------------------------------------------------------- LoRA serving
def parse_lora_ckpt_json(path: "str | os.PathLike") -> Tuple[Dict[str, str], Dict[str, str]]:
    """Read a ``lora_ckpt_json`` file: returns (HBM adapter paths, CPU adapter paths), each
    adapter ID -> checkpoint path, relative paths joined to ``lora-ckpt-dir``."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"lora_ckpt_json file not found: {os.fspath(path)}")
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    if not isinstance(spec, dict) or set(spec) - set(_LORA_JSON_KEYS):
        raise ValueError(f"lora_ckpt_json {os.fspath(path)} must be an object with keys among "
                         f"{list(_LORA_JSON_KEYS)}")
    base = spec.get("lora-ckpt-dir") or ""

    def resolve(key: str) -> Dict[str, str]:
        paths = spec.get(key) or {}
        if not isinstance(paths, dict) or not all(isinstance(v, str) for v in paths.values()):
            raise ValueError(f"{key} in {os.fspath(path)} must map adapter IDs to paths")
        return {str(k): os.path.join(base, v) for k, v in paths.items()}

    return resolve("lora-ckpt-paths"), resolve("lora-ckpt-paths-cpu")


@dataclass(init=False)
class LoraServingConfig(ConfigBase):
    """Multi-LoRA serving. Adapters come from ``lora_ckpt_paths``/``lora_ckpt_paths_cpu`` or from a
    ``lora_ckpt_json`` file (not both); ``max_cpu_loras`` defaults to ``max_loras``."""

    max_loras: int = 1
    max_cpu_loras: Optional[int] = None
    enable_dynamic_multi_lora: bool = False
    lora_ckpt_paths: Optional[Dict[str, str]] = None
    lora_ckpt_paths_cpu: Optional[Dict[str, str]] = None
    lora_memory_transpose: bool = True
    lora_shard_linear_layer: bool = True
    base_model_quantized: bool = False
    lora_ckpt_json: Optional[str] = None

    def _derive(self) -> None:
        check_int("max_loras", self.max_loras)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        self._paths_from_json = self.lora_ckpt_json is not None
        if self._paths_from_json:
            if self.lora_ckpt_paths or self.lora_ckpt_paths_cpu:
                raise ValueError("set either lora_ckpt_json or lora_ckpt_paths/"
                                 "lora_ckpt_paths_cpu, not both")
            self.lora_ckpt_json = os.fspath(self.lora_ckpt_json)
            paths = parse_lora_ckpt_json(self.lora_ckpt_json)
            self.lora_ckpt_paths, self.lora_ckpt_paths_cpu = paths

    def validate(self) -> None:
        check_int("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        for name, limit in (("lora_ckpt_paths", "max_loras"),
                            ("lora_ckpt_paths_cpu", "max_cpu_loras")):
            paths = getattr(self, name)
            if paths is None:
                continue
            if not isinstance(paths, dict) or not all(isinstance(v, str) for v in paths.values()):
                raise ValueError(f"{name} must map adapter IDs to checkpoint paths, got {paths!r}")
            if len(paths) > getattr(self, limit):
                raise ValueError(f"{name} lists {len(paths)} adapters but {limit} is "
                                 f"{getattr(self, limit)}; raise {limit}")

    def to_dict(self) -> Dict[str, Any]:
        """Paths read from ``lora_ckpt_json`` are not written: the file is read again on load."""
        out = super().to_dict()
        if self._paths_from_json:
            out["lora_ckpt_paths"] = out["lora_ckpt_paths_cpu"] = None
        return out


# ---------------------------------------------------------------------------- fused speculation
@dataclass
class FusedSpecNeuronConfig:
    """Fused speculation: the draft model (``draft_config``, ``draft_model_path``) is compiled
    together with the target into one model built from ``worker_cls``."""

    worker_cls: Any
    draft_config: Optional[InferenceConfig] = None
    draft_model_path: Optional[str] = None

    def __post_init__(self) -> None:
        if isinstance(self.worker_cls, str):
            self.worker_cls = import_object(self.worker_cls)
        if not isinstance(self.worker_cls, type):
            raise ValueError(f"worker_cls must be a model class, got {self.worker_cls!r}")
        if self.draft_config is not None and not isinstance(self.draft_config, InferenceConfig):
            raise ValueError(f"draft_config must be an InferenceConfig, "
                             f"got {type(self.draft_config).__name__}")
        if self.draft_model_path is not None:
            self.draft_model_path = os.fspath(self.draft_model_path)

    def to_dict(self) -> Dict[str, Any]:
        """JSON-safe dict; classes are saved as ``"module:qualname"`` strings."""
        draft = self.draft_config
        return {"worker_cls": object_path(self.worker_cls),
                "draft_config": None if draft is None else draft.to_dict(),
                "draft_config_cls": None if draft is None else object_path(type(draft)),
                "draft_model_path": self.draft_model_path}

    @classmethod
    def from_dict(cls, config_dict: Dict[str, Any]) -> "FusedSpecNeuronConfig":
        """Rebuild from ``to_dict`` output, importing the worker and draft config classes."""
        data = dict(config_dict)
        draft, draft_cls_path = data.pop("draft_config", None), data.pop("draft_config_cls", None)
        if isinstance(draft, dict):
            draft_cls = import_object(draft_cls_path) if draft_cls_path else InferenceConfig
            if not (isinstance(draft_cls, type) and issubclass(draft_cls, InferenceConfig)):
                raise ValueError(f"draft_config_cls must name an InferenceConfig class, "
                                 f"got {draft_cls_path!r}")
            draft = draft_cls.from_dict(draft)
        return cls(draft_config=draft, **data)

