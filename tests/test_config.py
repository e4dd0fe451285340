"""Tests for nxdi_common.config: NeuronConfig defaults (exactly as the API reference states),
derived defaults, validation messages, OnDeviceSamplingConfig, InferenceConfig save/load and
aliases, and load_pretrained_config on a tiny HF Llama checkpoint."""

import copy
import json
import os
import pickle

import pytest
import torch

from nxdi_common import config as config_module
from nxdi_common.config import (
    CONFIG_FILE,
    InferenceConfig,
    NeuronConfig,
    OnDeviceSamplingConfig,
    load_pretrained_config,
    to_torch_dtype,
)

# Every attribute of NeuronConfig with its default for seq_len=128, batch_size=1.
REFERENCE_DEFAULTS = {
    "batch_size": 1, "padding_side": "right", "seq_len": 128, "max_context_length": 128,
    "max_new_tokens": None, "max_length": 128, "n_active_tokens": 128, "n_positions": 128,
    "torch_dtype": torch.bfloat16, "rpl_reduce_dtype": None, "cast_type": "config",
    "async_mode": False, "save_sharded_checkpoint": True, "logical_nc_config": 1,
    "skip_sharding": False, "weights_to_skip_layout_optimization": [], "skip_warmup": False,
    "scratchpad_page_size": None, "tp_degree": 1, "flash_decoding_enabled": False,
    "fused_qkv": False, "sequence_parallel_enabled": False, "qk_layernorm": False,
    "attention_dtype": None, "on_device_sampling_config": None, "enable_bucketing": False,
    "context_encoding_buckets": None, "token_generation_buckets": None, "quantized": False,
    "quantized_checkpoints_path": None, "quantization_dtype": "int8",
    "quantization_type": "per_tensor_symmetric", "modules_to_not_convert": None,
    "draft_model_modules_to_not_convert": None, "kv_cache_quant": False,
    "attn_kernel_enabled": False, "qkv_kernel_enabled": False, "mlp_kernel_enabled": False,
    "quantized_mlp_kernel_enabled": False, "rmsnorm_quantize_kernel_enabled": False,
    "is_continuous_batching": False, "max_batch_size": 1, "ctx_batch_size": 1,
    "tkg_batch_size": 1, "speculation_length": 0, "spec_batch_size": 1,
    "enable_eagle_speculation": False, "enable_eagle_draft_input_norm": False,
    "enable_fused_speculation": False, "is_medusa": False, "medusa_speculation_length": 0,
    "num_medusa_heads": 0, "medusa_tree": None, "lora_config": None,
    "cc_pipeline_tiling_factor": 2, "output_logits": False,
}
# Attributes the rest of the library relies on (beyond the reference), with their defaults.
LIBRARY_DEFAULTS = {
    "is_block_kv_layout": False, "pa_num_blocks": None, "pa_block_size": None,
    "is_prefix_caching": False, "prefix_buckets": None, "token_generation_batch_buckets": None,
    "trace_tokengen_model": True, "is_eagle_draft": False, "backend": "auto",
    "cpu_weight_layout": "auto", "cpu_attention_kernel": "auto", "cpu_fused_ops": "auto",
    "max_context_batch_tokens": None, "prefill_chunk_size": None, "mixed_chunk_buckets": None,
    "mixed_steps": True,
}


@pytest.fixture(autouse=True)
def _no_lnc_env(monkeypatch):
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)


# ------------------------------------------------------------------------------ defaults
@pytest.mark.parametrize("name,expected", sorted({**REFERENCE_DEFAULTS, **LIBRARY_DEFAULTS}.items()))
def test_neuron_config_default(name, expected):
    value = getattr(NeuronConfig(), name)
    assert value == expected and type(value) is type(expected)


def test_default_fields_are_exactly_the_documented_ones():
    names = set(NeuronConfig().to_dict())
    assert names == set(REFERENCE_DEFAULTS) | set(LIBRARY_DEFAULTS)


def test_mutable_defaults_are_not_shared():
    a, b = NeuronConfig(), NeuronConfig()
    a.weights_to_skip_layout_optimization.append("x")
    assert b.weights_to_skip_layout_optimization == []


def test_lengths_derive_from_seq_len():
    cfg = NeuronConfig(seq_len=512)
    assert (cfg.max_context_length, cfg.max_length, cfg.n_active_tokens, cfg.n_positions) == (512,) * 4
    assert cfg.max_new_tokens is None


