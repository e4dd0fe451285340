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
from nxdi_common.model_wrapper import CHUNKED_PREFILL_MODEL_TAG, MIXED_MODEL_TAG
from nxdi_common.models.llama.modeling_llama import NeuronLlamaForCausalLM
from nxdi_common.modules import attention

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


def record_sizes(wrappers: dict) -> list[int]:
    """A list that gets the chunk length of each call of these sub-models (by length)."""
    used: list[int] = []
    for size, wrapper in wrappers.items():
        def counted(run, size=size):
            return lambda *args: (used.append(size), run(*args))[1]
        wrapper.runnables = {key: counted(run) for key, run in wrapper.runnables.items()}
    return used


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
    (dict(prefill_chunk_size=None, mixed_chunk_buckets=[4, 8]),
     r"mixed_chunk_buckets needs prefill_chunk_size"),
    (dict(mixed_chunk_buckets=[2, 4]),
     r"mixed_chunk_buckets must end at prefill_chunk_size \(8\), the largest piece; got \[2, 4\]"),
    (dict(mixed_chunk_buckets=[4, 2, 8]), "mixed_chunk_buckets must be strictly increasing"),
    (dict(mixed_chunk_buckets=[4, 16]), r"mixed_chunk_buckets has bucket 16 > prefill_chunk_size"),
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


# Which kernel a chunk's attention runs on: the paged one up to PAGED_CHUNK_MAX_TOKENS (the
# default, 64, holds these chunks of 8), else chunk_attention over the gathered cache.
CHUNK_KERNELS = {64: "nxdi::paged_decode_attention", 4: "nxdi::chunk_attention"}


def test_a_short_piece_alone_runs_in_the_smallest_chunk_model(tiny_llama_ckpt, tmp_path,
                                                              compile_cache_dir, hf_logits):
    """mixed_chunk_buckets [4, 8] also gives a chunked-prefill sub-model per length: a piece of
    1-4 tokens with nothing beside it (a cached prefix's remainder) runs in the 4-token one, 5-8
    in the 8-token one, with transformers' logits either way."""
    config = chunk_config(mixed_chunk_buckets=[4, CHUNK])
    model = NeuronLlamaForCausalLM(tiny_llama_ckpt, neuron_config=config)
    model.compile(tmp_path / "model")
    model.load(tmp_path / "model")
    artifacts = json.loads((tmp_path / "model" / MANIFEST).read_text())["artifacts"]
    assert sorted(artifacts[CHUNKED_PREFILL_MODEL_TAG + "_4"]) == ["1x32", "1x64"]
    assert (model.chunk_models[4].queries, model.chunked_prefill_model.queries) == (4, CHUNK)
    used = record_sizes(model.chunk_models)
    for n, size in ((27, 4), (28, 4), (29, CHUNK)):
        ids = prompt(n)
        model.reset_kv_cache()
        logits = encode_in_pieces(model, ids, 24, chunk=CHUNK)[0]  # one piece: 24..n-1
        assert used[-1] == size
        assert (logits - hf_logits(ids)).abs().max() < 1e-4


@pytest.mark.parametrize("paged_max", sorted(CHUNK_KERNELS))
def test_bf16_chunks_run_the_chunk_kernel_and_match_one_pass(wide_heads_ckpt, tmp_path,
                                                             compile_cache_dir, monkeypatch,
                                                             paged_max):
    """bfloat16 with the fused ops: the compiled chunk graph calls the paged kernel for a short
    chunk and nxdi::chunk_attention for a long one, and either way the pieces give one
    context-encoding pass's logits to bfloat16 rounding, and its argmax."""
    monkeypatch.setattr(attention, "PAGED_CHUNK_MAX_TOKENS", paged_max)
    config = dict(torch_dtype=torch.bfloat16, cpu_fused_ops="fused")
    model = NeuronLlamaForCausalLM(wide_heads_ckpt, neuron_config=chunk_config(**config))
    model.compile(tmp_path / "model")
    model.load(tmp_path / "model")
    graph = str(next(iter(model.chunked_prefill_model.runnables.values())).inlined_graph)
    assert [op in graph for op in CHUNK_KERNELS.values()] == [
        op == CHUNK_KERNELS[paged_max] for op in CHUNK_KERNELS.values()]
    for n, first in ((29, 8), (61, 32)):
        ids = prompt(n)
        model.reset_kv_cache()
        whole = run_piece(model, ids, 0)[0]
        model.reset_kv_cache()
        pieces = encode_in_pieces(model, ids, first)[0]
        assert pieces.argmax() == whole.argmax()
        torch.testing.assert_close(pieces, whole, rtol=0, atol=0.05 * whole.abs().max().item())


