"""End-to-end truth on the bundled SmolLM2-135M-Instruct: greedy continuations through nxdi_common's
compiled CPU backend equal transformers' generate() token for token (fp32)."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nxdi_common.config import NeuronConfig
from nxdi_common.generation import HuggingFaceGenerationAdapter
from nxdi_common.models.llama import NeuronLlamaForCausalLM

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a CPU does.",
    "List three colours of the rainbow.",
    "Who wrote Romeo and Juliet?",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def tokenizer(bundled_model_path):
    return AutoTokenizer.from_pretrained(str(bundled_model_path))


def chat_ids(tokenizer, prompt):
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def reference(bundled_model_path, tokenizer):
    """transformers' greedy continuation of each prompt (fp32)."""
    hf = AutoModelForCausalLM.from_pretrained(str(bundled_model_path), dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = chat_ids(tokenizer, prompt)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.eos_token_id)
            outs.append(out[0, ids.shape[1]:].tolist())
    return outs


@pytest.fixture(scope="module")
def compiled_model(bundled_model_path, tmp_path_factory):
    nc = NeuronConfig(batch_size=1, seq_len=128, torch_dtype=torch.float32, enable_bucketing=True,
                      context_encoding_buckets=[32, 64], token_generation_buckets=[64, 128])
    model = NeuronLlamaForCausalLM(str(bundled_model_path), neuron_config=nc)
    out = tmp_path_factory.mktemp("smollm2") / "compiled"
    model.compile(str(out))
    model.load(str(out))
    return model


def _trim_after_eos(tokens, eos_ids):
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[:i + 1]
    return tokens


def test_greedy_matches_transformers_token_for_token(compiled_model, tokenizer, reference):
    adapter = HuggingFaceGenerationAdapter(compiled_model)
    eos = adapter.generation_config.eos_token_id
    eos_ids = set([eos] if isinstance(eos, int) else eos)
    for prompt, expected in zip(PROMPTS, reference):
        ids = chat_ids(tokenizer, prompt)
        out = adapter.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=NEW_TOKENS)
        got = _trim_after_eos(out[0, ids.shape[1]:].tolist(), eos_ids)
        assert got == _trim_after_eos(expected, eos_ids), prompt
        assert len(got) >= 8, f"suspiciously short continuation for {prompt!r}"