def test_max_new_tokens_is_the_difference():
    cfg = NeuronConfig(seq_len=512, max_context_length=384)
    assert cfg.max_new_tokens == 128
    assert cfg.max_length == 512


def test_explicit_lengths_win():
    cfg = NeuronConfig(seq_len=512, max_context_length=256, max_new_tokens=64, max_length=300,
                       n_active_tokens=7, n_positions=1024)
    assert (cfg.max_new_tokens, cfg.max_length, cfg.n_active_tokens, cfg.n_positions) == (64, 300, 7, 1024)


def test_batch_sizes_derive_from_batch_size():
    cfg = NeuronConfig(batch_size=4)
    assert (cfg.max_batch_size, cfg.ctx_batch_size, cfg.tkg_batch_size, cfg.spec_batch_size) == (4, 4, 4, 4)


def test_explicit_batch_sizes_win():
    cfg = NeuronConfig(batch_size=8, ctx_batch_size=1, is_continuous_batching=True)
    assert (cfg.max_batch_size, cfg.ctx_batch_size, cfg.tkg_batch_size) == (8, 1, 8)


def test_eagle_enables_fused_speculation():
    assert NeuronConfig(enable_eagle_speculation=True, speculation_length=4).enable_fused_speculation is True
    explicit = NeuronConfig(enable_eagle_speculation=True, speculation_length=4,
                            enable_fused_speculation=False)
    assert explicit.enable_fused_speculation is False


def test_logical_nc_config_read_from_env_at_construction(monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    assert NeuronConfig().logical_nc_config == 2
    assert NeuronConfig(logical_nc_config=1).logical_nc_config == 1
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "two")
    with pytest.raises(ValueError, match="NEURON_LOGICAL_NC_CONFIG"):
        NeuronConfig()


@pytest.mark.parametrize("value,expected", [
    ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("float16", torch.float16),
    ("fp16", torch.float16), ("float32", torch.float32), ("fp32", torch.float32),
    ("torch.float32", torch.float32), (torch.float16, torch.float16),
])
def test_torch_dtype_accepts_names(value, expected):
    assert NeuronConfig(torch_dtype=value).torch_dtype is expected


@pytest.mark.parametrize("value", ["int8", "float64", torch.int32, 3])
def test_torch_dtype_rejects_others(value):
    with pytest.raises(ValueError, match="torch_dtype"):
        NeuronConfig(torch_dtype=value)


def test_other_dtypes_are_parsed():
    cfg = NeuronConfig(rpl_reduce_dtype="fp32", attention_dtype="float16")
    assert (cfg.rpl_reduce_dtype, cfg.attention_dtype) == (torch.float32, torch.float16)
    with pytest.raises(ValueError, match="rpl_reduce_dtype"):
        to_torch_dtype("int4", "rpl_reduce_dtype")


def test_unknown_attribute_suggests_closest_name():
    with pytest.raises(ValueError, match=r"'tp_degre'.*did you mean 'tp_degree'"):
        NeuronConfig(tp_degre=2)
    with pytest.raises(ValueError, match="'zzzz'"):
        NeuronConfig(zzzz=1)


def test_deprecated_logical_neuron_cores_is_unknown():
    with pytest.raises(ValueError, match="did you mean 'logical_nc_config'"):
        NeuronConfig(logical_neuron_cores=2)


def test_resolved_backend():
    assert NeuronConfig(backend="cpu").resolved_backend() == "cpu"
    assert NeuronConfig(backend="neuron").resolved_backend() == "neuron"
    assert NeuronConfig().resolved_backend() in ("cpu", "neuron")


