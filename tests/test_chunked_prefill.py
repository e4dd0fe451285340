"""Chunked prefill (NeuronConfig.prefill_chunk_size): a prompt encoded in pieces, the first by
context encoding and the rest by the chunked-prefill sub-model over the cache, gives the logits
of transformers' forward over the whole prompt and leaves the same KV in the cache as one
context-encoding call, with the paged kernel and with gather + SDPA, eager and compiled; bad
chunks and configs are refused with the field named."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from nxdi_common.application_base import MANIFEST
from nxdi_common.config import NeuronConfig
from nxdi_common.model_wrapper import CHUNKED_PREFILL_MODEL_TAG
from nxdi_common.models.llama.modeling_llama import NeuronLlamaForCausalLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS, CHUNK = 8, 8
TABLE = [5, 17, 2, 11, 20, 8, 0, 14]  # scattered blocks: 64 positions


def chunk_config(**overrides) -> NeuronConfig:
    kwargs = dict(batch_size=2, seq_len=64, torch_dtype=torch.float32, enable_bucketing=True,
                  context_encoding_buckets=[8, 32, 64], token_generation_buckets=[32, 64],
                  backend="cpu", is_block_kv_layout=True, pa_block_size=BS, pa_num_blocks=24,
                  prefill_chunk_size=CHUNK)
    kwargs.update(overrides)
    return NeuronConfig(**kwargs)


def prompt(n: int) -> list[int]:
    return [(i * 37 + 11) % 256 for i in range(n)]


def slots(start: int, end: int) -> list[int]:
    """Cache slots of positions start..end-1 (past the table: wrapped, for the refusal test)."""
    return [TABLE[p // BS % len(TABLE)] * BS + p % BS for p in range(start, end)]


def run_piece(model, ids: list[int], start: int):
    """Positions start.. of the prompt (start 0: context encoding) -> logits [1, vocab]."""
    end = start + len(ids)
    return model(torch.tensor([ids]), seq_ids=torch.tensor([0]),
                 position_ids=torch.arange(start, end).unsqueeze(0),
                 slot_mapping=torch.tensor([slots(start, end)]),
                 block_table=torch.tensor([TABLE])).logits


def encode_in_pieces(model, ids: list[int], first: int, chunk: int = CHUNK):
    """The first `first` tokens by context encoding, the rest `chunk` at a time; the last
    piece's logits."""
    logits = run_piece(model, ids[:first], 0)
    for start in range(first, len(ids), chunk):
        logits = run_piece(model, ids[start:start + chunk], start)
    return logits


def cached_kv(model, n: int) -> torch.Tensor:
    """K and V of positions 0..n-1 as the block table lays them out: [L, 2, n, H, D]."""
    flat = model.kv_cache.flatten(2, 3)  # [L, 2, blocks * BS, H, D]
    return flat[:, :, torch.tensor(slots(0, n))]


