"""Weight quantization (int8, per tensor and per channel): the quantizer, which modules it converts,
the quantized checkpoint (safetensors folder and pickle file), and fidelity: a quantized model's
logits equal transformers' logits for the same model with the dequantized weights (fp32, eager and
compiled), so the int8 path computes exactly weight = int8 * scale."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from nxdi_common.checkpoint import save_state_dict
from nxdi_common.config import NeuronConfig, load_pretrained_config
from nxdi_common.models.llama import LlamaInferenceConfig, NeuronLlamaForCausalLM
from nxdi_common.modules.quantization import (QuantizedLinear, dequantize, is_excluded,
                                              quantize_state_dict, quantize_tensor)

VOCAB, STEPS = 256, 6


@pytest.fixture(autouse=True)
def private_compile_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NXDI_COMPILE_CACHE", str(tmp_path / "compile-cache"))


@pytest.mark.parametrize("qtype", ["per_tensor_symmetric", "per_channel_symmetric"])
def test_quantize_tensor_round_trip(qtype):
    torch.manual_seed(0)
    w = torch.randn(48, 32) * torch.linspace(0.1, 3.0, 48).unsqueeze(1)  # rows of different range
    w[5] = 0.0  # an all-zero row must not divide by zero
    q, scale = quantize_tensor(w, qtype)
    assert q.dtype == torch.int8 and q.shape == w.shape and int(q.abs().max()) <= 127
    expected_scale = (w.abs().max().reshape(1) if qtype == "per_tensor_symmetric"
                      else w.abs().amax(1)) / 127
    torch.testing.assert_close(scale.clamp(min=1e-30), expected_scale.clamp(min=1e-30))
    err = (dequantize(q, scale) - w).abs()
    half_step = (scale if scale.numel() == 1 else scale.unsqueeze(1)) / 2
    assert torch.all(err <= half_step + 1e-6)
    assert int(q.abs().max()) == 127  # the range is used fully
    assert torch.all(q[5] == 0)


def test_quantize_tensor_rejects_unknown_type():
    with pytest.raises(ValueError, match="quantization_type"):
        quantize_tensor(torch.ones(2, 2), "per_block")


def _hf_state_dict(layers: int = 2) -> dict:
    sd = {"model.embed_tokens.weight": torch.randn(VOCAB, 64), "model.norm.weight": torch.ones(64)}
    for i in range(layers):
        for proj, shape in (("self_attn.q_proj", (64, 64)), ("self_attn.k_proj", (32, 64)),
                            ("self_attn.v_proj", (32, 64)), ("self_attn.o_proj", (64, 64)),
                            ("mlp.gate_proj", (128, 64)), ("mlp.up_proj", (128, 64)),
                            ("mlp.down_proj", (64, 128))):
            sd[f"model.layers.{i}.{proj}.weight"] = torch.randn(shape)
        sd[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(64)
    return sd


def test_quantize_state_dict_converts_projections_and_head_not_norms_or_embeddings():
    nc = NeuronConfig(quantized=True, quantized_checkpoints_path="unused",
                      quantization_type="per_channel_symmetric")
    out = quantize_state_dict(_hf_state_dict(), nc, tie_word_embeddings=True)
    assert out["lm_head.weight"].dtype == torch.int8  # tied head gets its own int8 copy
    assert out["model.embed_tokens.weight"].dtype == torch.float32
    assert out["model.norm.weight"].dtype == torch.float32
    assert out["model.layers.1.mlp.down_proj.weight"].dtype == torch.int8
    assert out["model.layers.1.mlp.down_proj.scale"].shape == (64,)
    assert not any(k.endswith("layernorm.scale") for k in out)


def test_modules_to_not_convert_by_prefix_and_by_fused_group():
    nc = NeuronConfig(quantized=True, quantized_checkpoints_path="unused",
                      modules_to_not_convert=["lm_head", "layers.0.self_attn",
                                              "layers.1.mlp.gate_proj"])
    out = quantize_state_dict(_hf_state_dict(), nc, tie_word_embeddings=True)
    assert "lm_head.weight" not in out  # kept tied to the embedding
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert out[f"model.layers.0.self_attn.{proj}.weight"].dtype == torch.float32
        assert out[f"model.layers.1.self_attn.{proj}.weight"].dtype == torch.int8
    # gate and up are one fused matrix in the model: excluding one keeps both
    assert out["model.layers.1.mlp.up_proj.weight"].dtype == torch.float32
    assert out["model.layers.1.mlp.down_proj.weight"].dtype == torch.int8
    assert is_excluded("layers.1.mlp.gate_up_proj", nc.modules_to_not_convert)
    assert not is_excluded("layers.10.self_attn.qkv_proj", ["layers.1"])


# ----------------------------------------------------------------------------- fidelity


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny GQA Llama with tied embeddings, saved as safetensors."""
    torch.manual_seed(3)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                      max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("tiny")
    sd = {k: v.detach() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_state_dict(sd, path)
    cfg.save_pretrained(path)
    return path, model


def _config(path, quant_path, **kw):
    nc = NeuronConfig(batch_size=1, seq_len=64, torch_dtype=torch.float32, enable_bucketing=True,
                      context_encoding_buckets=[16, 32], token_generation_buckets=[32, 64],
                      quantized=True, quantized_checkpoints_path=str(quant_path), **kw)
    return LlamaInferenceConfig(nc, load_config=load_pretrained_config(path))


def _dequantized_reference(hf_model, quant_sd: dict):
    """A copy of the transformers model whose quantized weights are int8 * scale."""
    ref = LlamaForCausalLM(hf_model.config).eval()
    ref.load_state_dict(hf_model.state_dict())
    ref.lm_head.weight = torch.nn.Parameter(hf_model.lm_head.weight.detach().clone())  # untie
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for key, scale in quant_sd.items():
            if key.endswith(".scale"):
                weight = key.removesuffix("scale") + "weight"
                params[weight].copy_(dequantize(quant_sd[weight], scale))
    return ref


@pytest.mark.parametrize("qtype,where,backend,fused,layout", [
    ("per_channel_symmetric", "folder", "eager", False, "plain"),
    ("per_channel_symmetric", "folder", "compiled", True, "plain"),
    ("per_tensor_symmetric", "file.pt", "compiled", True, "plain"),  # per-q/k/v scales, fused
    # packed dequantized copies: prefill (16 rows) runs them, decode (1 row) the int8 kernel
    ("per_channel_symmetric", "folder", "eager", False, "onednn"),
    ("per_tensor_symmetric", "folder", "compiled", True, "onednn"),
    # int8 panels: our kernel at every row count, prefill and decode
    ("per_channel_symmetric", "folder", "eager", False, "panels"),
    ("per_tensor_symmetric", "folder", "compiled", True, "panels"),
])
def test_quantized_logits_equal_the_dequantized_reference(tiny, tmp_path, qtype, where, backend,
                                                          fused, layout):
    path, hf = tiny
    quant_path = tmp_path / ("quantized" if where == "folder" else "quantized.pt")
    kw = dict(quantization_type=qtype, fused_qkv=fused, cpu_weight_layout=layout)
    config = _config(path, quant_path, **kw)
    NeuronLlamaForCausalLM.save_quantized_state_dict(path, config)
    assert quant_path.is_dir() == (where == "folder") and quant_path.exists()
    quant_sd = NeuronLlamaForCausalLM._load_quantized(config.neuron_config)
    assert quant_sd["model.layers.0.self_attn.k_proj.weight"].dtype == torch.int8
    ref = _dequantized_reference(hf, quant_sd)

    model = NeuronLlamaForCausalLM(path, _config(path, quant_path, **kw))
    if backend == "eager":
        model.to_cpu()
    else:
        model.compile(tmp_path / "compiled")
        model = NeuronLlamaForCausalLM(path, _config(path, quant_path, **kw))
        model.load(tmp_path / "compiled")
    attn = model._model.layers[0].self_attn
    assert isinstance(attn.qkv_proj if fused else attn.k_proj, QuantizedLinear)
    assert isinstance(model._model.lm_head, QuantizedLinear)
    assert any(w.dtype == torch.int8 for w in model.weights)
    assert (model._model.lm_head.packed is not None) == (layout == "onednn")
    assert model.weight_layout == layout
    head = model._model.lm_head.weight
    assert (head.dim() == 3 and head.dtype == torch.int8) == (layout == "panels")
    if layout == "panels" and backend == "compiled":  # 2 layers x (qkv, o, gate_up, down) + head
        graph = str(next(iter(model.token_generation_model.runnables.values())).inlined_graph)
        assert graph.count("nxdi::panel_linear") == 9 and "_weight_int8pack_mm" not in graph

    seq = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(0))
    out = model(seq)
    for step in range(STEPS + 1):
        with torch.no_grad():
            expected = ref(seq, use_cache=False).logits[:, -1]
        torch.testing.assert_close(out.logits, expected, atol=1e-4, rtol=0)
        nxt = expected.argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
        if step < STEPS:
            out = model(nxt)