# ---- forward_mixed: a chunk and a decode step in one call -------------------------------------

# Two decoding sequences beside the chunked one, each with its own scattered blocks.
ROW_TABLES = [[21, 3, 9, 23], [12, 1, 18, 6]]
ROW_PROMPTS = [13, 20]


def row_slots(row: int, start: int, end: int) -> list[int]:
    table = ROW_TABLES[row]
    return [table[p // BS] * BS + p % BS for p in range(start, end)]


def start_rows(model) -> list[list[int]]:
    """Context-encode the two decoding rows' prompts (seq_ids 1, 2); their token ids."""
    prompts = []
    for row, n in enumerate(ROW_PROMPTS):
        ids = [(i * 53 + 7 * row + 3) % 256 for i in range(n)]
        model(torch.tensor([ids]), seq_ids=torch.tensor([row + 1]),
              position_ids=torch.arange(n).unsqueeze(0), slot_mapping=torch.tensor([row_slots(row, 0, n)]),
              block_table=torch.tensor([ROW_TABLES[row]]))
        prompts.append(ids)
    return prompts


def step_args(tokens: list[int]) -> dict:
    """forward() arguments of one decode step of both rows, each at the position after its prompt."""
    return dict(input_ids=torch.tensor([[t] for t in tokens]), seq_ids=torch.tensor([1, 2]),
                position_ids=torch.tensor([[n] for n in ROW_PROMPTS]),
                slot_mapping=torch.tensor([row_slots(r, n, n + 1) for r, n in enumerate(ROW_PROMPTS)]),
                block_table=torch.tensor(ROW_TABLES))


def piece_args(ids: list[int], start: int) -> dict:
    end = start + len(ids)
    return dict(input_ids=torch.tensor([ids]), seq_ids=torch.tensor([0]),
                position_ids=torch.arange(start, end).unsqueeze(0),
                slot_mapping=torch.tensor([slots(start, end)]), block_table=torch.tensor([TABLE]))


def mixed_vs_apart(model, n: int, first: int):
    """The chunk ids[first:n] and a step of the two rows, once apart (forward twice) and once in
    one forward_mixed call from the same cache: ((chunk, rows) logits and cache) for each."""
    ids = prompt(n)
    model.reset_kv_cache()
    prompts = start_rows(model)
    run_piece(model, ids[:first], 0)
    before = model.kv_cache.clone()
    chunk, step = piece_args(ids[first:n], first), step_args([prompts[0][-1], prompts[1][0]])
    apart = (model(**chunk).logits, model(**step).logits)
    apart_cache = model.kv_cache.clone()
    model.kv_cache.copy_(before)
    out = model.forward_mixed(chunk=chunk, decode=step).logits
    return (apart, apart_cache), ((out[:1], out[1:]), model.kv_cache.clone()), prompts


@pytest.mark.parametrize("kernel", ["paged", "sdpa"])
@pytest.mark.parametrize("n, first", [(16, 8), (11, 8), (40, 32)])
def test_a_mixed_call_gives_the_logits_and_cache_of_the_two_calls(tiny_llama_ckpt, hf_logits,
                                                                  kernel, n, first):
    """Two decode rows (batch bucket 2) beside a chunk, full (16) or short (11: 3 tokens padded
    to 8, which must write only to scratch): the same logits as the chunk call and the step call
    apart, transformers' logits, and the same cache."""
    model = NeuronLlamaForCausalLM(tiny_llama_ckpt,
                                   neuron_config=chunk_config(batch_size=4,
                                                              cpu_attention_kernel=kernel))
    model.to_cpu()
    (apart, apart_cache), (mixed, mixed_cache), prompts = mixed_vs_apart(model, n, first)
    assert (mixed[0] - apart[0]).abs().max() < 1e-5
    assert (mixed[1] - apart[1]).abs().max() < 1e-5
    assert (mixed_cache - apart_cache).abs().max() < 1e-6
    assert (mixed[0][0] - hf_logits(prompt(n))).abs().max() < 1e-4
    nexts = [prompts[0][-1], prompts[1][0]]
    for row in range(2):
        expected = hf_logits(prompts[row] + [nexts[row]])
        assert (mixed[1][row] - expected).abs().max() < 1e-4


def test_compiled_mixed_calls_equal_eager_and_pad_the_decode_batch(tiny_llama_ckpt, tmp_path,
                                                                   compile_cache_dir):
    """batch_size 4: buckets 1, 2 and 4 decode rows by 32 and 64 positions; one decode row pads
    to no bucket, three pad to 4 (the padded rows touch no live block)."""
    config = chunk_config(batch_size=4)
    eager = NeuronLlamaForCausalLM(tiny_llama_ckpt, neuron_config=config)
    eager.to_cpu()
    compiled = NeuronLlamaForCausalLM(tiny_llama_ckpt, neuron_config=chunk_config(batch_size=4))
    compiled.compile(tmp_path / "model")
    compiled.load(tmp_path / "model")
    artifacts = json.loads((tmp_path / "model" / MANIFEST).read_text())["artifacts"]
    assert sorted(artifacts[MIXED_MODEL_TAG]) == ["1x32", "1x64", "2x32", "2x64", "4x32", "4x64"]
    results = [mixed_vs_apart(model, 29, 24) for model in (eager, compiled)]
    (_, _), (eager_mixed, eager_cache), _ = results[0]
    (apart, apart_cache), (mixed, cache), _ = results[1]
    for got in (mixed, apart):
        assert (got[0] - eager_mixed[0]).abs().max() < 1e-5
        assert (got[1] - eager_mixed[1]).abs().max() < 1e-5
    assert (cache - eager_cache).abs().max() < 1e-6
    # three decode rows (bucket 4): the third a copy of row 1 in blocks of its own
    compiled.reset_kv_cache()
    prompts = start_rows(compiled)
    compiled.kv_cache[:, :, [16, 19]] = compiled.kv_cache[:, :, [21, 3]]  # row 1's first blocks
    step = step_args([prompts[0][-1], prompts[1][0]])
    alone = compiled(**step).logits
    step3 = dict(input_ids=torch.cat([step["input_ids"], step["input_ids"][:1]]),
                 seq_ids=torch.tensor([1, 2, 3]),
                 position_ids=torch.cat([step["position_ids"], step["position_ids"][:1]]),
                 slot_mapping=torch.cat([step["slot_mapping"], torch.tensor([[19 * BS + 5]])]),
                 block_table=torch.cat([step["block_table"], torch.tensor([[16, 19, 10, 13]])]))
    ids = prompt(12)
    run_piece(compiled, ids[:8], 0)
    out = compiled.forward_mixed(chunk=piece_args(ids[8:], 8), decode=step3).logits
    assert out.shape[0] == 4
    assert (out[1:3] - alone).abs().max() < 1e-5
    assert (out[3] - alone[0]).abs().max() < 1e-5


def test_a_short_piece_runs_in_the_smallest_mixed_chunk_that_holds_it(tiny_llama_ckpt, tmp_path,
                                                                     compile_cache_dir):
    """mixed_chunk_buckets [4, 8]: one compiled mixed sub-model per chunk length, each with every
    (decode rows, length) bucket; a piece of 3 or 4 tokens runs in the 4-token one, 5 in the
    8-token one, each with the logits and cache of the chunk and the step apart."""
    config = chunk_config(batch_size=4, mixed_chunk_buckets=[4, CHUNK])
    model = NeuronLlamaForCausalLM(tiny_llama_ckpt, neuron_config=config)
    model.compile(tmp_path / "model")
    model.load(tmp_path / "model")
    artifacts = json.loads((tmp_path / "model" / MANIFEST).read_text())["artifacts"]
    buckets = ["1x32", "1x64", "2x32", "2x64", "4x32", "4x64"]
    assert sorted(artifacts[MIXED_MODEL_TAG]) == sorted(artifacts[MIXED_MODEL_TAG + "_4"]) == buckets
    assert (model.mixed_models[4].queries, model.mixed_model.queries) == (4, CHUNK)
    used = record_sizes(model.mixed_models)
    live = [b for b in range(config.pa_num_blocks) if b != model.scratch[1]]
    for n, size in ((27, 4), (28, 4), (29, CHUNK)):
        (apart, apart_cache), (mixed, cache), _ = mixed_vs_apart(model, n, 24)
        assert used[-1] == size
        assert (mixed[0] - apart[0]).abs().max() < 1e-5
        assert (mixed[1] - apart[1]).abs().max() < 1e-5
        # (padding writes to the scratch block, as many as each call pads)
        assert (cache[:, :, live] - apart_cache[:, :, live]).abs().max() < 1e-6


@pytest.mark.parametrize("paged_max", sorted(CHUNK_KERNELS))
def test_bf16_mixed_calls_run_both_kernels(wide_heads_ckpt, tmp_path, compile_cache_dir,
                                           monkeypatch, paged_max):
    """As the decode worker runs it (bfloat16, fused ops, paged kernel, compiled): the graph calls
    paged_decode_attention for the decode rows and, for the chunk, the kernel its length
    chooses, and matches the two calls apart."""
    monkeypatch.setattr(attention, "PAGED_CHUNK_MAX_TOKENS", paged_max)
    config = dict(torch_dtype=torch.bfloat16, cpu_fused_ops="fused")
    model = NeuronLlamaForCausalLM(wide_heads_ckpt,
                                   neuron_config=chunk_config(batch_size=4, **config))
    model.compile(tmp_path / "model")
    model.load(tmp_path / "model")
    graph = str(next(iter(model.mixed_model.runnables.values())).inlined_graph)
    assert "nxdi::paged_decode_attention" in graph
    assert ("nxdi::chunk_attention" in graph) == (paged_max < CHUNK)
    (apart, apart_cache), (mixed, mixed_cache), _ = mixed_vs_apart(model, 40, 32)
    for got, want in zip(mixed, apart):
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        torch.testing.assert_close(got, want, rtol=0, atol=0.02 * want.abs().max().item())
    torch.testing.assert_close(mixed_cache.float(), apart_cache.float(), rtol=0, atol=0.02)


def test_bad_mixed_calls_are_refused(tiny_llama_ckpt):
    model = NeuronLlamaForCausalLM(tiny_llama_ckpt, neuron_config=chunk_config(batch_size=4))
    model.to_cpu()
    prompts = start_rows(model)
    run_piece(model, prompt(8), 0)
    step = step_args([prompts[0][-1], prompts[1][0]])
    with pytest.raises(ValueError, match=r"S <= prefill_chunk_size \(8\)"):
        model.forward_mixed(chunk=piece_args(prompt(9), 8), decode=step)
    with pytest.raises(ValueError, match=r"one new token per sequence \(input_ids \[B, 1\]\)"):
        model.forward_mixed(chunk=piece_args(prompt(4), 8), decode=piece_args(prompt(2), 20))
    with pytest.raises(ValueError, match="position_ids is required for the chunk"):
        model.forward_mixed(chunk=dict(input_ids=torch.tensor([prompt(4)])), decode=step)
    with pytest.raises(ValueError, match=r"unsupported arguments \['attention_mask'\]"):
        model.forward_mixed(chunk=piece_args(prompt(4), 8),
                            decode=dict(step, attention_mask=torch.ones(2, 1)))
    plain = NeuronLlamaForCausalLM(tiny_llama_ckpt,
                                   neuron_config=chunk_config(batch_size=4,
                                                              prefill_chunk_size=None))
    plain.to_cpu()
    with pytest.raises(ValueError, match="forward_mixed needs NeuronConfig.prefill_chunk_size"):
        plain.forward_mixed(chunk=piece_args(prompt(4), 8), decode=step)
