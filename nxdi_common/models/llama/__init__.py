from nxdi_common.models.llama.modeling_llama import (LlamaInferenceConfig, LlamaNeuronConfig,
                                                     NeuronLlamaForCausalLM, NeuronLlamaModel)

__all__ = ["LlamaInferenceConfig", "LlamaNeuronConfig", "NeuronLlamaForCausalLM", "NeuronLlamaModel"]