# ------------------------------------------------------------------------------ validation
INVALID = [
    (dict(qkv_kernel_enabled=True), "fused_qkv"),
    (dict(qkv_kernel_enabled=True, fused_qkv=True, torch_dtype="fp16"), "qkv_kernel_enabled"),
    (dict(mlp_kernel_enabled=True, torch_dtype="fp32"), "mlp_kernel_enabled"),
    (dict(quantized_mlp_kernel_enabled=True), "mlp_kernel_enabled=True"),
    (dict(async_mode=True), "on_device_sampling_config"),
    (dict(async_mode=True, on_device_sampling_config=OnDeviceSamplingConfig(), speculation_length=3,
          trace_tokengen_model=False), "enable_fused_speculation"),
    (dict(enable_fused_speculation=True), "speculation_length"),
    (dict(speculation_length=-1), "speculation_length"),
    (dict(is_medusa=True), "medusa_speculation_length"),
    (dict(num_medusa_heads=-1), "num_medusa_heads"),
    (dict(seq_len=128, max_context_length=256), "max_context_length"),
    (dict(batch_size=0), "batch_size"),
    (dict(batch_size=2.0), "batch_size"),
    (dict(seq_len=0), "seq_len"),
    (dict(tp_degree=0), "tp_degree"),
    (dict(max_batch_size=0), "max_batch_size"),
    (dict(ctx_batch_size=0), "ctx_batch_size"),
    (dict(batch_size=2, max_batch_size=1), "ctx_batch_size"),
    (dict(batch_size=1, tkg_batch_size=4), "tkg_batch_size"),
    (dict(batch_size=1, spec_batch_size=4), "spec_batch_size"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(logical_nc_config=0), "logical_nc_config"),
    (dict(cc_pipeline_tiling_factor=0), "cc_pipeline_tiling_factor"),
    (dict(scratchpad_page_size=0), "scratchpad_page_size"),
    (dict(max_context_batch_tokens=0), "max_context_batch_tokens"),
    (dict(is_prefix_caching=True), "is_block_kv_layout"),
    (dict(is_block_kv_layout=True), "pa_num_blocks"),
    (dict(is_block_kv_layout=True, pa_num_blocks=8), "pa_block_size"),
    (dict(is_block_kv_layout=True, pa_num_blocks=0, pa_block_size=32), "pa_num_blocks"),
    (dict(padding_side="center"), "padding_side"),
    (dict(cast_type="bf16"), "cast_type"),
    (dict(quantization_dtype="int4"), "quantization_dtype"),
    (dict(quantization_type="per_group"), "quantization_type"),
    (dict(backend="cuda"), "backend"),
    (dict(cpu_weight_layout="packed"), "cpu_weight_layout"),
    (dict(sequence_parallel_enabled=True, tp_degree=3), "max_context_length"),
    (dict(context_encoding_buckets=[64]), "enable_bucketing"),
    (dict(enable_bucketing=True, context_encoding_buckets=[]), "context_encoding_buckets"),
    (dict(enable_bucketing=True, context_encoding_buckets=[0, 64]), "context_encoding_buckets"),
    (dict(enable_bucketing=True, context_encoding_buckets=[64, 64]), "context_encoding_buckets"),
    (dict(enable_bucketing=True, context_encoding_buckets=[64, 32]), "context_encoding_buckets"),
    (dict(enable_bucketing=True, context_encoding_buckets=[64, 256]), "context_encoding_buckets"),
    (dict(enable_bucketing=True, token_generation_buckets=[64, 256]), "token_generation_buckets"),
    (dict(enable_bucketing=True, token_generation_buckets=[-1]), "token_generation_buckets"),
    (dict(enable_bucketing=True, prefix_buckets=[32]), "is_prefix_caching"),
    (dict(enable_bucketing=True, is_prefix_caching=True, is_block_kv_layout=True, pa_num_blocks=8,
          pa_block_size=16, prefix_buckets=[64, 32]), "prefix_buckets"),
    (dict(enable_bucketing=True, is_prefix_caching=True, is_block_kv_layout=True, pa_num_blocks=8,
          pa_block_size=16, prefix_buckets=[32, 0]), "prefix_buckets"),
    (dict(batch_size=4, token_generation_batch_buckets=[1, 2, 8]), "token_generation_batch_buckets"),
    (dict(batch_size=4, token_generation_batch_buckets=[0, 2]), "token_generation_batch_buckets"),
    (dict(batch_size=4, token_generation_batch_buckets=[2, 1]), "token_generation_batch_buckets"),
    (dict(on_device_sampling_config=5), "on_device_sampling_config"),
    (dict(on_device_sampling_config={"global_topk": 0}), "global_topk"),
    (dict(lora_config=3), "lora_config"),
]


@pytest.mark.parametrize("kwargs,field", INVALID, ids=[f for _, f in INVALID])
def test_invalid_neuron_config(kwargs, field):
    with pytest.raises(ValueError, match=field):
        NeuronConfig(**kwargs)