@pytest.fixture(scope="module")
def hf_logits(tiny_llama_ckpt):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_ckpt, torch_dtype=torch.float32)
    with torch.no_grad():
        return lambda ids: hf(torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("kernel", ["paged", "sdpa"])
@pytest.mark.parametrize("n, first", [(29, 8), (16, 8), (40, 3), (9, 8), (57, 32)])
def test_pieces_give_the_logits_and_cache_of_one_pass(tiny_llama_ckpt, hf_logits, kernel, n,
                                                      first):
    ids = prompt(n)
    model = NeuronLlamaForCausalLM(tiny_llama_ckpt,
                                   neuron_config=chunk_config(cpu_attention_kernel=kernel))
    model.to_cpu()
    whole = run_piece(model, ids, 0)[0]
    whole_kv = cached_kv(model, n).clone()
    model.reset_kv_cache()
    pieces = encode_in_pieces(model, ids, first)[0]
    assert (pieces - hf_logits(ids)).abs().max() < 1e-4
    assert (pieces - whole).abs().max() < 1e-4
    assert (cached_kv(model, n) - whole_kv).abs().max() < 1e-5
    # the next token generation step continues from the chunked prompt like from the whole one
    step = model(torch.tensor([[7]]), seq_ids=torch.tensor([0]),
                 position_ids=torch.tensor([[n]]), slot_mapping=torch.tensor([slots(n, n + 1)]),
                 block_table=torch.tensor([TABLE])).logits[0]
    assert (step - hf_logits(ids + [7])).abs().max() < 1e-4


def test_a_short_last_chunk_writes_nothing_past_its_tokens(tiny_llama_ckpt):
    """The padded tail of a short chunk writes to the scratch block, not the sequence's blocks."""
    model = NeuronLlamaForCausalLM(tiny_llama_ckpt, neuron_config=chunk_config())
    model.to_cpu()
    ids = prompt(11)
    encode_in_pieces(model, ids, 8)  # positions 8..10 by a chunk of 3 padded to 8
    assert not cached_kv(model, 16)[:, :, 11:].any()


def test_compiled_chunks_equal_eager(tiny_llama_ckpt, tmp_path, compile_cache_dir):
    eager = NeuronLlamaForCausalLM(tiny_llama_ckpt, neuron_config=chunk_config())
    eager.to_cpu()
    compiled = NeuronLlamaForCausalLM(tiny_llama_ckpt, neuron_config=chunk_config())
    compiled.compile(tmp_path / "model")
    compiled.load(tmp_path / "model")
    artifacts = json.loads((tmp_path / "model" / MANIFEST).read_text())["artifacts"]
    assert sorted(artifacts[CHUNKED_PREFILL_MODEL_TAG]) == ["1x32", "1x64"]
    for n, first in ((29, 8), (50, 32)):
        ids = prompt(n)
        for model in (eager, compiled):
            model.reset_kv_cache()
        expected = encode_in_pieces(eager, ids, first)
        assert (encode_in_pieces(compiled, ids, first) - expected).abs().max() < 1e-5


def test_bad_chunks_are_refused(tiny_llama_ckpt):
    model = NeuronLlamaForCausalLM(tiny_llama_ckpt, neuron_config=chunk_config())
    model.to_cpu()
    run_piece(model, prompt(8), 0)
    with pytest.raises(ValueError, match=r"S <= prefill_chunk_size \(8\)"):
        run_piece(model, prompt(9), 8)
    with pytest.raises(ValueError, match="past seq_len 64"):
        run_piece(model, prompt(8), 60)
    with pytest.raises(ValueError, match="input_ids must be in"):
        run_piece(model, [300] * 4, 8)
    plain = NeuronLlamaForCausalLM(tiny_llama_ckpt,
                                   neuron_config=chunk_config(prefill_chunk_size=None))
    plain.to_cpu()
    run_piece(plain, prompt(8), 0)
    with pytest.raises(ValueError, match="set NeuronConfig.prefill_chunk_size"):
        run_piece(plain, prompt(4), 8)


@pytest.mark.parametrize("overrides, message", [
    (dict(is_block_kv_layout=False, pa_block_size=None, pa_num_blocks=None),
     "prefill_chunk_size needs is_block_kv_layout=True"),
    (dict(prefill_chunk_size=0), "prefill_chunk_size must be an integer >= 1"),
    (dict(prefill_chunk_size=65), r"prefill_chunk_size \(65\) must be at most seq_len \(64\)"),
])
def test_bad_configs_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        chunk_config(**overrides)


@pytest.fixture(scope="module")
def wide_heads_ckpt(tmp_path_factory):
    """A tiny random Llama with 64-wide heads: the chunk attention kernel's bfloat16 case."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(1)
    config = LlamaConfig(hidden_size=256, intermediate_size=256, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, vocab_size=256)
    path = tmp_path_factory.mktemp("wide-heads")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_bf16_chunks_run_the_chunk_kernel_and_match_one_pass(wide_heads_ckpt, tmp_path,
                                                             compile_cache_dir):
    """bfloat16 with the fused ops: the compiled chunk graph calls nxdi::chunk_attention, and
    the pieces give one context-encoding pass's logits to bfloat16 rounding, and its argmax."""
    config = dict(torch_dtype=torch.bfloat16, cpu_fused_ops="fused")
    model = NeuronLlamaForCausalLM(wide_heads_ckpt, neuron_config=chunk_config(**config))
    model.compile(tmp_path / "model")
    model.load(tmp_path / "model")
    graph = str(next(iter(model.chunked_prefill_model.runnables.values())).inlined_graph)
    assert "nxdi::chunk_attention" in graph
    for n, first in ((29, 8), (61, 32)):
        ids = prompt(n)
        model.reset_kv_cache()
        whole = run_piece(model, ids, 0)[0]
        model.reset_kv_cache()
        pieces = encode_in_pieces(model, ids, first)[0]
        assert pieces.argmax() == whole.argmax()
        torch.testing.assert_close(pieces, whole, rtol=0, atol=0.05 * whole.abs().max().item())
