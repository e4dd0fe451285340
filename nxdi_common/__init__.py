"""nxdi_common: an NxD-Inference-compatible modeling library that runs on CPU (eager or traced per
bucket) and, when the Neuron SDK is installed, on AWS Inferentia/Trainium.

Public names are importable from the package (`from nxdi_common import NeuronConfig`). They are
resolved lazily so that torch-free modules (block_manager, bucketing) import without torch."""
from __future__ import annotations

import importlib

_EXPORTS = {
    "NeuronConfig": "config", "OnDeviceSamplingConfig": "config", "InferenceConfig": "config",
    "load_pretrained_config": "config",
    "MoENeuronConfig": "config_extra", "RouterConfig": "config_extra",
    "RoutedExpertsMLPOpsConfig": "config_extra", "BlockwiseMatmulConfig": "config_extra",
    "MoEFusedTKGConfig": "config_extra", "HybridShardingConfig": "config_extra",
    "FusedSpecNeuronConfig": "config_extra", "LoraServingConfig": "config_extra",
    "NeuronApplicationBase": "application_base", "NeuronBaseForCausalLM": "application",
    "CausalLMOutput": "application", "ModelWrapper": "model_wrapper",
    "NeuronBaseModel": "models.base",
    "NeuronLlamaForCausalLM": "models.llama", "NeuronLlamaModel": "models.llama",
    "LlamaInferenceConfig": "models.llama", "LlamaNeuronConfig": "models.llama",
    "HuggingFaceGenerationAdapter": "generation",
    "BlockManager": "block_manager", "OutOfBlocks": "block_manager",
    "KVCacheManager": "modules.kv_cache", "BlockKVCacheManager": "modules.kv_cache",
    "Sampler": "modules.sampling", "prepare_sampling_params": "modules.sampling",
    "GQA": "modules.attention",
    "load_state_dict": "checkpoint", "save_state_dict": "checkpoint",
    "prepare_bundled_model": "bundled",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nxdi_common' has no attribute {name!r}")
    return getattr(importlib.import_module(f"nxdi_common.{module}"), name)


def __dir__():
    return __all__