def test_valid_feature_combinations():
    sp = NeuronConfig(sequence_parallel_enabled=True, tp_degree=4, seq_len=256)
    assert sp.max_context_length == 256
    kernels = NeuronConfig(fused_qkv=True, qkv_kernel_enabled=True, mlp_kernel_enabled=True,
                           quantized_mlp_kernel_enabled=True)
    assert kernels.quantized_mlp_kernel_enabled is True
    ods = OnDeviceSamplingConfig()
    fused = NeuronConfig(async_mode=True, on_device_sampling_config=ods, speculation_length=4,
                         enable_fused_speculation=True, trace_tokengen_model=False)
    assert fused.async_mode and fused.enable_fused_speculation


def test_explicit_buckets_and_prefix_caching():
    cfg = NeuronConfig(seq_len=2048, batch_size=4, enable_bucketing=True,
                       context_encoding_buckets=[512, 1024, 2048], prefix_buckets=[512, 1024],
                       token_generation_buckets=[2048], token_generation_batch_buckets=[1, 2, 4],
                       is_prefix_caching=True, is_block_kv_layout=True, pa_num_blocks=1024,
                       pa_block_size=32)
    assert cfg.context_encoding_buckets == [512, 1024, 2048]
    assert cfg.prefix_buckets == [512, 1024]
    with_zero = NeuronConfig(enable_bucketing=True, prefix_buckets=[0, 64], is_prefix_caching=True,
                             is_block_kv_layout=True, pa_num_blocks=8, pa_block_size=16)
    assert with_zero.prefix_buckets == [0, 64]  # the "no prefix" bucket may be given explicitly
    assert cfg.token_generation_batch_buckets == [1, 2, 4]
    assert (cfg.pa_num_blocks, cfg.pa_block_size) == (1024, 32)


# ------------------------------------------------------------------------------ sampling config
def test_on_device_sampling_defaults():
    ods = OnDeviceSamplingConfig()
    assert ods.to_dict() == {"do_sample": False, "top_k": 1, "top_p": 1.0, "temperature": 1.0,
                             "dynamic": False, "deterministic": False, "global_topk": 256}


@pytest.mark.parametrize("kwargs,field", [
    (dict(top_k=0), "top_k"), (dict(top_k=300), "top_k"), (dict(top_k=-1), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_p=None), "top_p"),
    (dict(temperature=0), "temperature"), (dict(temperature="hot"), "temperature"),
    (dict(global_topk=0), "global_topk"), (dict(top_kk=5), "did you mean 'top_k'"),
])
def test_on_device_sampling_invalid(kwargs, field):
    with pytest.raises(ValueError, match=field):
        OnDeviceSamplingConfig(**kwargs)


def test_on_device_sampling_roundtrip_and_nesting():
    ods = OnDeviceSamplingConfig(do_sample=True, top_k=50, top_p=0.9, temperature=0.7, dynamic=True,
                                 deterministic=True, global_topk=64)
    assert OnDeviceSamplingConfig.from_dict(ods.to_dict()) == ods
    cfg = NeuronConfig(on_device_sampling_config=ods.to_dict())
    assert cfg.on_device_sampling_config == ods
    assert cfg.to_dict()["on_device_sampling_config"]["top_k"] == 50


# ------------------------------------------------------------------------------ serialization
def _rich_neuron_config():
    return NeuronConfig(
        batch_size=2, seq_len=256, max_context_length=192, tp_degree=2, torch_dtype="float16",
        rpl_reduce_dtype=torch.float32, padding_side="left", enable_bucketing=True,
        context_encoding_buckets=[64, 128, 192], token_generation_buckets=[128, 256],
        on_device_sampling_config=OnDeviceSamplingConfig(top_k=5, do_sample=True),
        async_mode=True, modules_to_not_convert=["lm_head"], medusa_tree=[[0], [0, 1]],
        is_block_kv_layout=True, pa_num_blocks=64, pa_block_size=16, kv_cache_quant=True,
        backend="cpu", logical_nc_config=2)


def test_neuron_config_to_dict_is_json_safe():
    data = _rich_neuron_config().to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["torch_dtype"] == "float16"
    assert data["rpl_reduce_dtype"] == "float32"
    assert data["on_device_sampling_config"]["top_k"] == 5
    assert data["max_new_tokens"] == 64


