"""Configuration objects of the NxD Inference programming model.

``NeuronConfig`` holds compile-time options (shapes, parallelism, kernels, features);
``InferenceConfig`` pairs one with the model's own attributes (usually a HF ``config.json``) and
is saved as ``neuron_config.json`` beside compiled artifacts. Defaults follow the NxDI API
reference. MoE, LoRA, router and fused-speculation configs live in ``config_extra`` and are
re-exported here lazily.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from nxdi_common.config_base import (  # re-exported: part of this module's public API
    ConfigBase,
    _is_number,
    check_buckets,
    check_choice,
    check_int,
    coerce_nested,
    object_path,
    to_jsonable,
    to_torch_dtype,
    unknown_name_message,
)

CONFIG_FILE = "neuron_config.json"
LNC_ENV_VAR = "NEURON_LOGICAL_NC_CONFIG"
_EXTRA_NAMES = ("RouterConfig", "RoutedExpertsMLPOpsConfig", "BlockwiseMatmulConfig",
                "BlockShardStrategy", "GLUType", "MoEFusedTKGConfig", "HybridShardingConfig",
                "MoENeuronConfig", "FusedSpecNeuronConfig", "LoraServingConfig")


def __getattr__(name: str) -> Any:
    """Re-export the configs of ``config_extra`` (imported lazily: it imports this module)."""
    if name in _EXTRA_NAMES:
        return getattr(importlib.import_module("nxdi_common.config_extra"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------- sampling config
@dataclass(init=False)
class OnDeviceSamplingConfig(ConfigBase):
    """Sampling done inside the compiled model. ``top_k`` must lie in [1, global_topk]: a top-k
    beyond the global pre-selection could never be honoured; top_k=1 is greedy."""

    do_sample: bool = False
    top_k: int = 1
    top_p: float = 1.0
    temperature: float = 1.0
    dynamic: bool = False
    deterministic: bool = False
    global_topk: int = 256

    def validate(self) -> None:
        check_int("global_topk", self.global_topk)
        check_int("top_k", self.top_k)
        if self.top_k > self.global_topk:
            raise ValueError(f"top_k ({self.top_k}) must be <= global_topk ({self.global_topk})")
        if not (_is_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (_is_number(self.temperature) and self.temperature > 0.0):
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")


# ---------------------------------------------------------------------------- NeuronConfig
@dataclass(init=False)
class NeuronConfig(ConfigBase):
    """Compile-time options for inference (see the API reference for each attribute).

    Derived defaults (None means "derive"): max_context_length, max_length, n_active_tokens,
    n_positions <- seq_len; max_new_tokens <- seq_len - max_context_length (None when 0);
    max/ctx/tkg/spec batch sizes <- batch_size; enable_fused_speculation <- enable_eagle_speculation
    (an explicit value wins); logical_nc_config <- $NEURON_LOGICAL_NC_CONFIG, else 1.
    """

    # General
    batch_size: int = 1
    padding_side: str = "right"
    seq_len: int = 128
    max_context_length: Optional[int] = None
    max_new_tokens: Optional[int] = None
    max_length: Optional[int] = None
    n_active_tokens: Optional[int] = None
    n_positions: Optional[int] = None
    torch_dtype: Any = torch.bfloat16
    rpl_reduce_dtype: Any = None
    cast_type: str = "config"
    async_mode: bool = False
    save_sharded_checkpoint: bool = True
    logical_nc_config: Optional[int] = None
    skip_sharding: bool = False
    weights_to_skip_layout_optimization: List[str] = field(default_factory=list)
    skip_warmup: bool = False
    scratchpad_page_size: Optional[int] = None
    backend: str = "auto"  # extension: "auto" | "cpu" | "neuron", the target of compile()
    # extension: linear weights on the CPU backends: "onednn" (packed once at load into oneDNN's
    # blocked layout), "panels" (16-column panels multiplied by our C++ kernel, for x86 CPUs
    # without AMX), "plain", or "auto" (for bfloat16: panels on an x86 CPU with AVX2 and no
    # amx_bf16 where the kernels build, else onednn where oneDNN runs, else plain)
    cpu_weight_layout: str = "auto"
    # extension: token-generation attention on the CPU backends with the block KV layout: "paged"
    # (our C++ kernel reads each row's own blocks in place, nxdi_common/kernels), "sdpa" (gather
    # the blocks up to the length bucket, then torch SDPA under a mask), or "auto" (paged where the
    # kernel builds, else sdpa)
    cpu_attention_kernel: str = "auto"
    # extension: RMSNorm, RoPE, the MLP's silu * up, the sampler's top-K and (bf16/fp16) context
    # encoding's causal attention on the CPU backends: "fused" (one C++ op each,
    # nxdi_common/kernels, the results of the torch ops they replace: the same bits, or for the
    # attention within the dtype's rounding), "torch", or "auto" (fused where the kernels build)
    cpu_fused_ops: str = "auto"
    # Distributed
    tp_degree: int = 1
    # Attention
    flash_decoding_enabled: bool = False
    fused_qkv: bool = False
    sequence_parallel_enabled: bool = False
    qk_layernorm: bool = False
    attention_dtype: Any = None
    # On-device sampling
    on_device_sampling_config: Optional[OnDeviceSamplingConfig] = None
    output_logits: bool = False
    # Bucketing
    enable_bucketing: bool = False
    context_encoding_buckets: Optional[List[int]] = None
    token_generation_buckets: Optional[List[int]] = None
    token_generation_batch_buckets: Optional[List[int]] = None  # extension: TKG batch sizes
    # extension: chunked prefill (block KV layout): a third sub-model runs up to this many
    # prompt tokens of one sequence from any position, attending to its cached positions, so a
    # long prompt can be encoded in pieces between token-generation steps. None: no such model
    prefill_chunk_size: Optional[int] = None
    # extension: the chunk lengths the mixed sub-model (a chunk and a decode step in one call)
    # is built for, ascending, ending at prefill_chunk_size; a shorter piece pads to the
    # smallest that holds it, so a small piece beside a running batch costs a small call.
    # None: prefill_chunk_size only
    mixed_chunk_buckets: Optional[List[int]] = None
    # extension: with prefill_chunk_size, also build the mixed sub-models (a chunk and a decode
    # step in one call). False for a model that never decodes beside a prefill (a prefill
    # worker's, which runs chunks only to encode a prompt past its cached prefix)
    mixed_steps: bool = True
    prefix_buckets: Optional[List[int]] = None
    # Quantization
    quantized: bool = False
    quantized_checkpoints_path: Optional[str] = None
    quantization_dtype: str = "int8"
    quantization_type: str = "per_tensor_symmetric"
    modules_to_not_convert: Optional[List[str]] = None
    draft_model_modules_to_not_convert: Optional[List[str]] = None
    kv_cache_quant: bool = False
    # Kernels
    attn_kernel_enabled: bool = False
    qkv_kernel_enabled: bool = False
    mlp_kernel_enabled: bool = False
    quantized_mlp_kernel_enabled: bool = False
    rmsnorm_quantize_kernel_enabled: bool = False
    # Continuous batching and block (paged) KV cache
    is_continuous_batching: bool = False
    max_batch_size: Optional[int] = None
    ctx_batch_size: Optional[int] = None
    # extension: context-encoding buckets of more than one prompt only where batch x length is at
    # most this many tokens (one prompt runs alone at every length); None: every pair. Batching
    # long prompts gains nothing on CPU, and every (batch, length) bucket is traced and warmed up.
    max_context_batch_tokens: Optional[int] = None
    tkg_batch_size: Optional[int] = None
    is_block_kv_layout: bool = False
    pa_num_blocks: Optional[int] = None
    pa_block_size: Optional[int] = None
    is_prefix_caching: bool = False
    # Speculative decoding
    trace_tokengen_model: bool = True
    speculation_length: int = 0
    spec_batch_size: Optional[int] = None
    enable_eagle_speculation: bool = False
    enable_eagle_draft_input_norm: bool = False
    enable_fused_speculation: Optional[bool] = None
    is_eagle_draft: bool = False
    # Medusa
    is_medusa: bool = False
    medusa_speculation_length: int = 0
    num_medusa_heads: int = 0
    medusa_tree: Optional[List[List[int]]] = None
    # Multi-LoRA, compilation
    lora_config: Any = None
    cc_pipeline_tiling_factor: int = 2

    def _derive(self) -> None:
        check_int("seq_len", self.seq_len)
        check_int("batch_size", self.batch_size)
        check_int("max_context_length", self.max_context_length, optional=True)
        for name in ("max_context_length", "max_length", "n_active_tokens", "n_positions"):
            if getattr(self, name) is None:
                setattr(self, name, self.seq_len)
        if self.max_new_tokens is None:
            self.max_new_tokens = (self.seq_len - self.max_context_length) or None
        for name in ("max_batch_size", "ctx_batch_size", "tkg_batch_size", "spec_batch_size"):
            if getattr(self, name) is None:
                setattr(self, name, self.batch_size)
        if self.enable_fused_speculation is None:
            self.enable_fused_speculation = bool(self.enable_eagle_speculation)
        if self.logical_nc_config is None:
            self.logical_nc_config = _lnc_from_env()
        self._coerce_types()

    def _coerce_types(self) -> None:
        self.torch_dtype = to_torch_dtype(self.torch_dtype)
        for name in ("rpl_reduce_dtype", "attention_dtype"):
            if getattr(self, name) is not None:
                setattr(self, name, to_torch_dtype(getattr(self, name), name))
        self.on_device_sampling_config = coerce_nested(
            "on_device_sampling_config", self.on_device_sampling_config, OnDeviceSamplingConfig)
        if self.lora_config is not None:
            lora_cls = importlib.import_module("nxdi_common.config_extra").LoraServingConfig
            self.lora_config = coerce_nested("lora_config", self.lora_config, lora_cls)

    def validate(self) -> None:
        self._validate_sizes()
        self._validate_choices()
        self._validate_kernels()
        self._validate_features()
        self._validate_buckets()

    def _validate_sizes(self) -> None:
        for name in ("max_length", "n_active_tokens", "n_positions", "tp_degree", "max_batch_size",
                     "ctx_batch_size", "tkg_batch_size", "spec_batch_size", "logical_nc_config",
                     "cc_pipeline_tiling_factor"):
            check_int(name, getattr(self, name))
        check_int("scratchpad_page_size", self.scratchpad_page_size, optional=True)
        check_int("max_context_batch_tokens", self.max_context_batch_tokens, optional=True)
        if self.max_context_length > self.seq_len:
            raise ValueError(f"max_context_length ({self.max_context_length}) must be <= seq_len "
                             f"({self.seq_len}); raise seq_len or lower max_context_length")
        check_int("max_new_tokens", self.max_new_tokens, optional=True)
        for name in ("ctx_batch_size", "tkg_batch_size", "spec_batch_size"):
            if getattr(self, name) > self.max_batch_size:
                raise ValueError(f"{name} ({getattr(self, name)}) must be <= max_batch_size "
                                 f"({self.max_batch_size}); raise max_batch_size")

    def _validate_choices(self) -> None:
        check_choice("padding_side", self.padding_side, ("right", "left"))
        check_choice("cast_type", self.cast_type, ("config", "as-declared"))
        check_choice("quantization_dtype", self.quantization_dtype, ("int8", "f8e4m3", "f8e5m2"))
        check_choice("quantization_type", self.quantization_type,
                     ("per_tensor_symmetric", "per_channel_symmetric"))
        check_choice("backend", self.backend, ("auto", "cpu", "neuron"))
        check_choice("cpu_weight_layout", self.cpu_weight_layout,
                     ("auto", "plain", "onednn", "panels"))
        check_choice("cpu_attention_kernel", self.cpu_attention_kernel, ("auto", "sdpa", "paged"))
        check_choice("cpu_fused_ops", self.cpu_fused_ops, ("auto", "torch", "fused"))
        if self.cpu_attention_kernel == "paged" and not self.is_block_kv_layout:
            raise ValueError("cpu_attention_kernel 'paged' needs is_block_kv_layout=True (it reads "
                             "the block table); use 'auto' or 'sdpa' with the flat KV layout")

    def _validate_kernels(self) -> None:
        bf16 = self.torch_dtype == torch.bfloat16
        if self.qkv_kernel_enabled and not (self.fused_qkv and bf16):
            raise ValueError("qkv_kernel_enabled needs fused_qkv=True and torch_dtype=bfloat16")
        if self.mlp_kernel_enabled and not bf16:
            raise ValueError("mlp_kernel_enabled needs torch_dtype=bfloat16")
        if self.quantized_mlp_kernel_enabled and not self.mlp_kernel_enabled:
            raise ValueError("quantized_mlp_kernel_enabled needs mlp_kernel_enabled=True")
        if self.sequence_parallel_enabled and self.max_context_length % self.tp_degree:
            raise ValueError(f"sequence_parallel_enabled needs max_context_length "
                             f"({self.max_context_length}) divisible by tp_degree "
                             f"({self.tp_degree})")

    def _validate_features(self) -> None:
        if self.async_mode and self.on_device_sampling_config is None:
            raise ValueError("async_mode needs on_device_sampling_config (on-device sampling)")
        check_int("speculation_length", self.speculation_length, minimum=0)
        if self.async_mode and self.speculation_length > 0 and not self.enable_fused_speculation:
            raise ValueError("async_mode with speculation needs enable_fused_speculation=True")
        if self.enable_fused_speculation and self.speculation_length < 1:
            raise ValueError("enable_fused_speculation needs speculation_length >= 1")
        check_int("medusa_speculation_length", self.medusa_speculation_length, minimum=0)
        check_int("num_medusa_heads", self.num_medusa_heads, minimum=0)
        if self.is_medusa and (self.medusa_speculation_length < 1 or self.num_medusa_heads < 1):
            raise ValueError("is_medusa needs medusa_speculation_length >= 1 and "
                             "num_medusa_heads >= 1")
        if self.is_prefix_caching and not self.is_block_kv_layout:
            raise ValueError("is_prefix_caching needs is_block_kv_layout=True")
        if self.is_block_kv_layout:
            check_int("pa_num_blocks (required by is_block_kv_layout)", self.pa_num_blocks)
            check_int("pa_block_size (required by is_block_kv_layout)", self.pa_block_size)
        if self.prefill_chunk_size is not None:
            if not self.is_block_kv_layout:
                raise ValueError("prefill_chunk_size needs is_block_kv_layout=True (a chunk "
                                 "reads the earlier chunks' keys through the block table)")
            check_int("prefill_chunk_size", self.prefill_chunk_size)
            if self.prefill_chunk_size > self.seq_len:
                raise ValueError(f"prefill_chunk_size ({self.prefill_chunk_size}) must be at "
                                 f"most seq_len ({self.seq_len})")
        self._validate_mixed_chunk_buckets()

    def _validate_mixed_chunk_buckets(self) -> None:
        sizes = self.mixed_chunk_buckets
        if sizes is None:
            return
        if self.prefill_chunk_size is None:
            raise ValueError("mixed_chunk_buckets needs prefill_chunk_size (the largest piece)")
        check_buckets("mixed_chunk_buckets", sizes, self.prefill_chunk_size,
                      "prefill_chunk_size")
        if sizes[-1] != self.prefill_chunk_size:
            raise ValueError(f"mixed_chunk_buckets must end at prefill_chunk_size "
                             f"({self.prefill_chunk_size}), the largest piece; got {list(sizes)}")

    def _validate_buckets(self) -> None:
        for name in ("context_encoding_buckets", "token_generation_buckets", "prefix_buckets"):
            if getattr(self, name) is not None and not self.enable_bucketing:
                raise ValueError(f"{name} is set but enable_bucketing is False; "
                                 f"set enable_bucketing=True")
        if self.prefix_buckets is not None and not self.is_prefix_caching:
            raise ValueError("prefix_buckets needs is_prefix_caching=True")
        for name, limit, allow_zero in (
                ("context_encoding_buckets", "max_context_length", False),
                ("token_generation_buckets", "seq_len", False),
                ("prefix_buckets", "max_context_length", True),
                ("token_generation_batch_buckets", "tkg_batch_size", False)):
            check_buckets(name, getattr(self, name), getattr(self, limit), limit, allow_zero)

    def resolved_backend(self) -> str:
        """The backend ``compile()`` targets ("auto": neuron when torch_neuronx is importable)."""
        if self.backend != "auto":
            return self.backend
        return "neuron" if importlib.util.find_spec("torch_neuronx") is not None else "cpu"


def _lnc_from_env() -> int:
    """Read $NEURON_LOGICAL_NC_CONFIG (at construction only); 1 when unset."""
    raw = os.environ.get(LNC_ENV_VAR)
    if raw is None or raw.strip() == "":
        return 1
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{LNC_ENV_VAR} must be an integer such as 1 or 2, got {raw!r}") from None


# ---------------------------------------------------------------------------- InferenceConfig
class InferenceConfig:
    """A NeuronConfig plus model attributes (from kwargs or a ``load_config`` hook).

    ``attribute_map`` maps alias -> original name: getting or setting an alias reaches the original.
    """

    attribute_map: Dict[str, str] = {}

    def __init__(self, neuron_config: Optional[NeuronConfig], fused_spec_config: Any = None,
                 load_config: Optional[Callable[["InferenceConfig"], None]] = None,
                 metadata: Optional[Dict[str, Any]] = None, **kwargs: Any) -> None:
        if isinstance(neuron_config, dict):
            neuron_config = self.get_neuron_config_cls().from_dict(neuron_config)
        if neuron_config is not None and not isinstance(neuron_config, NeuronConfig):
            raise TypeError(f"neuron_config must be a NeuronConfig, "
                            f"got {type(neuron_config).__name__}")
        self.neuron_config = neuron_config
        self.fused_spec_config = fused_spec_config
        self.metadata = metadata
        if load_config is not None:
            load_config(self)
        else:
            self.load_config()
        if "attribute_map" in kwargs:
            self.attribute_map = dict(kwargs.pop("attribute_map"))
        for key, value in kwargs.items():
            setattr(self, key, value)
        try:
            self.add_derived_config()
        except AttributeError as err:  # usually a missing required attribute: say which
            self._check_required_attributes(cause=err)
            raise
        self.validate_config()

    def __getattr__(self, name: str) -> Any:
        amap = self.__dict__.get("attribute_map", type(self).attribute_map)
        if name in amap:
            return getattr(self, amap[name])
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        amap = self.__dict__.get("attribute_map", type(self).attribute_map)
        super().__setattr__(amap.get(name, name), value)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.to_json_string()})"

    def load_config(self) -> None:
        """Load model attributes; a no-op here, overridden by model-specific configs."""

    def add_derived_config(self) -> None:
        """Compute attributes derived from the loaded ones; a no-op here."""

    def get_required_attributes(self) -> List[str]:
        """Names that must be present for validation to pass; none here."""
        return []

    def validate_config(self) -> None:
        """Check the required attributes exist and attention heads split evenly over TP."""
        self._check_required_attributes()
        heads = getattr(self, "num_attention_heads", None)
        tp = self.neuron_config.tp_degree if self.neuron_config is not None else 1
        if heads is not None and heads % tp:
            raise ValueError(f"num_attention_heads ({heads}) must be divisible by tp_degree "
                             f"({tp}); choose a tp_degree that divides it")

    def _check_required_attributes(self, cause: Optional[BaseException] = None) -> None:
        missing = [a for a in self.get_required_attributes() if not hasattr(self, a)]
        if missing:
            raise ValueError(f"{type(self).__name__} is missing required attributes {missing}; "
                             f"pass them as keyword arguments or through load_config") from cause

    @classmethod
    def get_neuron_config_cls(cls) -> type:
        """The NeuronConfig class used to rebuild ``neuron_config`` when loading."""
        return NeuronConfig

    def to_dict(self) -> Dict[str, Any]:
        """JSON-safe dict of every attribute (nested configs as dicts)."""
        return {key: to_jsonable(value) for key, value in self.__dict__.items()}

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def to_json_file(self, json_file: "str | os.PathLike") -> None:
        with open(json_file, "w", encoding="utf-8") as f:
            f.write(self.to_json_string() + "\n")

    def save(self, model_path: "str | os.PathLike") -> None:
        """Write ``neuron_config.json`` into ``model_path`` (created if needed)."""
        os.makedirs(model_path, exist_ok=True)
        self.to_json_file(os.path.join(model_path, CONFIG_FILE))

    @classmethod
    def from_dict(cls, config_dict: Dict[str, Any], **kwargs: Any) -> "InferenceConfig":
        """Rebuild from ``to_dict`` output; ``kwargs`` override attributes. A ``neuron_config``
        override may be a NeuronConfig (replaces) or a dict (merged over the saved one)."""
        merged = {**config_dict, **kwargs}
        saved_nc, override = config_dict.get("neuron_config"), kwargs.get("neuron_config")
        if isinstance(override, dict) and isinstance(saved_nc, dict):
            merged["neuron_config"] = {**saved_nc, **override}
        fused = merged.get("fused_spec_config")
        if isinstance(fused, dict):
            extra = importlib.import_module("nxdi_common.config_extra")
            merged["fused_spec_config"] = extra.FusedSpecNeuronConfig.from_dict(fused)
        return cls(**merged)

    @classmethod
    def from_json_string(cls, json_string: str, **kwargs: Any) -> "InferenceConfig":
        return cls.from_dict(json.loads(json_string), **kwargs)

    @classmethod
    def from_json_file(cls, json_file: "str | os.PathLike", **kwargs: Any) -> "InferenceConfig":
        if not os.path.isfile(json_file):
            raise FileNotFoundError(f"config file not found: {os.fspath(json_file)}")
        with open(json_file, encoding="utf-8") as f:
            return cls.from_json_string(f.read(), **kwargs)

    @classmethod
    def load(cls, model_path: "str | os.PathLike", **kwargs: Any) -> "InferenceConfig":
        """Load ``neuron_config.json`` from ``model_path``; ``kwargs`` override attributes."""
        return cls.from_json_file(os.path.join(model_path, CONFIG_FILE), **kwargs)


def load_pretrained_config(model_path_or_hf_config: Any) -> Callable[[InferenceConfig], None]:
    """Return a ``load_config`` hook filling an InferenceConfig from a HF config.

    Accepts a checkpoint directory (or config.json path) or a ``PretrainedConfig``. The hook copies
    every attribute of ``to_dict()``, the ``attribute_map`` and ``_name_or_path``; it never touches
    ``neuron_config`` (the NeuronConfig's torch_dtype is not replaced by the checkpoint's dtype).
    """
    def hook(config: InferenceConfig) -> None:
        hf_config = _resolve_hf_config(model_path_or_hf_config)
        config.attribute_map = dict(hf_config.attribute_map)
        for key, value in hf_config.to_dict().items():
            if key not in ("neuron_config", "fused_spec_config", "metadata", "attribute_map"):
                setattr(config, key, value)
        name = getattr(hf_config, "_name_or_path", "") or ""
        if not name and not hasattr(model_path_or_hf_config, "to_dict"):
            name = os.fspath(model_path_or_hf_config)
        config._name_or_path = name
    return hook


def _resolve_hf_config(source: Any) -> Any:
    """A PretrainedConfig from itself or from a local checkpoint path."""
    if hasattr(source, "to_dict") and hasattr(source, "attribute_map"):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"expected a model path or a PretrainedConfig, got {type(source).__name__}")
    if not os.path.exists(source):
        raise FileNotFoundError(f"model path not found: {os.fspath(source)}")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(os.fspath(source), local_files_only=True)
