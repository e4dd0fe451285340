"""Prompt log-probabilities: NeuronBaseForCausalLM.forward_hidden + lm_logits give transformers'
logits at every prompt position (context encoding of a padded batch, and a chunk of a prompt
past position 0) and leave the same KV cache as forward()."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from nxdi_common.models.llama.modeling_llama import NeuronLlamaForCausalLM
from tests.test_chunked_prefill import TABLE, cached_kv, chunk_config, prompt, run_piece, slots


@pytest.fixture(scope="module")
def hf_all_logits(tiny_llama_ckpt):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_ckpt, torch_dtype=torch.float32)
    with torch.no_grad():
        return lambda ids: hf(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def compiled(tiny_llama_ckpt, tmp_path_factory):
    model = NeuronLlamaForCausalLM(tiny_llama_ckpt, neuron_config=chunk_config())
    path = tmp_path_factory.mktemp("compiled") / "model"
    model.compile(path)
    model.load(path)
    return model


@pytest.mark.usefixtures("one_torch_thread")
def test_every_position_of_a_padded_batch_has_transformers_logits(compiled, hf_all_logits):
    """Context encoding, 2 prompts of 13 and 29 tokens right-padded to one batch (flat rows of
    the block layout's default table)."""
    model = compiled
    model.reset_kv_cache()
    a, b = prompt(13), [(i * 53 + 5) % 256 for i in range(29)]
    ids = torch.zeros(2, 29, dtype=torch.long)
    mask = torch.zeros(2, 29, dtype=torch.long)
    ids[0, :13], mask[0, :13] = torch.tensor(a), 1
    ids[1], mask[1] = torch.tensor(b), 1
    hidden = model.forward_hidden(ids, seq_ids=torch.tensor([0, 1]), attention_mask=mask)
    assert hidden.shape == (2, 29, 64)
    logits = model.lm_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (2, 29, 256)
    assert (logits[0, :13] - hf_all_logits(a)).abs().max() < 1e-4
    assert (logits[1] - hf_all_logits(b)).abs().max() < 1e-4
    # the cache continues like after forward(): a token generation step from each row
    step = model(torch.tensor([[7], [9]]), seq_ids=torch.tensor([0, 1])).logits
    assert (step[0] - hf_all_logits(a + [7])[-1]).abs().max() < 1e-4
    assert (step[1] - hf_all_logits(b + [9])[-1]).abs().max() < 1e-4


@pytest.mark.usefixtures("one_torch_thread")
def test_a_scored_chunk_past_position_0_has_transformers_logits_and_cache(compiled,
                                                                          hf_all_logits):
    model = compiled
    ids = prompt(27)
    model.reset_kv_cache()
    run_piece(model, ids, 0)
    whole_kv = cached_kv(model, 27).clone()
    model.reset_kv_cache()

    def scored(start, end):
        return model.lm_logits(model.forward_hidden(
            torch.tensor([ids[start:end]]), seq_ids=torch.tensor([0]),
            position_ids=torch.arange(start, end).unsqueeze(0),
            slot_mapping=torch.tensor([slots(start, end)]), block_table=torch.tensor([TABLE])))[0]
    pieces = torch.cat([scored(0, 16), scored(16, 24), scored(24, 27)])
    assert (pieces - hf_all_logits(ids)).abs().max() < 1e-4
    assert (cached_kv(model, 27) - whole_kv).abs().max() < 1e-5
    step = model(torch.tensor([[7]]), seq_ids=torch.tensor([0]),
                 position_ids=torch.tensor([[27]]), slot_mapping=torch.tensor([slots(27, 28)]),
                 block_table=torch.tensor([TABLE])).logits[0]
    assert (step - hf_all_logits(ids + [7])[-1]).abs().max() < 1e-4


def test_forward_hidden_refuses_a_padded_chunk_and_a_long_one(compiled):
    compiled.reset_kv_cache()
    run_piece(compiled, prompt(8), 0)
    with pytest.raises(ValueError, match="attention_mask must be all ones"):
        compiled.forward_hidden(torch.tensor([prompt(4)]), position_ids=torch.tensor([[8, 9, 10, 11]]),
                                attention_mask=torch.tensor([[1, 1, 1, 0]]),
                                block_table=torch.tensor([TABLE]))
    with pytest.raises(ValueError, match=r"S <= prefill_chunk_size \(8\)"):
        compiled.forward_hidden(torch.tensor([prompt(9)]),
                                position_ids=torch.arange(8, 17).unsqueeze(0),
                                block_table=torch.tensor([TABLE]))