def test_neuron_config_roundtrip_is_lossless():
    cfg = _rich_neuron_config()
    again = NeuronConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    assert again.torch_dtype is torch.float16
    assert NeuronConfig(seq_len=64) != NeuronConfig(seq_len=128)


class FlagNeuronConfig(NeuronConfig):
    """A subclass in NxDI style: its own attribute popped from kwargs before the base init."""

    def __init__(self, **kwargs):
        self.my_flag = kwargs.pop("my_flag", False)
        super().__init__(**kwargs)


def test_subclass_attributes_roundtrip():
    cfg = FlagNeuronConfig(my_flag=True, batch_size=2)
    data = cfg.to_dict()
    assert data["my_flag"] is True and data["batch_size"] == 2
    again = FlagNeuronConfig.from_dict(json.loads(json.dumps(data)))
    assert again.my_flag is True and again == cfg and isinstance(again, NeuronConfig)


class TinyConfig(InferenceConfig):
    """A model config requiring two attributes, with a derived one."""

    def get_required_attributes(self):
        return ["hidden_size", "num_attention_heads"]

    def add_derived_config(self):
        self.head_dim = self.hidden_size // self.num_attention_heads


def test_inference_config_kwargs_and_hooks():
    cfg = TinyConfig(NeuronConfig(tp_degree=2), hidden_size=64, num_attention_heads=4)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim) == (64, 4, 16)
    assert cfg.fused_spec_config is None and cfg.metadata is None
    assert TinyConfig.get_neuron_config_cls() is NeuronConfig


def test_required_attributes_missing():
    with pytest.raises(ValueError, match=r"\['hidden_size', 'num_attention_heads'\]"):
        TinyConfig(NeuronConfig())


def test_heads_must_divide_by_tp():
    with pytest.raises(ValueError, match="num_attention_heads"):
        InferenceConfig(NeuronConfig(tp_degree=3), num_attention_heads=4)
    assert InferenceConfig(NeuronConfig(tp_degree=3), num_attention_heads=9).num_attention_heads == 9


def test_neuron_config_type_checked():
    with pytest.raises(TypeError, match="NeuronConfig"):
        InferenceConfig(neuron_config=object())
    assert InferenceConfig({"batch_size": 2}).neuron_config.batch_size == 2


def test_load_config_method_and_hook_order():
    class Loaded(InferenceConfig):
        def load_config(self):
            self.vocab_size, self.hidden_size = 100, 8

    assert Loaded(NeuronConfig()).vocab_size == 100
    assert Loaded(NeuronConfig(), vocab_size=7).vocab_size == 7

    def hook(cfg):
        cfg.vocab_size = 5

    assert Loaded(NeuronConfig(), load_config=hook).vocab_size == 5
    assert not hasattr(Loaded(NeuronConfig(), load_config=hook), "hidden_size")


def test_save_and_load_roundtrip(tmp_path):
    cfg = TinyConfig(_rich_neuron_config(), hidden_size=64, num_attention_heads=4,
                     metadata={"compiler": "cpu"}, rope_parameters={"rope_theta": 500000.0})
    cfg.save(tmp_path / "compiled")
    assert sorted(os.listdir(tmp_path / "compiled")) == [CONFIG_FILE]
    loaded = TinyConfig.load(tmp_path / "compiled")
    assert loaded == cfg
    assert loaded.neuron_config == cfg.neuron_config
    assert loaded.metadata == {"compiler": "cpu"}
    assert loaded.rope_parameters == {"rope_theta": 500000.0}


def test_load_overrides(tmp_path):
    TinyConfig(NeuronConfig(batch_size=2), hidden_size=64, num_attention_heads=4).save(tmp_path)
    loaded = TinyConfig.load(tmp_path, hidden_size=128, neuron_config={"skip_warmup": True})
    assert (loaded.hidden_size, loaded.head_dim) == (128, 32)
    assert loaded.neuron_config.skip_warmup is True and loaded.neuron_config.batch_size == 2
    replaced = TinyConfig.load(tmp_path, neuron_config=NeuronConfig(tp_degree=4))
    assert replaced.neuron_config.tp_degree == 4 and replaced.neuron_config.batch_size == 1


