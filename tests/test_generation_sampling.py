"""HuggingFaceGenerationAdapter with multinomial sampling: seeded runs reproduce, top_k=1 equals
greedy, sampling with on-device dynamic sampling equals sampling from returned logits."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from nxdi_common.config import NeuronConfig, OnDeviceSamplingConfig
from nxdi_common.generation import HuggingFaceGenerationAdapter
from nxdi_common.models.llama import NeuronLlamaForCausalLM


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=256,
                      initializer_range=0.3, eos_token_id=None, bos_token_id=None)
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def _model(ckpt, on_device: bool):
    odsc = OnDeviceSamplingConfig(dynamic=True, do_sample=True) if on_device else None
    nc = NeuronConfig(batch_size=2, seq_len=64, torch_dtype=torch.float32,
                      on_device_sampling_config=odsc)
    model = NeuronLlamaForCausalLM(ckpt, neuron_config=nc)
    model.to_cpu()
    return model


@pytest.mark.parametrize("on_device", [True, False])
def test_seeded_sampling_reproduces_and_top_k_1_is_greedy(ckpt, on_device):
    model = _model(ckpt, on_device)
    adapter = HuggingFaceGenerationAdapter(model)
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=12, do_sample=True, temperature=1.5, top_k=0, top_p=1.0)
    first, second = adapter.generate(ids, seed=7, **kw), adapter.generate(ids, seed=7, **kw)
    assert torch.equal(first, second)
    other = adapter.generate(ids, seed=8, **kw)
    assert not torch.equal(first, other), "a different seed should give different samples"
    greedy = adapter.generate(ids, max_new_tokens=12, do_sample=False)
    top1 = adapter.generate(ids, max_new_tokens=12, do_sample=True, top_k=1, temperature=1.5)
    assert torch.equal(greedy, top1)
