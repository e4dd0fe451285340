"""Tests for nxdi_common.config_extra: MoE, router, blockwise-matmul, hybrid-sharding, LoRA and
fused-speculation configs (documented defaults, validation, and save/load through
InferenceConfig)."""

import json

import pytest
import torch

from nxdi_common.config import InferenceConfig, NeuronConfig, object_path
from nxdi_common.config_extra import (
    BlockShardStrategy,
    BlockwiseMatmulConfig,
    FusedSpecNeuronConfig,
    GLUType,
    HybridShardingConfig,
    LoraServingConfig,
    MoEFusedTKGConfig,
    MoENeuronConfig,
    RoutedExpertsMLPOpsConfig,
    RouterConfig,
    parse_lora_ckpt_json,
)


@pytest.fixture(autouse=True)
def _no_lnc_env(monkeypatch):
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)


class MoEConfig(InferenceConfig):
    """An InferenceConfig whose neuron_config is a MoENeuronConfig."""

    @classmethod
    def get_neuron_config_cls(cls):
        return MoENeuronConfig


class DraftConfig(InferenceConfig):
    """A distinct InferenceConfig class, to check the draft config's class survives a save."""


class WorkerModel(torch.nn.Module):
    """Stands in for the model class fused speculation compiles."""


def init_zero(tensor):
    """A weight-init function, saved by import path."""
    return torch.nn.init.zeros_(tensor)


def _expert_kwargs(**overrides):
    base = dict(num_experts=8, hidden_size=64, intermediate_size=128, top_k=2, hidden_act="silu",
                glu_mlp=True)
    return {**base, **overrides}


# ------------------------------------------------------------------------------ router
def test_router_defaults():
    router = RouterConfig()
    assert (router.act_fn, router.dtype) == ("softmax", torch.float32)
    assert router.to_dict() == {"act_fn": "softmax", "dtype": "float32"}


def test_router_from_dict_and_kwargs():
    assert RouterConfig.from_dict({"act_fn": "sigmoid", "dtype": "bf16"}).dtype is torch.bfloat16
    router = RouterConfig.from_kwargs(router_act_fn="sigmoid", router_dtype="float16", other=1)
    assert router == RouterConfig(act_fn="sigmoid", dtype=torch.float16)
    assert RouterConfig(act_fn="silu").act_fn == "silu"  # any transformers ACT2FN name