def test_quantized_differs_from_the_float_model(tiny, tmp_path):
    """The quantized model really runs int8 weights: its logits are not the fp32 model's."""
    path, hf = tiny
    config = _config(path, tmp_path / "q")
    NeuronLlamaForCausalLM.save_quantized_state_dict(path, config)
    model = NeuronLlamaForCausalLM(path, _config(path, tmp_path / "q"))
    model.to_cpu()
    seq = torch.arange(1, 12).unsqueeze(0)
    with torch.no_grad():
        full = hf(seq).logits[:, -1]
    diff = (model(seq).logits - full).abs().max()
    assert 1e-3 < diff < 0.2 * full.abs().max()


def test_bad_quantization_settings_are_refused(tiny, tmp_path):
    path, _ = tiny
    with pytest.raises(ValueError, match="quantized_checkpoints_path"):
        NeuronLlamaForCausalLM(path, _config(path, "")).to_cpu()
    with pytest.raises(ValueError, match="quantization_dtype 'f8e4m3' is not supported"):
        NeuronLlamaForCausalLM.save_quantized_state_dict(
            path, _config(path, tmp_path / "q", quantization_dtype="f8e4m3"))
    with pytest.raises(FileNotFoundError, match="save_quantized_state_dict"):
        NeuronLlamaForCausalLM(path, _config(path, tmp_path / "missing")).to_cpu()
    assert not (tmp_path / "q").exists()


