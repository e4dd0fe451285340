"""Worker model options that shape the compiled graphs: --context-buckets (explicit prompt-length
buckets for context encoding) from the command line to the model's CTE sub-model, with bad lists
refused naming the option; a worker's --nice."""
import argparse

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from nxdi_common.serving import worker
from nxdi_common.serving.launcher import LaunchSpec, model_args


def _parse(*argv):
    p = argparse.ArgumentParser()
    worker.add_model_args(p)
    return worker.model_options_from_args(p.parse_args(list(argv)))


def test_context_buckets_reach_the_context_encoding_model(tmp_path):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                      max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "ckpt")
    opts = _parse("--model", str(tmp_path / "ckpt"), "--dtype", "float32", "--max-model-len", "96",
                  "--backend", "eager", "--context-buckets", "16,48,96")
    assert opts.context_buckets == (16, 48, 96)
    model = worker.load_model(opts, worker.prefill_neuron_config(opts, 2, 1))
    assert model.context_encoding_model.length_buckets == [16, 48, 96]
    out = model.forward(torch.randint(0, 64, (1, 40)))  # 40 tokens run in the 48 bucket
    assert out.tokens.shape == (1,)


def test_default_context_buckets_start_at_32_and_are_quartered_past_1024():
    opts = worker.ModelOptions(max_model_len=2048)
    nc = worker.decode_neuron_config(opts, 4, 64, 16)
    assert nc.context_encoding_buckets == [32, 64, 128, 256, 512, 1024, 1280, 1536, 1792, 2048]
    small = worker.prefill_neuron_config(worker.ModelOptions(max_model_len=96), 2, 1)
    assert small.context_encoding_buckets == [32, 64, 96]


def test_prefill_workers_default_to_denser_context_buckets():
    opts = worker.ModelOptions(max_model_len=2048)
    assert worker.prefill_neuron_config(opts, 4, 4).context_encoding_buckets == [
        32, 64, 128, 192, 256, 384, 512, 768, 1024, 1152, 1280, 1408, 1536, 1664, 1792, 1920, 2048]
    given = worker.ModelOptions(max_model_len=2048, context_buckets=(512, 2048))
    assert worker.prefill_neuron_config(given, 4, 4).context_encoding_buckets == [512, 2048]


def test_prefill_pieces_only_where_a_prompt_can_be_longer_than_one():
    opts = worker.ModelOptions(max_model_len=2048)
    assert worker.decode_neuron_config(opts, 4, 64, 16, 256).prefill_chunk_size == 256
    assert worker.decode_neuron_config(opts, 4, 64, 16, 0).prefill_chunk_size is None
    short = worker.ModelOptions(max_model_len=128)  # the default 256 would not fit seq_len
    assert worker.decode_neuron_config(short, 4, 64, 16, 256).prefill_chunk_size is None


def test_bad_context_buckets_name_the_option():
    with pytest.raises(ValueError, match="context_buckets must end at max_model_len"):
        worker.ModelOptions(max_model_len=512, context_buckets=(128, 256))
    with pytest.raises(ValueError, match="context_buckets must be strictly increasing"):
        worker.ModelOptions(max_model_len=512, context_buckets=(256, 128, 512))
    with pytest.raises(SystemExit):
        _parse("--context-buckets", "128,abc")


def test_launcher_passes_context_buckets_and_quantize_to_every_service():
    spec = LaunchSpec(max_model_len=512, context_buckets=(128, 384, 512), quantize="int8")
    args = model_args(spec, threads=1)
    assert args[args.index("--context-buckets") + 1] == "128,384,512"
    assert args[args.index("--quantize") + 1] == "int8"


def test_attention_kernel_option_shapes_the_decode_config():
    """paged (auto where the kernel builds): one TKG length bucket, since a step costs the same
    in any; sdpa: the length buckets that split_by_length chooses among."""
    paged = worker.decode_neuron_config(_parse("--attention-kernel", "paged"), 4, 64, 16)
    assert paged.cpu_attention_kernel == "paged" and paged.token_generation_buckets == [2048]
    auto = worker.decode_neuron_config(worker.ModelOptions(), 4, 64, 16)
    assert auto.token_generation_buckets == [2048]
    sdpa = worker.decode_neuron_config(_parse("--attention-kernel", "sdpa"), 4, 64, 16)
    assert sdpa.cpu_attention_kernel == "sdpa" and sdpa.token_generation_buckets is None
    with pytest.raises(ValueError, match="attention_kernel must be one of"):
        worker.ModelOptions(attention_kernel="fast")
    spec = LaunchSpec(attention_kernel="sdpa")
    args = model_args(spec, threads=1)
    assert args[args.index("--attention-kernel") + 1] == "sdpa"
    assert "--attention-kernel" not in model_args(LaunchSpec(), threads=1)


def test_kv_cache_dtype_option_reaches_both_workers_and_the_launcher():
    """--kv-cache-dtype fp8 turns on the float8_e4m3fn KV cache (kv_cache_quant) of prefill and
    decode workers alike; the launcher passes it to every service; a bad value names the field."""
    fp8 = _parse("--kv-cache-dtype", "fp8")
    assert worker.decode_neuron_config(fp8, 4, 64, 16).kv_cache_quant
    assert worker.prefill_neuron_config(fp8, 2, 1).kv_cache_quant
    assert not worker.decode_neuron_config(_parse(), 4, 64, 16).kv_cache_quant
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        worker.ModelOptions(kv_cache_dtype="int4")
    args = model_args(LaunchSpec(kv_cache_dtype="fp8"), threads=1)
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8"
    assert "--kv-cache-dtype" not in model_args(LaunchSpec(), threads=1)