@pytest.mark.parametrize("kwargs,field", [
    (dict(act_fn="argmax"), "act_fn"), (dict(act_fn=["softmax"]), "act_fn"),
    (dict(dtype="int8"), "dtype"), (dict(act="softmax"), "act_fn"),
])
def test_router_invalid(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RouterConfig(**kwargs)


# ------------------------------------------------------------------------------ routed experts
def test_routed_experts_defaults():
    cfg = RoutedExpertsMLPOpsConfig(**_expert_kwargs())
    assert cfg.to_dict() == {
        "num_experts": 8, "hidden_size": 64, "intermediate_size": 128, "top_k": 2,
        "hidden_act": "silu", "glu_mlp": True, "bias": False, "glu_type": "glu",
        "hidden_act_scaling_factor": 1.0, "hidden_act_bias": 0.0, "capacity_factor": None,
        "use_index_calc_kernel": False, "gate_clamp_upper_limit": None,
        "gate_clamp_lower_limit": None, "up_clamp_upper_limit": None, "up_clamp_lower_limit": None,
        "normalize_top_k_affinities": False, "early_expert_affinity_modulation": False,
        "input_layer_init_method": None, "output_layer_init_method": None,
        "enable_spmd_rank": False, "is_prefill": None,
    }
    assert cfg.glu_type is GLUType.GLU


@pytest.mark.parametrize("kwargs,field", [
    (dict(top_k=9), "top_k"), (dict(top_k=0), "top_k"), (dict(num_experts=0), "num_experts"),
    (dict(hidden_size=-1), "hidden_size"), (dict(capacity_factor=0), "capacity_factor"),
    (dict(gate_clamp_lower_limit=2.0, gate_clamp_upper_limit=1.0), "gate_clamp_lower_limit"),
    (dict(up_clamp_lower_limit=2.0, up_clamp_upper_limit=1.0), "up_clamp_lower_limit"),
    (dict(glu_type="reglu"), "glu_type"), (dict(hidden_act=None), "hidden_act"),
    (dict(input_layer_init_method=3), "input_layer_init_method"),
])
def test_routed_experts_invalid(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RoutedExpertsMLPOpsConfig(**_expert_kwargs(**kwargs))


def test_routed_experts_requires_shapes():
    with pytest.raises(ValueError, match="requires 'top_k'"):
        RoutedExpertsMLPOpsConfig(num_experts=8, hidden_size=64, intermediate_size=128)


def test_routed_experts_init_methods_roundtrip():
    cfg = RoutedExpertsMLPOpsConfig(**_expert_kwargs(input_layer_init_method=init_zero,
                                                     glu_type="SWIGLU"))
    data = json.loads(json.dumps(cfg.to_dict()))
    assert data["input_layer_init_method"] == object_path(init_zero)
    assert data["glu_type"] == "swiglu"
    again = RoutedExpertsMLPOpsConfig.from_dict(data)
    assert again == cfg and again.input_layer_init_method is init_zero


def test_routed_experts_from_neuron_config():
    moe = MoENeuronConfig(glu_mlp=True, capacity_factor=2.0, hidden_act_bias=0.5,
                          normalize_top_k_affinities=True)
    cfg = RoutedExpertsMLPOpsConfig.from_neuron_config(
        moe, num_experts=4, hidden_size=8, intermediate_size=16, top_k=1, hidden_act="gelu")
    assert (cfg.glu_mlp, cfg.capacity_factor, cfg.hidden_act_bias) == (True, 2.0, 0.5)
    assert cfg.normalize_top_k_affinities is True and cfg.num_experts == 4


# ------------------------------------------------------------------------------ blockwise matmul
def test_blockwise_defaults():
    assert BlockwiseMatmulConfig().to_dict() == {
        "block_size": 512, "use_block_parallel": False, "block_sharding_strategy": "HI_LO",
        "skip_dma_token": False, "skip_dma_weight": False, "logical_nc_config": None,
        "blockwise_nki_autograd_cls": None, "use_torch_block_wise": False,
        "parallelize_token_to_block_mapping": True, "optimized_block_to_token_mapping": True,
        "always_augment_inputs_for_blockwise_matmul": False,
        "use_shard_on_intermediate_dynamic_while": False, "use_shard_on_block_dynamic_while": False,
        "num_static_blocks": None,
    }


def test_blockwise_strategy_and_from_kwargs():
    assert BlockwiseMatmulConfig(block_sharding_strategy="ping_pong").block_sharding_strategy \
        is BlockShardStrategy.PING_PONG
    cfg = BlockwiseMatmulConfig.from_kwargs(block_size=128, use_block_parallel=True, unrelated=1)
    assert (cfg.block_size, cfg.use_block_parallel) == (128, True)
    cls_cfg = BlockwiseMatmulConfig(blockwise_nki_autograd_cls=WorkerModel)
    assert BlockwiseMatmulConfig.from_dict(cls_cfg.to_dict()).blockwise_nki_autograd_cls is WorkerModel


@pytest.mark.parametrize("kwargs,field", [
    (dict(block_size=0), "block_size"), (dict(block_sharding_strategy="ROUND"), "block_sharding_strategy"),
    (dict(logical_nc_config=0), "logical_nc_config"), (dict(num_static_blocks=-1), "num_static_blocks"),
    (dict(use_shard_on_intermediate_dynamic_while=True, use_shard_on_block_dynamic_while=True),
     "use_shard_on_block_dynamic_while"),
])
def test_blockwise_invalid(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BlockwiseMatmulConfig(**kwargs)


# ------------------------------------------------------------------------------ fused TKG, hybrid
def test_moe_fused_tkg_defaults_and_invalid():
    assert MoEFusedTKGConfig().to_dict() == {
        "quantized": False, "moe_fused_kernel_enabled": None, "router_topk_kernel_enabled": None,
        "expert_mlp_kernel_enabled": None, "shared_mlp_kernel_enabled": None}
    with pytest.raises(ValueError, match="moe_fused_kernel_enabled"):
        MoEFusedTKGConfig(moe_fused_kernel_enabled="yes")
    with pytest.raises(ValueError, match="quantized"):
        MoEFusedTKGConfig(quantized=None)


def test_hybrid_sharding_defaults_and_invalid():
    assert HybridShardingConfig().to_dict() == {
        "moe_cte_tp_degree": 1, "moe_cte_ep_degree": 1, "moe_tkg_tp_degree": 1, "moe_tkg_ep_degree": 1}
    with pytest.raises(ValueError, match="moe_tkg_ep_degree"):
        HybridShardingConfig(moe_tkg_ep_degree=0)


# ------------------------------------------------------------------------------ MoENeuronConfig
MOE_DEFAULTS = {
    "moe_tp_degree": 1, "moe_ep_degree": 1, "hybrid_sharding_config": None,
    "return_expert_index": False, "return_router_logits": False, "moe_fused_tkg_config": None,
    "capacity_factor": None, "glu_mlp": False, "glu_type": "glu", "hidden_act_scaling_factor": 1.0,
    "hidden_act_bias": 0.0, "gate_clamp_upper_limit": None, "gate_clamp_lower_limit": None,
    "up_clamp_upper_limit": None, "up_clamp_lower_limit": None, "use_index_calc_kernel": False,
    "early_expert_affinity_modulation": False, "normalize_top_k_affinities": True,
    "fused_shared_experts": False, "shared_experts_sequence_parallel_enabled": False,
    "transpose_shared_experts_weights": False,
}


@pytest.mark.parametrize("name,expected", sorted(MOE_DEFAULTS.items()))
def test_moe_neuron_config_default(name, expected):
    assert getattr(MoENeuronConfig(), name) == expected


def test_moe_nested_defaults_and_inherited_fields():
    cfg = MoENeuronConfig(logical_nc_config=2, batch_size=2)
    assert cfg.router_config == RouterConfig()
    assert cfg.blockwise_matmul_config == BlockwiseMatmulConfig(logical_nc_config=2)
    assert (cfg.max_batch_size, cfg.torch_dtype, cfg.save_sharded_checkpoint) == (2, torch.bfloat16, True)
    assert isinstance(cfg, NeuronConfig)


def test_moe_nested_from_dicts_and_flat_router():
    cfg = MoENeuronConfig(tp_degree=8, router_config={"act_fn": "sigmoid", "dtype": "bfloat16"},
                          blockwise_matmul_config={"block_size": 256, "block_sharding_strategy": "PING_PONG"},
                          hybrid_sharding_config={"moe_cte_tp_degree": 8, "moe_tkg_ep_degree": 8},
                          moe_fused_tkg_config={"moe_fused_kernel_enabled": True})
    assert cfg.router_config == RouterConfig(act_fn="sigmoid", dtype=torch.bfloat16)
    assert cfg.blockwise_matmul_config.block_sharding_strategy is BlockShardStrategy.PING_PONG
    assert cfg.blockwise_matmul_config.logical_nc_config == 1
    assert cfg.hybrid_sharding_config == HybridShardingConfig(moe_cte_tp_degree=8, moe_tkg_ep_degree=8)
    assert cfg.moe_fused_tkg_config.moe_fused_kernel_enabled is True
    shared = BlockwiseMatmulConfig()
    assert MoENeuronConfig(logical_nc_config=2, blockwise_matmul_config=shared) \
        .blockwise_matmul_config.logical_nc_config == 2
    assert shared.logical_nc_config is None  # the caller's object is not modified
    flat = MoENeuronConfig(router_act_fn="sigmoid", router_dtype="fp16")
    assert flat.router_config == RouterConfig(act_fn="sigmoid", dtype=torch.float16)


@pytest.mark.parametrize("kwargs,field", [
    (dict(router_config={"act_fn": "sigmoid"}, router_act_fn="softmax"), "router_config"),
    (dict(moe_tp_degree=0), "moe_tp_degree"),
    (dict(tp_degree=8, moe_tp_degree=3), "moe tp x ep"),
    (dict(tp_degree=4, hybrid_sharding_config={"moe_cte_ep_degree": 8}), "moe_cte"),
    (dict(tp_degree=4, hybrid_sharding_config={"moe_tkg_tp_degree": 3}), "moe_tkg"),
    (dict(capacity_factor=-1.0), "capacity_factor"),
    (dict(gate_clamp_lower_limit=1.0, gate_clamp_upper_limit=0.0), "gate_clamp_lower_limit"),
    (dict(glu_type="geglu"), "glu_type"),
    (dict(router_config=5), "router_config"),
    (dict(blockwise_matmul_config={"block_size": 0}), "block_size"),
    (dict(moe_tpdegree=2), "did you mean 'moe_tp_degree'"),
    (dict(batch_size=0), "batch_size"),
])
def test_moe_neuron_config_invalid(kwargs, field):
    with pytest.raises(ValueError, match=field):
        MoENeuronConfig(**kwargs)


def test_moe_roundtrip_through_inference_config(tmp_path):
    nc = MoENeuronConfig(tp_degree=4, moe_tp_degree=2, moe_ep_degree=2, capacity_factor=1.5,
                         glu_mlp=True, router_config={"act_fn": "sigmoid"},
                         blockwise_matmul_config={"block_size": 128},
                         hybrid_sharding_config={"moe_cte_tp_degree": 4, "moe_tkg_ep_degree": 4})
    cfg = MoEConfig(nc, num_local_experts=8, num_experts_per_tok=2, num_attention_heads=8)
    cfg.save(tmp_path)
    loaded = MoEConfig.load(tmp_path)
    assert isinstance(loaded.neuron_config, MoENeuronConfig)
    assert loaded.neuron_config == nc and loaded == cfg
    assert loaded.neuron_config.router_config.dtype is torch.float32


# ------------------------------------------------------------------------------ LoRA
def test_lora_defaults():
    assert LoraServingConfig().to_dict() == {
        "max_loras": 1, "max_cpu_loras": 1, "enable_dynamic_multi_lora": False,
        "lora_ckpt_paths": None, "lora_ckpt_paths_cpu": None, "lora_memory_transpose": True,
        "lora_shard_linear_layer": True, "base_model_quantized": False, "lora_ckpt_json": None}
    assert LoraServingConfig(max_loras=4).max_cpu_loras == 4


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_loras=0), "max_loras"), (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras"),
    (dict(lora_ckpt_paths={"a": "/a", "b": "/b"}), "lora_ckpt_paths"),
    (dict(max_cpu_loras=2, lora_ckpt_paths_cpu={"a": "/a", "b": "/b", "c": "/c"}), "lora_ckpt_paths_cpu"),
    (dict(lora_ckpt_paths=["/a"]), "lora_ckpt_paths"),
    (dict(lora_ckpt_json="x.json", lora_ckpt_paths={"a": "/a"}), "lora_ckpt_json"),
    (dict(max_lora=2), "did you mean 'max_loras'"),
])
def test_lora_invalid(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LoraServingConfig(**kwargs)


def _write_lora_json(tmp_path):
    path = tmp_path / "loras.json"
    path.write_text(json.dumps({
        "lora-ckpt-dir": "/ckpts",
        "lora-ckpt-paths": {"sql": "sql_adapter", "chat": "/abs/chat"},
        "lora-ckpt-paths-cpu": {"sql": "sql_adapter", "math": "math_adapter"},
    }))
    return path


def test_lora_ckpt_json_parsing(tmp_path):
    hbm, cpu = parse_lora_ckpt_json(_write_lora_json(tmp_path))
    assert hbm == {"sql": "/ckpts/sql_adapter", "chat": "/abs/chat"}
    assert cpu == {"sql": "/ckpts/sql_adapter", "math": "/ckpts/math_adapter"}
    cfg = LoraServingConfig(max_loras=2, lora_ckpt_json=tmp_path / "loras.json")
    assert cfg.lora_ckpt_paths == hbm and cfg.lora_ckpt_paths_cpu == cpu
    assert cfg.lora_ckpt_json == str(tmp_path / "loras.json")
    assert LoraServingConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict()["lora_ckpt_paths"] is None


def test_lora_ckpt_json_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        LoraServingConfig(lora_ckpt_json=str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"lora-ckpt-paths": {"a": "x"}, "lora_dir": "/x"}))
    with pytest.raises(ValueError, match="lora-ckpt-dir"):
        LoraServingConfig(lora_ckpt_json=str(bad))
    bad.write_text(json.dumps({"lora-ckpt-paths": {"a": 3}}))
    with pytest.raises(ValueError, match="lora-ckpt-paths"):
        LoraServingConfig(lora_ckpt_json=str(bad))
    with pytest.raises(ValueError, match="max_loras"):  # 2 HBM adapters, max_loras=1
        LoraServingConfig(lora_ckpt_json=str(_write_lora_json(tmp_path)))


