"""nxdi-generate end to end on a tiny random model with the bundled tokenizer: it prints a
continuation, and a changed configuration compiles into its own folder instead of failing on a
stale one."""
import shutil

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from nxdi_common import cli

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def test_generate_twice_with_different_configs(bundled_model_path, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NXDI_COMPILE_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model_dir = tmp_path / "tiny"
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                 num_key_value_heads=2, num_hidden_layers=1,
                                 vocab_size=49152)).save_pretrained(model_dir)
    for name in TOKENIZER_FILES:
        shutil.copy(bundled_model_path / name, model_dir / name)
    root = tmp_path / "compiled"
    for dtype in ("float32", "bfloat16"):
        args = ["Hello", "--model", str(model_dir), "--compiled-root", str(root), "--dtype", dtype,
                "--max-new-tokens", "4", "--seq-len", "128"]
        assert cli.main(args) == 0
        assert capsys.readouterr().out.strip(), "no text printed"
    assert len([p for p in root.iterdir() if (p / "nxdi_manifest.json").is_file()]) == 2