def test_prefill_workers_pack_bf16_weights_for_onednn(monkeypatch, tmp_path):
    """A prefill worker only encodes prompts, where oneDNN's packed weights beat the panels that
    "auto" picks for models that also decode: its bfloat16 weights go to oneDNN wherever oneDNN
    packs bfloat16, and its compiled model uses them; float32, int8 and CPUs where oneDNN cannot
    keep "auto", and so does every decode worker. So do CPUs where our panels multiply on
    float32 FMAs without AMX (Intel Xeons listing no AMX), where they encode faster than oneDNN;
    with AMX tiles oneDNN is kept."""
    from nxdi_common import kernels
    from nxdi_common.modules import linear
    monkeypatch.setattr(linear, "onednn_unavailable_reason", lambda dtype: None)
    monkeypatch.setattr(kernels, "panel_fma_rows", lambda: 0)
    bf16 = worker.ModelOptions(max_model_len=96)
    assert worker.prefill_neuron_config(bf16, 2, 1).cpu_weight_layout == "onednn"
    assert worker.decode_neuron_config(bf16, 4, 64, 16).cpu_weight_layout == "auto"
    for opts in (worker.ModelOptions(max_model_len=96, dtype="float32"),
                 worker.ModelOptions(max_model_len=96, quantize="int8")):
        assert worker.prefill_neuron_config(opts, 2, 1).cpu_weight_layout == "auto"
    monkeypatch.setattr(kernels, "panel_fma_rows", lambda: 4)
    monkeypatch.setattr(kernels, "panel_amx_tiles", lambda: False)
    assert worker.prefill_neuron_config(bf16, 2, 1).cpu_weight_layout == "auto"
    monkeypatch.setattr(kernels, "panel_amx_tiles", lambda: True)
    assert worker.prefill_neuron_config(bf16, 2, 1).cpu_weight_layout == "onednn"
    monkeypatch.setattr(linear, "onednn_unavailable_reason", lambda dtype: "no oneDNN here")
    assert worker.prefill_neuron_config(bf16, 2, 1).cpu_weight_layout == "auto"
    monkeypatch.undo()

    if linear.onednn_unavailable_reason(torch.bfloat16) is not None:
        pytest.skip("oneDNN cannot pack bfloat16 weights on this CPU")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                      max_position_embeddings=256)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "ckpt")
    opts = worker.ModelOptions(model=str(tmp_path / "ckpt"), max_model_len=64,
                               compiled_root=str(tmp_path / "compiled"))
    fma_panels = kernels.panel_fma_rows() > 0 and not kernels.panel_amx_tiles()
    model = worker.load_model(opts, worker.prefill_neuron_config(opts, 2, 1))
    assert model.weight_layout == ("panels" if fma_panels else "onednn")
    ids = torch.randint(0, 128, (1, 20))
    ref = LlamaForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(ids).logits[0, -1]
    got = model.forward(ids).logits.reshape(-1, 128)[-1].float()
    assert torch.allclose(got, expected, atol=0.05, rtol=0.05), (got - expected).abs().max()


def test_workers_started_together_compile_a_configuration_once(tmp_path, compile_cache_dir):
    """While another process holds the configuration's compile lock (it is compiling it),
    load_model waits instead of compiling the same folder beside it; once the folder is
    complete it loads it without compiling (the folder is not replaced)."""
    import threading
    import time
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                      max_position_embeddings=128)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "ckpt")
    opts = worker.ModelOptions(model=str(tmp_path / "ckpt"), dtype="float32", max_model_len=64,
                               compiled_root=str(tmp_path / "compiled"))
    first = worker.load_model(opts, worker.prefill_neuron_config(opts, 2, 1))
    (folder,) = [p for p in (tmp_path / "compiled").iterdir() if p.is_dir()]
    manifest = folder / "nxdi_manifest.json"
    stamp = manifest.stat().st_mtime_ns
    manifest.rename(folder / "held")  # as if another worker were still compiling it
    loaded = []
    with worker.compile_lock(folder):
        waiting = threading.Thread(target=lambda: loaded.append(
            worker.load_model(opts, worker.prefill_neuron_config(opts, 2, 1))))
        waiting.start()
        time.sleep(1.0)
        assert waiting.is_alive() and not loaded  # waits for the lock, compiles nothing
        assert not any(p.name.startswith(f".{folder.name}.tmp") for p in folder.parent.iterdir())
        (folder / "held").rename(manifest)  # the other worker finished
    waiting.join(60)
    assert loaded and manifest.stat().st_mtime_ns == stamp  # loaded, not compiled again
    ids = torch.randint(0, 64, (1, 12))
    assert torch.equal(loaded[0].forward(ids).tokens, first.forward(ids).tokens)


def test_nice_takes_0_to_19_and_refuses_the_rest_by_name(capsys):
    """--nice (both workers): an integer from 0 to 19, unset by default; anything else is
    refused naming the option and the range. (A worker started with it: test_background_prefill,
    every thread of the process at that value.)"""
    p = argparse.ArgumentParser()
    worker.add_server_args(p)
    assert p.parse_args([]).nice is None
    assert p.parse_args(["--nice", "0"]).nice == 0 and p.parse_args(["--nice", "19"]).nice == 19
    for bad in ("20", "-1", "low", "2.5"):
        with pytest.raises(SystemExit):
            p.parse_args(["--nice", bad])
        assert "--nice must be an integer in [0, 19]" in capsys.readouterr().err
    worker.apply_nice(None)  # unset: nothing changes (and nothing raised)