def test_lora_in_neuron_config_roundtrip(tmp_path):
    lora = LoraServingConfig(max_loras=2, max_cpu_loras=4, lora_ckpt_paths={"a": "/a"})
    cfg = InferenceConfig(NeuronConfig(lora_config=lora), vocab_size=10)
    cfg.save(tmp_path)
    loaded = InferenceConfig.load(tmp_path)
    assert loaded.neuron_config.lora_config == lora
    assert NeuronConfig(lora_config={"max_loras": 3}).lora_config == LoraServingConfig(max_loras=3)


# ------------------------------------------------------------------------------ fused speculation
def _fused_spec_target():
    nc = NeuronConfig(enable_eagle_speculation=True, speculation_length=5, trace_tokengen_model=False,
                      seq_len=256, tp_degree=2)
    draft_nc = NeuronConfig(enable_eagle_speculation=True, speculation_length=5,
                            enable_fused_speculation=False, is_eagle_draft=True, seq_len=256)
    draft = DraftConfig(draft_nc, hidden_size=32, num_attention_heads=2)
    spec = FusedSpecNeuronConfig(WorkerModel, draft_config=draft, draft_model_path="/models/draft")
    return InferenceConfig(nc, fused_spec_config=spec, hidden_size=64, num_attention_heads=4), spec


