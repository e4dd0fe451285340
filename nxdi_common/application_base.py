"""NeuronApplicationBase: configuration, weights, and the compile / load / to_cpu life cycle shared
by every application model (NxD Inference API reference, "NeuronApplicationBase")."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from nxdi_common import checkpoint
from nxdi_common.backends import get_backend
from nxdi_common.backends.compile_cache import CompileCache, cache_key, code_fingerprint
from nxdi_common.backends.cpu import EagerBackend, TracedCPUBackend
from nxdi_common.backends.weights import unique_parameters, weights_tuple
from nxdi_common.config import CONFIG_FILE, InferenceConfig, load_pretrained_config
from nxdi_common.kernels import (FUSED, PAGED, SDPA, TORCH_OPS, fused_ops,
                                 kernels_unavailable_reason, paged_attention, panels_suit_this_cpu)
from nxdi_common.modules import quantization
from nxdi_common.modules.linear import (ONEDNN, PANELS, PLAIN, onednn_unavailable_reason,
                                        pack_linear_weights)

MANIFEST = "nxdi_manifest.json"
SHARDED_WEIGHTS = Path("weights") / "tp0_sharded_checkpoint.safetensors"
# Settings baked into the compiled graphs: load() refuses a folder compiled with other values.
_GRAPH_NEURON_FIELDS = ("torch_dtype", "attention_dtype", "seq_len", "max_context_length",
                        "tp_degree", "max_batch_size", "fused_qkv", "qk_layernorm", "output_logits",
                        "is_block_kv_layout", "pa_block_size", "pa_num_blocks", "kv_cache_quant",
                        "quantized", "modules_to_not_convert", "max_context_batch_tokens")
_GRAPH_MODEL_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads",
                       "num_key_value_heads", "num_hidden_layers", "vocab_size", "head_dim")


class NeuronApplicationBase(nn.Module):
    """Entry point for running a model: holds the config, the sub-models (`models`, a list of
    ModelWrapper) and, once built, the torch model with its weights and the per-bucket runnables."""

    _model_cls = None
    _STATE_DICT_MODEL_PREFIX = "model."
    _NEW_STATE_DICT_MODEL_PREFIX = ""

    def __init__(self, model_path, config: InferenceConfig | None = None, neuron_config=None):
        super().__init__()
        if config is None:
            config_cls = self.get_config_cls()
            neuron_config = neuron_config or config_cls.get_neuron_config_cls()()
            config = config_cls(neuron_config, load_config=load_pretrained_config(model_path))
        self.validate_config(config)
        self.config, self.neuron_config = config, config.neuron_config
        self.model_path = str(model_path)
        self.models: list = []
        self.is_compiled = self.is_loaded_to_neuron = False
        self.backend = None
        self._model = None
        self.weights: tuple = ()
        self.weight_layout = PLAIN  # linear weights: PLAIN, ONEDNN or PANELS (modules/linear.py)
        self.attention_kernel = SDPA  # of token generation: SDPA or PAGED (kernels/)
        self.fused_ops = TORCH_OPS  # RMSNorm, RoPE, silu * up, top-K: TORCH_OPS or FUSED (kernels/)
        self.compile_cache = CompileCache(enabled=True)

    @classmethod
    def get_config_cls(cls):
        return InferenceConfig

    @classmethod
    def validate_config(cls, config) -> None:
        if getattr(config, "neuron_config", None) is None:
            raise ValueError("config.neuron_config is required (pass a NeuronConfig)")

    def get_compiler_args(self):
        """Compiler arguments for the backend; none by default."""
        return None

    # -- weights -------------------------------------------------------------------------------
    @classmethod
    def get_state_dict(cls, model_path, config) -> dict:
        """Checkpoint tensors (memory-mapped), prefix-renamed, converted and cast; with
        neuron_config.quantized, from the quantized checkpoint instead of model_path."""
        nc = config.neuron_config
        if nc.quantized:
            sd = quantization.expand_scales(cls._load_quantized(nc))
        else:
            sd = checkpoint.load_state_dict(model_path)
        sd = checkpoint.rename_prefix(sd, cls._STATE_DICT_MODEL_PREFIX, cls._NEW_STATE_DICT_MODEL_PREFIX)
        sd = cls.convert_hf_to_neuron_state_dict(sd, config)
        return checkpoint.cast_state_dict(sd, nc.torch_dtype, nc.cast_type)

    # -- quantization (API reference: save/generate/prepare_quantized_state_dict) ----------------
    @classmethod
    def save_quantized_state_dict(cls, model_path, config) -> None:
        """Quantize the checkpoint in model_path and write it to
        neuron_config.quantized_checkpoints_path: a folder gets model.safetensors; a file path
        ending in .pt or .bin gets a torch.save file (read back with weights_only=True)."""
        nc = config.neuron_config
        quantization.check_supported(nc)
        sd = cls.generate_quantized_state_dict(model_path, config)
        target = Path(nc.quantized_checkpoints_path)
        if target.suffix in (".pt", ".bin"):
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
            torch.save({k: v.contiguous() for k, v in sd.items()}, tmp)
            os.replace(tmp, target)
            return
        checkpoint.save_state_dict({k: v.contiguous() for k, v in sd.items()}, target,
                                   format="safetensors")  # staged, then renamed into place

    @classmethod
    def generate_quantized_state_dict(cls, model_path, config) -> dict:
        """The quantized state dict (HF names) of the checkpoint in model_path."""
        sd = checkpoint.load_state_dict(model_path)
        return cls.prepare_quantized_state_dict(sd, config)

    @classmethod
    def prepare_quantized_state_dict(cls, hf_state_dict: dict, config) -> dict:
        """int8 weights and float32 scales for the projections and LM head not listed in
        modules_to_not_convert; subclasses may override to quantize differently."""
        return quantization.quantize_state_dict(
            hf_state_dict, config.neuron_config, bool(getattr(config, "tie_word_embeddings", False)))

    @staticmethod
    def _load_quantized(nc) -> dict:
        quantization.check_supported(nc)
        path = Path(nc.quantized_checkpoints_path)
        if path.is_file():
            return checkpoint.load_pickle_file(path)  # weights_only=True
        if not path.is_dir():
            raise FileNotFoundError(f"quantized_checkpoints_path {path} does not exist; write it "
                                    "with save_quantized_state_dict(model_path, config)")
        return checkpoint.load_state_dict(path)

    @staticmethod
    def convert_hf_to_neuron_state_dict(state_dict: dict, config) -> dict:
        return state_dict

    def _build_model(self, state_dict: dict) -> None:
        """Build the torch model on the meta device and assign the given tensors as its weights."""
        with torch.device("meta"):
            model = self._model_cls(self.config)
            if self.neuron_config.quantized:
                quantization.quantize_linear_modules(model, self.neuron_config)
        if self.neuron_config.quantized:
            state_dict = quantization.aligned_int8(state_dict)
        expected = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        missing, unexpected = expected - set(state_dict), set(state_dict) - expected
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {sorted(missing)[:8]}, "
                             f"unexpected {sorted(unexpected)[:8]}")
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
        wrong = [f"{n} {tuple(state_dict[n].shape)} (config expects {shapes[n]})"
                 for n in sorted(shapes) if tuple(state_dict[n].shape) != shapes[n]]
        if wrong:
            raise ValueError(f"checkpoint tensor shapes do not match the model config: {wrong[:8]}; "
                             "check config.json (hidden_size, intermediate_size, heads, vocab_size)")
        model.load_state_dict(state_dict, strict=True, assign=True)
        self._model = model.eval()
        self.weight_layout = PLAIN  # as loaded; _apply_weight_layout packs
        for wrapper in self.models:
            wrapper.model = model
        self.weights = weights_tuple(model)

    def shard_weights(self, compiled_model_path) -> None:
        """Save the converted, cast weights into the compiled model folder (tp_degree 1 on CPU)."""
        sd = {name: p.detach() for name, p in unique_parameters(self._model)}
        target = Path(compiled_model_path) / SHARDED_WEIGHTS
        target.parent.mkdir(parents=True, exist_ok=True)
        checkpoint.save_state_dict(sd, target.parent, format="safetensors")
        os.replace(target.parent / "model.safetensors", target)

    def load_weights(self, compiled_model_path) -> None:
        """Load weights: the compiled folder's sharded checkpoint when present, else model_path."""
        sharded = Path(compiled_model_path) / SHARDED_WEIGHTS if compiled_model_path else None
        if sharded is not None and sharded.is_file():
            from safetensors.torch import load_file
            sd = load_file(str(sharded))
            if "lm_head.weight" not in sd and "embed_tokens.weight" in sd:
                sd["lm_head.weight"] = sd["embed_tokens.weight"]  # tied: saved once
        else:
            sd = self.get_state_dict(self.model_path, self.config)
        self._build_model(sd)

    def resolve_weight_layout(self, backend_name: str) -> str:
        """The linear weights' layout for a backend, as neuron_config.cpu_weight_layout asks:
        ONEDNN or PANELS on the CPU backends, else PLAIN. "auto" packs bfloat16 weights: into
        PANELS on x86 CPUs where our kernel is the faster one (kernels.panels_suit_this_cpu:
        AVX2 without AMX, and AMX with the tile state granted) and builds; elsewhere for oneDNN
        where it runs."""
        nc = self.neuron_config
        requested = nc.cpu_weight_layout
        if requested == PANELS or (requested == "auto"
                                   and panels_suit_this_cpu(quantized=bool(nc.quantized))):
            fast, unavailable = PANELS, kernels_unavailable_reason
        else:
            fast, unavailable = ONEDNN, lambda: onednn_unavailable_reason(nc.torch_dtype)
        return _resolve_cpu_option(backend_name, "cpu_weight_layout", requested, fast, PLAIN,
                                   applies=True, auto_wants=nc.torch_dtype == torch.bfloat16,
                                   unavailable=unavailable)

    def _apply_weight_layout(self, layout: str) -> None:
        """Pack the loaded model's linear weights into layout ONEDNN or PANELS (done after the
        plain weights are saved anywhere: packed tensors are never written)."""
        if layout != PLAIN and self.weight_layout != layout:
            pack_linear_weights(self._model, layout)
            self.weights = weights_tuple(self._model)
        self.weight_layout = layout

    def resolve_attention_kernel(self, backend_name: str) -> str:
        """Token generation's attention for a backend: PAGED (the C++ kernel reading the block
        cache in place) on the CPU backends with the block KV layout when
        neuron_config.cpu_attention_kernel asks for it ("auto": where the kernel builds)."""
        nc = self.neuron_config
        return _resolve_cpu_option(
            backend_name, "cpu_attention_kernel", nc.cpu_attention_kernel, PAGED, SDPA,
            applies=nc.is_block_kv_layout, auto_wants=True,
            unavailable=kernels_unavailable_reason)

    def _apply_attention_kernel(self, kernel: str) -> None:
        self._model.kv_mgr.paged_attention = paged_attention() if kernel == PAGED else None
        self.attention_kernel = kernel

    def resolve_fused_ops(self, backend_name: str) -> str:
        """RMSNorm, RoPE, silu * up, the sampler's top-K and context encoding's causal attention
        for a backend: FUSED (one C++ op each) on the CPU backends when
        neuron_config.cpu_fused_ops asks for it ("auto": where the kernels build)."""
        return _resolve_cpu_option(
            backend_name, "cpu_fused_ops", self.neuron_config.cpu_fused_ops, FUSED, TORCH_OPS,
            applies=True, auto_wants=True, unavailable=kernels_unavailable_reason)

    def _apply_fused_ops(self, kind: str) -> None:
        ops = fused_ops() if kind == FUSED else None
        for module in self._model.modules():
            if hasattr(module, "fused"):
                module.fused = ops
        self.fused_ops = kind

    # -- life cycle ----------------------------------------------------------------------------
    def to_cpu(self) -> None:
        """Run entirely on CPU, eagerly (no tracing)."""
        self.load_weights(None)
        self._apply_weight_layout(self.resolve_weight_layout(EagerBackend.name))
        self._apply_attention_kernel(self.resolve_attention_kernel(EagerBackend.name))
        self._apply_fused_ops(self.resolve_fused_ops(EagerBackend.name))
        self.backend = EagerBackend()
        for wrapper in self.models:
            wrapper.runnables = {k: wrapper.graph_fn(k[1], weights_as_inputs=False)
                                 for k in wrapper.bucket_keys()}
        self._on_loaded()

    def compile(self, compiled_model_path, debug: bool = False) -> None:
        """Trace/compile every (sub-model, bucket) into `compiled_model_path`, with
        neuron_config.json, the manifest and (save_sharded_checkpoint) the weights. Written to a
        temporary folder first: a failure leaves no half-written model folder behind."""
        target = Path(compiled_model_path)
        tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            self._compile_into(tmp)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.is_compiled = True

    def _compile_into(self, path: Path) -> None:
        backend = get_backend(self.neuron_config.backend)
        layout = self.resolve_weight_layout(backend.name)
        kernel = self.resolve_attention_kernel(backend.name)
        fused = self.resolve_fused_ops(backend.name)
        if self._model is None or self.weight_layout != PLAIN:
            self.load_weights(None)  # plain weights: the sharded checkpoint is written from them
        if self.neuron_config.save_sharded_checkpoint:
            self.shard_weights(path)
        self._apply_weight_layout(layout)
        self._apply_attention_kernel(kernel)
        self._apply_fused_ops(fused)
        kv_cache = self._model.kv_mgr.allocate()
        manifest = {"backend": backend.name, "backend_version": backend.version,
                    "weight_layout": layout, "attention_kernel": kernel, "fused_ops": fused,
                    "weights": [n for n, _ in unique_parameters(self._model)], "artifacts": {}}
        common = dict(config_json=self.config.to_json_string(), backend_version=backend.version,
                      code=code_fingerprint(), weight_layout=layout, attention_kernel=kernel,
                      fused_ops=fused)
        for wrapper in self.models:
            for key, example in zip(wrapper.bucket_keys(), wrapper.input_generator()):
                rel = f"{wrapper.tag}/b{key[0]}_n{key[1]}{backend.artifact_suffix}"
                dest = path / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                ck = cache_key(tag=wrapper.tag, bucket=key, compiler_args=wrapper.compiler_args, **common)
                if not self.compile_cache.fetch(ck, backend.artifact_suffix, dest):
                    backend.compile(wrapper.graph_fn(key[1]), example + (kv_cache, self.weights), dest,
                                    wrapper.compiler_args)
                    self.compile_cache.store(ck, backend.artifact_suffix, dest)
                manifest["artifacts"].setdefault(wrapper.tag, {})[f"{key[0]}x{key[1]}"] = rel
        self.config.save(str(path))
        (path / MANIFEST).write_text(json.dumps(manifest, indent=1))
        self.backend = backend

    def load(self, compiled_model_path) -> None:
        """Load compiled artifacts and weights; nothing is traced or compiled again."""
        path = Path(compiled_model_path)
        if not (path / MANIFEST).is_file():
            raise FileNotFoundError(f"{path} is not a compiled model folder (no {MANIFEST}); "
                                    "run compile() first")
        manifest = json.loads((path / MANIFEST).read_text())
        self._check_compiled_config(path)
        backend = get_backend(manifest["backend"])
        layout = self.resolve_weight_layout(backend.name)
        kernel = self.resolve_attention_kernel(backend.name)
        fused = self.resolve_fused_ops(backend.name)
        for key, what, option, value, default in (
                ("weight_layout", "linear weights", "cpu_weight_layout", layout, PLAIN),
                ("attention_kernel", "token-generation attention", "cpu_attention_kernel", kernel,
                 SDPA),
                ("fused_ops", "norm/RoPE/activation/top-K/prefill-attention ops", "cpu_fused_ops",
                 fused, TORCH_OPS)):
            compiled = manifest.get(key, default)
            if value != compiled:
                raise ValueError(f"{path} was compiled for {compiled!r} {what} but this model "
                                 f"resolves {option} to {value!r}; compile again")
        self.load_weights(path)
        self._apply_weight_layout(layout)
        self._apply_attention_kernel(kernel)  # loads the kernel library the graphs call
        self._apply_fused_ops(fused)
        names = [n for n, _ in unique_parameters(self._model)]
        if names != manifest["weights"]:
            raise ValueError(f"{path} was compiled for a different model layout; compile again")
        for wrapper in self.models:
            arts = manifest["artifacts"].get(wrapper.tag, {})
            wanted = {f"{b}x{n}" for b, n in wrapper.bucket_keys()}
            if set(arts) != wanted:
                raise ValueError(f"{path} holds {wrapper.tag} buckets {sorted(arts)} but the config "
                                 f"asks for {sorted(wanted)}; compile again with this config")
            wrapper.runnables = {tuple(map(int, k.split("x"))): backend.load(path / rel)
                                 for k, rel in arts.items()}
        self.backend = backend
        self._on_loaded()
        self.is_loaded_to_neuron = True

    def _check_compiled_config(self, path: Path) -> None:
        """Raise ValueError when the folder was compiled with graph-shaping settings (dtype, lengths,
        KV layout, sampling, model sizes) other than this model's: its graphs would not run."""
        config_file = path / CONFIG_FILE
        if not config_file.is_file():
            return
        saved = json.loads(config_file.read_text())
        current = self.config.to_dict()
        saved_nc, current_nc = saved.get("neuron_config") or {}, current.get("neuron_config") or {}
        diffs = [f"{k}: compiled {saved_nc[k]!r}, config {current_nc.get(k)!r}"
                 for k in _GRAPH_NEURON_FIELDS if k in saved_nc and saved_nc[k] != current_nc.get(k)]
        if (saved_nc.get("on_device_sampling_config") is None) != \
                (current_nc.get("on_device_sampling_config") is None):
            diffs.append("on_device_sampling_config: set in one and not the other")
        diffs += [f"{k}: compiled {saved[k]!r}, config {current.get(k)!r}"
                  for k in _GRAPH_MODEL_FIELDS if k in saved and saved[k] != current.get(k)]
        if diffs:
            raise ValueError(f"{path} was compiled with a different configuration "
                             f"({'; '.join(diffs)}); compile again with this config")

    def _on_loaded(self) -> None:
        """Hook run after weights and runnables are in place (allocate state, warm up)."""

    def reset(self) -> None:
        """Reset model state; nothing by default."""


def _resolve_cpu_option(backend_name: str, option: str, requested: str, fast: str, plain: str, *,
                        applies: bool, auto_wants: bool, unavailable) -> str:
    """A CPU-backend choice between a fast path and the plain one (cpu_weight_layout,
    cpu_attention_kernel): plain on other backends, when not applicable or asked for; "auto"
    takes the fast path when auto_wants it and it is available (``unavailable()`` returns None,
    else why not); asking for the fast path where it is unavailable is a ValueError."""
    if backend_name not in (TracedCPUBackend.name, EagerBackend.name) or requested == plain \
            or not applies:
        return plain
    if requested == "auto" and not auto_wants:
        return plain
    reason = unavailable()
    if reason is None:
        return fast
    if requested == fast:
        raise ValueError(f"{option} {fast!r} cannot be used: {reason}; use 'auto' or {plain!r}")
    return plain
