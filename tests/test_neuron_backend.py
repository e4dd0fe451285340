"""Contract test of the Neuron backend without the Neuron SDK (it is not on PyPI; only empty
placeholder packages are). Without torch_neuronx, asking for the neuron backend fails with a
message saying how to install the SDK; with a fake torch_neuronx injected, compile() calls
`torch_neuronx.trace` once per (sub-model, bucket) with the bucket's example inputs and the
application's compiler args, and the saved artifacts load and run."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from nxdi_common.application_base import MANIFEST, SHARDED_WEIGHTS
from nxdi_common.backends import get_backend
from nxdi_common.backends.cpu import TracedCPUBackend
from nxdi_common.backends.neuron import NeuronBackend
from nxdi_common.backends.weights import unique_parameters
from nxdi_common.config import CONFIG_FILE, NeuronConfig
from nxdi_common.models.llama.modeling_llama import NeuronLlamaForCausalLM

CTE_BUCKETS, TKG_BUCKETS = [16, 32], [64, 128]
COMPILER_ARGS = "--model-type=transformer -O1 --auto-cast=none"
FAKE_VERSION = "2.99.0+fake"


def neuron_config(backend="neuron", **overrides) -> NeuronConfig:
    kwargs = dict(batch_size=1, seq_len=128, torch_dtype=torch.float32, enable_bucketing=True,
                  context_encoding_buckets=CTE_BUCKETS, token_generation_buckets=TKG_BUCKETS,
                  backend=backend)
    kwargs.update(overrides)
    return NeuronConfig(**kwargs)


class LlamaWithCompilerArgs(NeuronLlamaForCausalLM):
    def get_compiler_args(self):
        return COMPILER_ARGS


def files_under(path: Path) -> set[str]:
    return {p.relative_to(path).as_posix() for p in Path(path).rglob("*") if p.is_file()}


def greedy_logits(model, prompt_len=12, steps=6) -> torch.Tensor:
    model.reset()
    prompt = (torch.arange(prompt_len) * 29 + 3).remainder(256).unsqueeze(0)
    logits = [model(prompt).logits]
    for _ in range(steps):
        logits.append(model(logits[-1].argmax(-1, keepdim=True)).logits)
    return torch.cat(logits)


def make_fake_torch_neuronx() -> types.ModuleType:
    """A stand-in for torch_neuronx: `trace` records each call and returns a TorchScript trace so
    the artifact still runs on CPU."""
    module = types.ModuleType("torch_neuronx")
    module.__version__ = FAKE_VERSION
    module.calls = []

    def trace(fn, example_inputs, compiler_args=None, compiler_workdir=None):
        module.calls.append(dict(example_inputs=example_inputs, compiler_args=compiler_args,
                                 compiler_workdir=compiler_workdir))
        return torch.jit.trace(fn, example_inputs, check_trace=False)

    module.trace = trace
    return module


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def isolated_cache(compile_cache_dir, monkeypatch) -> Path:
    monkeypatch.setitem(sys.modules, "neuronxcc", None)  # compiler version: "unknown"
    return compile_cache_dir


@pytest.fixture(params=["absent", "placeholder"])
def no_sdk(request, monkeypatch):
    """torch_neuronx not importable, or the empty PyPI placeholder (a module without `trace`)."""
    if request.param == "absent":
        monkeypatch.setitem(sys.modules, "torch_neuronx", None)  # import raises ImportError
    else:
        monkeypatch.setitem(sys.modules, "torch_neuronx", types.ModuleType("torch_neuronx"))
    return request.param


@pytest.fixture
def fake_neuronx(monkeypatch) -> types.ModuleType:
    fake = make_fake_torch_neuronx()
    monkeypatch.setitem(sys.modules, "torch_neuronx", fake)
    return fake


@pytest.fixture(scope="module")
def ckpt(tiny_llama_ckpt) -> Path:
    return tiny_llama_ckpt


def _assert_install_hint(message: str) -> None:
    assert "Neuron SDK" in message and "not installed" in message
    assert "pip install" in message and "torch-neuronx" in message
    assert "pip.repos.neuron.amazonaws.com" in message
    assert "backend='cpu'" in message


# ----------------------------------------------------------------------------- SDK missing
def test_neuron_backend_without_sdk_says_how_to_install(no_sdk):
    with pytest.raises(RuntimeError) as info:
        get_backend("neuron")
    _assert_install_hint(str(info.value))
    if no_sdk == "placeholder":
        assert "placeholder" in str(info.value)


def test_auto_picks_cpu_without_sdk(no_sdk):
    assert isinstance(get_backend("auto"), TracedCPUBackend)
    assert isinstance(get_backend("cpu"), TracedCPUBackend)


def test_compile_for_neuron_without_sdk_fails_cleanly(no_sdk, ckpt, tmp_path):
    parent = tmp_path / "outputs"
    parent.mkdir()
    model = NeuronLlamaForCausalLM(ckpt, neuron_config=neuron_config("neuron"))
    with pytest.raises(RuntimeError) as info:
        model.compile(parent / "model")
    _assert_install_hint(str(info.value))
    assert list(parent.iterdir()) == []
    assert not model.is_compiled


def test_auto_compile_without_sdk_uses_cpu(no_sdk, ckpt, tmp_path):
    model = NeuronLlamaForCausalLM(ckpt, neuron_config=neuron_config("auto"))
    model.compile(tmp_path / "model")
    assert json.loads((tmp_path / "model" / MANIFEST).read_text())["backend"] == "cpu"
    assert all(not f.endswith(".neff.pt") for f in files_under(tmp_path / "model"))


def test_load_of_neuron_folder_without_sdk_fails_with_hint(ckpt, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_neuronx", make_fake_torch_neuronx())
    NeuronLlamaForCausalLM(ckpt, neuron_config=neuron_config("neuron")).compile(tmp_path / "model")
    monkeypatch.setitem(sys.modules, "torch_neuronx", None)
    model = NeuronLlamaForCausalLM(ckpt, neuron_config=neuron_config("neuron"))
    with pytest.raises(RuntimeError) as info:
        model.load(tmp_path / "model")
    _assert_install_hint(str(info.value))


# ----------------------------------------------------------------------------- fake SDK
def test_auto_picks_neuron_with_sdk(fake_neuronx):
    backend = get_backend("auto")
    assert isinstance(backend, NeuronBackend)
    assert backend.name == "neuron" and backend.artifact_suffix == ".neff.pt"
    assert FAKE_VERSION in backend.version


def test_compile_traces_each_bucket_once(fake_neuronx, ckpt, tmp_path):
    out = tmp_path / "model"
    model = LlamaWithCompilerArgs(ckpt, neuron_config=neuron_config("neuron"))
    model.compile(out)

    expected = [("context_encoding_model", n, (1, n)) for n in CTE_BUCKETS] + \
               [("token_generation_model", n, (1, 1)) for n in TKG_BUCKETS]
    assert len(fake_neuronx.calls) == len(expected)
    kv_shape = tuple(model._model.kv_mgr.allocate().shape)
    weights = [p for _, p in unique_parameters(model._model)]
    for call, (tag, bucket, ids_shape) in zip(fake_neuronx.calls, expected):
        workdir = Path(call["compiler_workdir"])
        assert workdir.parent.name == tag and workdir.name.startswith(f"b1_n{bucket}.neff.pt")
        assert call["compiler_args"] == COMPILER_ARGS
        example = call["example_inputs"]
        assert len(example) == 10  # 8 graph inputs, the KV cache, the weights tuple
        input_ids, attention_mask, position_ids = example[:3]
        assert tuple(input_ids.shape) == ids_shape and input_ids.dtype == torch.long
        assert tuple(attention_mask.shape) == ids_shape
        assert tuple(position_ids.shape) == ids_shape
        if tag == "token_generation_model":
            assert int(position_ids.max()) == bucket - 1
        assert tuple(example[3].shape) == (1,)  # seq_ids
        kv_cache = example[8]
        assert isinstance(kv_cache, torch.Tensor) and tuple(kv_cache.shape) == kv_shape
        assert isinstance(example[9], tuple) and len(example[9]) == len(weights)
        assert [tuple(w.shape) for w in example[9]] == [tuple(w.shape) for w in weights]

    assert model.backend.compiled_count == len(expected)
    artifacts = {f"context_encoding_model/b1_n{n}.neff.pt" for n in CTE_BUCKETS} | \
                {f"token_generation_model/b1_n{n}.neff.pt" for n in TKG_BUCKETS}
    assert files_under(out) == artifacts | {CONFIG_FILE, MANIFEST, SHARDED_WEIGHTS.as_posix()}
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["backend"] == "neuron" and FAKE_VERSION in manifest["backend_version"]
    assert {rel for arts in manifest["artifacts"].values() for rel in arts.values()} == artifacts


def test_load_runs_like_to_cpu(fake_neuronx, ckpt, tmp_path):
    out = tmp_path / "model"
    LlamaWithCompilerArgs(ckpt, neuron_config=neuron_config("neuron")).compile(out)
    traced_calls = len(fake_neuronx.calls)

    model = LlamaWithCompilerArgs(ckpt, neuron_config=neuron_config("neuron"))
    model.load(out)
    assert isinstance(model.backend, NeuronBackend) and model.backend.compiled_count == 0
    assert len(fake_neuronx.calls) == traced_calls  # load() never traces

    eager = LlamaWithCompilerArgs(ckpt, neuron_config=neuron_config("neuron"))
    eager.to_cpu()
    for prompt_len, steps in ((12, 6), (30, 40)):  # both CTE buckets, both TKG buckets
        torch.testing.assert_close(greedy_logits(model, prompt_len, steps),
                                   greedy_logits(eager, prompt_len, steps), rtol=1e-5, atol=1e-5)


def test_auto_compiles_for_neuron_with_sdk(fake_neuronx, ckpt, tmp_path):
    out = tmp_path / "model"
    NeuronLlamaForCausalLM(ckpt, neuron_config=neuron_config("auto")).compile(out)
    assert json.loads((out / MANIFEST).read_text())["backend"] == "neuron"
    assert len(fake_neuronx.calls) == len(CTE_BUCKETS) + len(TKG_BUCKETS)
    assert all(f.endswith(".neff.pt") for f in files_under(out)
               if f.startswith(("context_", "token_")))


def test_compile_cache_keyed_on_neuron_version(fake_neuronx, ckpt, tmp_path):
    n_graphs = len(CTE_BUCKETS) + len(TKG_BUCKETS)
    NeuronLlamaForCausalLM(ckpt, neuron_config=neuron_config()).compile(tmp_path / "a")
    assert len(fake_neuronx.calls) == n_graphs

    again = NeuronLlamaForCausalLM(ckpt, neuron_config=neuron_config())
    again.compile(tmp_path / "b")
    assert len(fake_neuronx.calls) == n_graphs  # all from the cache
    assert (again.compile_cache.hits, again.compile_cache.misses) == (n_graphs, 0)

    fake_neuronx.__version__ = "3.0.0+fake"  # a new SDK invalidates cached NEFFs
    upgraded = NeuronLlamaForCausalLM(ckpt, neuron_config=neuron_config())
    upgraded.compile(tmp_path / "c")
    assert len(fake_neuronx.calls) == 2 * n_graphs
    assert (upgraded.compile_cache.hits, upgraded.compile_cache.misses) == (0, n_graphs)


def test_cpu_backend_never_touches_neuron(fake_neuronx, ckpt, tmp_path):
    NeuronLlamaForCausalLM(ckpt, neuron_config=neuron_config("cpu")).compile(tmp_path / "model")
    assert fake_neuronx.calls == []