def test_fused_spec_attributes():
    _, spec = _fused_spec_target()
    assert spec.worker_cls is WorkerModel and spec.draft_model_path == "/models/draft"
    assert spec.draft_config.neuron_config.is_eagle_draft is True
    bare = FusedSpecNeuronConfig(WorkerModel)
    assert (bare.draft_config, bare.draft_model_path) == (None, None)


@pytest.mark.parametrize("kwargs,field", [
    (dict(worker_cls=WorkerModel()), "worker_cls"),
    (dict(worker_cls=WorkerModel, draft_config={"neuron_config": {}}), "draft_config"),
])
def test_fused_spec_invalid(kwargs, field):
    with pytest.raises(ValueError, match=field):
        FusedSpecNeuronConfig(**kwargs)


def test_fused_spec_roundtrip(tmp_path):
    cfg, spec = _fused_spec_target()
    data = json.loads(cfg.to_json_string())["fused_spec_config"]
    assert data["worker_cls"] == object_path(WorkerModel)
    assert data["draft_config_cls"] == object_path(DraftConfig)
    cfg.save(tmp_path)
    loaded = InferenceConfig.load(tmp_path)
    assert loaded == cfg and loaded.fused_spec_config == spec
    assert loaded.fused_spec_config.worker_cls is WorkerModel
    assert type(loaded.fused_spec_config.draft_config) is DraftConfig
    assert loaded.fused_spec_config.draft_config.neuron_config.enable_fused_speculation is False


def test_fused_spec_rejects_unimportable_classes():
    class Local(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="module level"):
        FusedSpecNeuronConfig(Local).to_dict()
    with pytest.raises(ImportError, match="no_such_module"):
        FusedSpecNeuronConfig.from_dict({"worker_cls": "no_such_module:Model"})
    with pytest.raises(ValueError, match="draft_config_cls"):
        FusedSpecNeuronConfig.from_dict({"worker_cls": object_path(WorkerModel),
                                         "draft_config": {"neuron_config": None},
                                         "draft_config_cls": object_path(WorkerModel)})