def test_json_file_and_string(tmp_path):
    cfg = InferenceConfig(NeuronConfig(seq_len=64), vocab_size=10)
    path = tmp_path / "cfg.json"
    cfg.to_json_file(path)
    assert InferenceConfig.from_json_file(path) == cfg
    assert InferenceConfig.from_json_string(cfg.to_json_string(), vocab_size=11).vocab_size == 11
    assert json.loads(cfg.to_json_string())["neuron_config"]["seq_len"] == 64


def test_load_missing_file_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        InferenceConfig.load(tmp_path / "nope")


def test_attribute_map_aliases(tmp_path):
    class Aliased(InferenceConfig):
        attribute_map = {"n_embd": "hidden_size"}

    cfg = Aliased(NeuronConfig(), hidden_size=32)
    assert cfg.n_embd == 32
    cfg.n_embd = 48
    assert cfg.hidden_size == 48 and "n_embd" not in cfg.to_dict()
    with pytest.raises(AttributeError):
        cfg.not_there  # noqa: B018
    cfg.attribute_map = {"width": "hidden_size"}
    cfg.save(tmp_path)
    loaded = InferenceConfig.load(tmp_path)
    assert loaded.width == 48 and loaded.attribute_map == {"width": "hidden_size"}


def test_copies_and_pickles():
    class_free = InferenceConfig(NeuronConfig(speculation_length=5, trace_tokengen_model=False),
                                 hidden_size=8, attribute_map={"width": "hidden_size"})
    clone = copy.deepcopy(class_free)
    assert clone == class_free and clone.width == 8
    assert pickle.loads(pickle.dumps(class_free)) == class_free
    draft = copy.deepcopy(class_free.neuron_config)  # the feature guide's draft-config recipe
    draft.speculation_length, draft.trace_tokengen_model = 0, True
    assert class_free.neuron_config.speculation_length == 5 and draft.speculation_length == 0


# ------------------------------------------------------------------------------ HF configs
@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rope_theta=500000.0, tie_word_embeddings=True).save_pretrained(path)
    return path


def test_load_pretrained_config_from_path(tiny_llama_dir):
    nc = NeuronConfig(tp_degree=2, torch_dtype="float32")
    cfg = InferenceConfig(nc, load_config=load_pretrained_config(str(tiny_llama_dir)))
    assert cfg.neuron_config is nc and cfg.neuron_config.torch_dtype is torch.float32
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (128, 64, 128)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 4, 2)
    assert (cfg.model_type, cfg.hidden_act, cfg.tie_word_embeddings) == ("llama", "silu", True)
    assert cfg.rope_parameters["rope_theta"] == 500000.0
    assert cfg._name_or_path == str(tiny_llama_dir)
    assert cfg.attribute_map == {}


def test_load_pretrained_config_roundtrip(tiny_llama_dir, tmp_path):
    cfg = TinyConfig(NeuronConfig(), load_config=load_pretrained_config(tiny_llama_dir))
    assert cfg.head_dim == 16
    cfg.save(tmp_path)
    loaded = TinyConfig.load(tmp_path)
    assert loaded == cfg and loaded._name_or_path == str(tiny_llama_dir)


def test_load_pretrained_config_kwargs_override(tiny_llama_dir):
    cfg = InferenceConfig(NeuronConfig(), load_config=load_pretrained_config(tiny_llama_dir),
                          num_hidden_layers=1)
    assert cfg.num_hidden_layers == 1


def test_load_pretrained_config_inherits_attribute_map():
    from transformers import GPT2Config

    hf = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50, bos_token_id=0, eos_token_id=0)
    cfg = InferenceConfig(NeuronConfig(tp_degree=2), load_config=load_pretrained_config(hf))
    assert cfg.hidden_size == 32 and cfg.num_attention_heads == 4
    cfg.hidden_size = 64
    assert cfg.n_embd == 64
    with pytest.raises(ValueError, match="num_attention_heads"):
        InferenceConfig(NeuronConfig(tp_degree=3), load_config=load_pretrained_config(hf))


def test_load_pretrained_config_missing_path(tmp_path):
    hook = load_pretrained_config(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="missing"):
        InferenceConfig(NeuronConfig(), load_config=hook)


def test_extra_configs_are_reexported():
    from nxdi_common.config_extra import MoENeuronConfig

    assert config_module.MoENeuronConfig is MoENeuronConfig
    with pytest.raises(AttributeError):
        config_module.NotAConfig  # noqa: B018
