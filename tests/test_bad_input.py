"""Bad input fails with an error that names the problem, writes nothing half-done, and leaves a
loaded model able to serve the next valid request exactly as before."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, LlamaConfig, LlamaForCausalLM

from nxdi_common.backends.compile_cache import CompileCache
from nxdi_common.checkpoint import CHECKPOINT_FILES
from nxdi_common.config import NeuronConfig
from nxdi_common.generation import HuggingFaceGenerationAdapter
from nxdi_common.models.llama.modeling_llama import NeuronLlamaForCausalLM

VOCAB, SEQ_LEN, BATCH = 256, 64, 2
CTE_BUCKETS, TKG_BUCKETS = [16, 32], [64]


def neuron_config(**overrides) -> NeuronConfig:
    kwargs = dict(batch_size=BATCH, seq_len=SEQ_LEN, torch_dtype=torch.float32,
                  enable_bucketing=True, context_encoding_buckets=CTE_BUCKETS,
                  token_generation_buckets=TKG_BUCKETS, backend="cpu")
    kwargs.update(overrides)
    return NeuronConfig(**kwargs)


def tiny_llama_config(**overrides) -> LlamaConfig:
    kwargs = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2, vocab_size=VOCAB)
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


PROMPT = (torch.arange(2 * 6).reshape(2, 6) * 31 + 7).remainder(VOCAB)


def valid_request(model, steps=3) -> torch.Tensor:
    """Logits of a fresh 2-row greedy generation (CTE then `steps` TKG calls)."""
    model.reset()
    logits = [model(PROMPT).logits]
    for _ in range(steps):
        logits.append(model(logits[-1].argmax(-1, keepdim=True)).logits)
    return torch.stack(logits)


pytestmark = pytest.mark.usefixtures("one_torch_thread", "compile_cache_dir")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt")
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["to_cpu", "compiled"])
def served(request, ckpt, tmp_path_factory):
    """(model, reference logits of valid_request) for an eager and a compiled+loaded model."""
    model = NeuronLlamaForCausalLM(ckpt, neuron_config=neuron_config())
    if request.param == "to_cpu":
        model.to_cpu()
    else:
        out = tmp_path_factory.mktemp("compiled") / "model"
        model.compile_cache = CompileCache(tmp_path_factory.mktemp("cache"))
        model.compile(out)
        model.load(out)
    return model, valid_request(model)


def _copy_checkpoint(ckpt: Path, dest: Path) -> Path:
    shutil.copytree(ckpt, dest)
    return dest


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


# ------------------------------------------------------------------ checkpoints and configs
def test_missing_checkpoint_dir(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        NeuronLlamaForCausalLM(missing, neuron_config=neuron_config())


def test_checkpoint_without_weights_lists_accepted_files(ckpt, tmp_path):
    path = tmp_path / "config-only"
    path.mkdir()
    shutil.copy(ckpt / "config.json", path / "config.json")
    (path / "weights.npz").write_bytes(b"not a checkpoint")
    model = NeuronLlamaForCausalLM(path, neuron_config=neuron_config())
    with pytest.raises(ValueError) as info:
        model.to_cpu()
    message = str(info.value)
    assert str(path) in message and "weights.npz" in message
    assert all(name in message for name in CHECKPOINT_FILES.values())

    parent = tmp_path / "outputs"
    parent.mkdir()
    with pytest.raises(ValueError, match="model.safetensors"):
        model.compile(parent / "model")
    assert list(parent.iterdir()) == []


@pytest.mark.parametrize("change, pattern", [
    (dict(intermediate_size=96), r"shape.*mlp\.gate_up_proj\.weight"),
    (dict(hidden_size=32, head_dim=8), r"shape"),
    (dict(num_hidden_layers=3), r"missing.*layers\.2\."),
    (dict(num_hidden_layers=1), r"unexpected.*layers\.1\."),
])
def test_checkpoint_not_matching_config(ckpt, tmp_path, change, pattern):
    path = _copy_checkpoint(ckpt, tmp_path / "model")
    _edit_config(path, **change)
    model = NeuronLlamaForCausalLM(path, neuron_config=neuron_config())
    with pytest.raises(ValueError, match=pattern):
        model.to_cpu()
    parent = tmp_path / "outputs"
    parent.mkdir()
    with pytest.raises(ValueError, match=pattern):
        model.compile(parent / "model")
    assert list(parent.iterdir()) == []


def test_checkpoint_with_extra_tensor(ckpt, tmp_path):
    path = _copy_checkpoint(ckpt, tmp_path / "model")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.extra_head.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected.*extra_head"):
        NeuronLlamaForCausalLM(path, neuron_config=neuron_config()).to_cpu()


def test_non_llama_model_type(tmp_path):
    GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model_type 'gpt2'.*Llama"):
        NeuronLlamaForCausalLM(tmp_path, neuron_config=neuron_config())


# ------------------------------------------------------------------ life cycle
def test_forward_before_load(ckpt, tmp_path):
    model = NeuronLlamaForCausalLM(ckpt, neuron_config=neuron_config())
    with pytest.raises(RuntimeError, match=r"to_cpu\(\).*load\(\)"):
        model(PROMPT)
    model.compile(tmp_path / "model")  # compiled but not loaded yet
    with pytest.raises(RuntimeError, match="not loaded"):
        model(PROMPT)
    model.load(tmp_path / "model")
    assert model(PROMPT).logits.shape == (BATCH, VOCAB)


# ------------------------------------------------------------------ requests
def _long_prompt():
    return torch.ones(BATCH, 40, dtype=torch.long)


def _ids_out_of_vocab():
    return PROMPT.clone().index_fill_(1, torch.tensor([2]), VOCAB)


CONTEXT_FAILURES = {
    "prompt longer than the largest bucket": (
        lambda m: m(_long_prompt()), r"prompt length 40.*largest bucket 32"),
    "attention_mask row of zeros": (
        lambda m: m(PROMPT, attention_mask=torch.tensor([[1] * 6, [0] * 6])), r"attention_mask"),
    "seq_ids out of range": (
        lambda m: m(PROMPT, seq_ids=torch.tensor([0, BATCH])), r"seq_ids.*\[0, 2\)"),
    "negative seq_ids": (
        lambda m: m(PROMPT, seq_ids=torch.tensor([-1, 0])), r"seq_ids"),
    "duplicate seq_ids": (
        lambda m: m(PROMPT, seq_ids=torch.tensor([1, 1])), r"seq_ids.*distinct"),
    "seq_ids of the wrong length": (
        lambda m: m(PROMPT, seq_ids=torch.tensor([0])), r"seq_ids"),
    "token id >= vocab_size": (
        lambda m: m(_ids_out_of_vocab()), rf"token id {VOCAB}.*vocab_size"),
    "negative token id": (
        lambda m: m(PROMPT - 100), r"token id -\d+.*vocab_size"),
    "1-D input_ids": (
        lambda m: m(PROMPT[0]), r"input_ids must be a \[batch, seq\]"),
}


@pytest.mark.parametrize("case", list(CONTEXT_FAILURES))
def test_bad_context_request(served, case):
    model, reference = served
    call, pattern = CONTEXT_FAILURES[case]
    model.reset()
    with pytest.raises(ValueError, match=pattern):
        call(model)
    assert torch.equal(valid_request(model), reference)


TOKEN_GEN_FAILURES = {
    "position past seq_len": (
        lambda m, nxt: m(nxt, position_ids=torch.full((BATCH, 1), SEQ_LEN)),
        rf"position {SEQ_LEN} is past seq_len {SEQ_LEN}"),
    "two tokens per sequence": (
        lambda m, nxt: m(torch.cat([nxt, nxt], 1), position_ids=torch.full((BATCH, 2), 6)),
        r"one new token"),
    "seq_ids out of range": (
        lambda m, nxt: m(nxt, seq_ids=torch.tensor([0, 5])), r"seq_ids"),
    "token id >= vocab_size": (
        lambda m, nxt: m(torch.full_like(nxt, VOCAB + 1)), rf"token id {VOCAB + 1}"),
    "negative position": (
        lambda m, nxt: m(nxt, position_ids=torch.tensor([[7], [-3]])),
        r"position_ids must be >= 0, got -3"),
    "1-D position_ids": (
        lambda m, nxt: m(nxt, position_ids=torch.tensor([7, 7])),
        r"position_ids must be \[batch, seq\].*\[2\]"),
}


@pytest.mark.parametrize("case", list(TOKEN_GEN_FAILURES))
def test_bad_token_generation_request_mid_sequence(served, case):
    """A rejected TKG call between two valid steps changes nothing: the sequence continues
    exactly as if the bad call had never been made."""
    model, reference = served
    call, pattern = TOKEN_GEN_FAILURES[case]
    model.reset()
    logits = [model(PROMPT).logits]
    logits.append(model(logits[-1].argmax(-1, keepdim=True)).logits)
    with pytest.raises(ValueError, match=pattern):
        call(model, logits[-1].argmax(-1, keepdim=True))
    for _ in range(2):
        logits.append(model(logits[-1].argmax(-1, keepdim=True)).logits)
    assert torch.equal(torch.stack(logits), reference)


def test_generation_past_seq_len(served):
    model, reference = served
    model.reset()
    prompt = torch.ones(BATCH, 30, dtype=torch.long)
    nxt = model(prompt).logits.argmax(-1, keepdim=True)
    for _ in range(SEQ_LEN - 30):  # positions 30 .. seq_len-1
        nxt = model(nxt).logits.argmax(-1, keepdim=True)
    with pytest.raises(ValueError, match=rf"position {SEQ_LEN} is past seq_len {SEQ_LEN}.*full"):
        model(nxt)
    assert torch.equal(valid_request(model), reference)


def test_generate_with_wrong_number_of_prompts(served):
    model, reference = served
    adapter = HuggingFaceGenerationAdapter(model)
    for rows in (1, BATCH + 1):
        with pytest.raises(ValueError, match=rf"got {rows} prompts.*batch_size is {BATCH}"):
            adapter.generate(PROMPT[:1].repeat(rows, 1), max_new_tokens=2)
    generated = adapter.generate(PROMPT, max_new_tokens=3)
    assert generated.shape == (BATCH, PROMPT.shape[1] + 3)
    assert torch.equal(generated[:, PROMPT.shape[1]], reference[0].argmax(-1))
    assert torch.equal(valid_request(model), reference)


def test_next_positions_follow_the_calls(served):
    """Each cache row's next position (kept in Python, read without a tensor op): the prompt's
    length after context encoding, one more after each step; a step without position_ids runs
    there, and next_positions hands out a copy."""
    model, reference = served
    model.reset()
    lengths = torch.tensor([6, 4])
    mask = (torch.arange(6) < lengths[:, None]).long()
    nxt = model(PROMPT, attention_mask=mask).logits.argmax(-1, keepdim=True)
    assert model.next_positions.tolist()[:BATCH] == [6, 4]
    model.next_positions.fill_(50)  # a copy: the model's own positions stay
    explicit = model(nxt, position_ids=lengths[:, None]).logits
    assert model.next_positions.tolist()[:BATCH] == [7, 5]
    model(nxt[1:], seq_ids=torch.tensor([1]), position_ids=torch.tensor([[5]]))
    assert model.next_positions.tolist()[:BATCH] == [7, 6]
    model.reset()
    assert model.next_positions.tolist() == [0] * model.neuron_config.max_batch_size
    model(PROMPT, attention_mask=mask)
    assert torch.equal(model(nxt).logits, explicit)  # default positions: 6 and 4 again
    assert torch.equal(valid_request(model), reference)