def test_misaligned_int8_weights_are_realigned():
    """A weight at an odd offset (as safetensors hands them out) is copied to aligned memory."""
    from nxdi_common.modules.quantization import KERNEL_ALIGNMENT, aligned_int8
    buf = torch.zeros(64 * 32 + 24, dtype=torch.int8)
    sd = {"w": buf[24:].view(64, 32), "f": torch.zeros(3)}
    sd["w"][:] = 5
    assert sd["w"].data_ptr() % KERNEL_ALIGNMENT
    out = aligned_int8(sd)
    assert out["w"].data_ptr() % KERNEL_ALIGNMENT == 0 and torch.equal(out["w"], sd["w"])
    assert out["f"] is sd["f"]
    x = torch.randn(512, 32, dtype=torch.bfloat16)  # the case that crashed misaligned
    y = torch.ops.aten._weight_int8pack_mm(x, out["w"], torch.ones(64, dtype=torch.bfloat16))
    torch.testing.assert_close(y.float(), (x.float() @ out["w"].float().t()), rtol=0.02, atol=0.5)


def test_worker_quantize_option_quantizes_once_and_changes_the_fingerprint(tiny, tmp_path):
    """--quantize int8 on a worker: the quantized checkpoint is written next to the compiled
    models on first use and reused after; the model runs int8 layers; the fingerprint the KV
    transfer is checked against differs from the unquantized worker's (no mixed pools)."""
    from nxdi_common.serving import worker
    path, _ = tiny
    root = tmp_path / "compiled"
    opts = worker.ModelOptions(str(path), "float32", 64, "eager", str(root), 1, "int8")
    model = worker.load_model(opts, worker.decode_neuron_config(opts, 2, 16, 16))
    qdir = worker.quantized_dir(opts)
    assert qdir.is_dir() and qdir.parent == root
    stamp = (qdir / "model.safetensors").stat().st_mtime_ns
    assert isinstance(model._model.lm_head, QuantizedLinear)
    again = worker.load_model(opts, worker.decode_neuron_config(opts, 2, 16, 16))
    assert (qdir / "model.safetensors").stat().st_mtime_ns == stamp  # not written again
    plain_opts = worker.ModelOptions(str(path), "float32", 64, "eager", str(root), 1)
    plain = worker.load_model(plain_opts, worker.decode_neuron_config(plain_opts, 2, 16, 16))
    assert not isinstance(plain._model.lm_head, QuantizedLinear)
    assert worker.model_fingerprint(again, opts) != worker.model_fingerprint(plain, plain_opts)
    with pytest.raises(ValueError, match="quantize must be one of"):
        worker.ModelOptions(str(path), quantize="int4")
