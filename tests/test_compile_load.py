"""compile() / load() life cycle on the traced CPU backend: a compiled folder is self-describing
(config, manifest, one artifact per sub-model and bucket, sharded weights), a fresh process loads
it without tracing anything and reproduces the outputs bit for bit, the persistent compile cache
is reused only for an identical configuration, and failures leave nothing half-written."""
from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from nxdi_common.application_base import MANIFEST, SHARDED_WEIGHTS, NeuronApplicationBase
from nxdi_common.backends.compile_cache import CompileCache
from nxdi_common.backends.cpu import TracedCPUBackend
from nxdi_common.config import CONFIG_FILE, InferenceConfig, NeuronConfig
from nxdi_common.models.llama.modeling_llama import LlamaInferenceConfig, NeuronLlamaForCausalLM

CTE_BUCKETS, TKG_BUCKETS = [16, 32], [64, 128]
N_BUCKETS = len(CTE_BUCKETS) + len(TKG_BUCKETS)
ARTIFACTS = {f"context_encoding_model/b1_n{n}.pt" for n in CTE_BUCKETS} | \
            {f"token_generation_model/b1_n{n}.pt" for n in TKG_BUCKETS}
WEIGHTS = SHARDED_WEIGHTS.as_posix()
EXPECTED_FILES = {CONFIG_FILE, MANIFEST, WEIGHTS} | ARTIFACTS


def neuron_config(**overrides) -> NeuronConfig:
    kwargs = dict(batch_size=1, seq_len=128, torch_dtype=torch.float32, enable_bucketing=True,
                  context_encoding_buckets=CTE_BUCKETS, token_generation_buckets=TKG_BUCKETS,
                  backend="cpu")
    kwargs.update(overrides)
    return NeuronConfig(**kwargs)


def files_under(path: Path) -> set[str]:
    return {p.relative_to(path).as_posix() for p in Path(path).rglob("*") if p.is_file()}


def greedy_runs(model) -> torch.Tensor:
    """Logits of two greedy generations: a 10-token prompt (CTE bucket 16, TKG bucket 64) and a
    30-token prompt decoded past position 64 (CTE bucket 32, TKG buckets 64 then 128)."""
    import torch
    results = []
    for prompt_len, steps in ((10, 4), (30, 37)):
        model.reset()
        prompt = (torch.arange(prompt_len) * 37 + 11).remainder(256).unsqueeze(0)
        logits = [model(prompt).logits]
        for _ in range(steps):
            logits.append(model(logits[-1].argmax(-1, keepdim=True)).logits)
        results.append(torch.cat(logits))
    return torch.cat(results)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def isolated_cache(compile_cache_dir) -> Path:
    """Every model built in a test uses a private persistent cache (never ~/.cache)."""
    return compile_cache_dir


@pytest.fixture(scope="module")
def ckpt(tiny_llama_ckpt) -> Path:
    return tiny_llama_ckpt


@pytest.fixture(scope="module")
def compiled(ckpt, tmp_path_factory):
    """(loaded model, compiled folder, reference logits of greedy_runs)."""
    out = tmp_path_factory.mktemp("compiled") / "model"
    model = NeuronLlamaForCausalLM(ckpt, neuron_config=neuron_config())
    model.compile_cache = CompileCache(tmp_path_factory.mktemp("cache"))
    model.compile(out)
    model.load(out)
    return model, out, greedy_runs(model)


def test_compiled_folder_layout(compiled):
    model, out, _ = compiled
    assert files_under(out) == EXPECTED_FILES
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["backend"] == "cpu"
    assert manifest["artifacts"] == {
        "context_encoding_model": {f"1x{n}": f"context_encoding_model/b1_n{n}.pt" for n in CTE_BUCKETS},
        "token_generation_model": {f"1x{n}": f"token_generation_model/b1_n{n}.pt" for n in TKG_BUCKETS},
    }
    # weights are graph inputs, not embedded: every artifact is smaller than the weights file
    weights_size = (out / WEIGHTS).stat().st_size
    assert all((out / a).stat().st_size < weights_size for a in ARTIFACTS)
    assert model.is_compiled and model.is_loaded_to_neuron



def test_load_times_each_buckets_warm_up_call(compiled):
    """load() warms every bucket up; the second call's seconds are kept, and a prompt's warm-up
    prefill rate is its length over its CTE bucket's time (a decode worker's first estimate of
    its local prefill rate, decode_service.engine._prior_local_rate), and the smallest
    token-generation bucket's time is its decode step's before one is measured."""
    model, _, _ = compiled
    assert set(model.warmup_seconds) == (
        {("context_encoding_model", (1, n)) for n in CTE_BUCKETS}
        | {("token_generation_model", (1, n)) for n in TKG_BUCKETS})
    assert all(s > 0 for s in model.warmup_seconds.values())
    seconds = model.warmup_seconds[("context_encoding_model", (1, 32))]
    assert model.warmup_prefill_rate(20) == pytest.approx(20 / seconds)  # in the 32 bucket
    assert model.warmup_prefill_rate(33) is None and model.warmup_prefill_rate(0) is None
    assert model.warmup_step_seconds() == model.warmup_seconds[
        ("token_generation_model", (1, min(TKG_BUCKETS)))]

def test_no_leftovers_next_to_compiled_folder(compiled):
    _, out, _ = compiled
    assert [p.name for p in out.parent.iterdir()] == [out.name]


def test_inference_config_round_trip(compiled):
    model, out, _ = compiled
    loaded = LlamaInferenceConfig.load(out)
    assert loaded == model.config
    assert loaded.neuron_config.to_dict() == model.neuron_config.to_dict()
    assert loaded.neuron_config.torch_dtype == torch.float32
    assert loaded.neuron_config.context_encoding_buckets == CTE_BUCKETS
    assert InferenceConfig.load(out).to_dict() == model.config.to_dict()


def test_loaded_matches_to_cpu(compiled, ckpt):
    _, _, reference = compiled
    eager = NeuronLlamaForCausalLM(ckpt, neuron_config=neuron_config())
    eager.to_cpu()
    torch.testing.assert_close(greedy_runs(eager), reference, rtol=1e-5, atol=1e-5)


_CHILD_MAIN = '''
import sys
import torch
import nxdi_common.backends.cpu as cpu_backend

torch.set_num_threads(1)


def _forbidden(*args, **kwargs):
    raise AssertionError("tracing/compiling during load()")


torch.jit.trace = _forbidden  # load() must not trace anything
cpu_backend.TracedCPUBackend.compile = _forbidden

from nxdi_common.models.llama.modeling_llama import LlamaInferenceConfig, NeuronLlamaForCausalLM

compiled_dir, ckpt_dir, result_file = sys.argv[1:4]
config = LlamaInferenceConfig.load(compiled_dir)
model = NeuronLlamaForCausalLM(ckpt_dir, config=config)
model.load(compiled_dir)
assert isinstance(model.backend, cpu_backend.TracedCPUBackend), type(model.backend)
assert model.backend.compiled_count == 0, model.backend.compiled_count
logits = greedy_runs(model)
assert model.backend.compiled_count == 0, model.backend.compiled_count
torch.save(logits, result_file)
print("CHILD OK")
'''


def test_fresh_process_loads_without_compiling(compiled, ckpt, tmp_path):
    _, out, reference = compiled
    script = tmp_path / "child.py"
    script.write_text("import torch\n\n\n" + textwrap.dedent(inspect.getsource(greedy_runs)) + _CHILD_MAIN)
    result = tmp_path / "logits.pt"
    env = dict(os.environ, NXDI_COMPILE_CACHE=str(tmp_path / "empty-cache"))
    proc = subprocess.run([sys.executable, str(script), str(out), str(ckpt), str(result)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "CHILD OK" in proc.stdout
    assert torch.equal(torch.load(result), reference)
    assert not (tmp_path / "empty-cache").exists()  # load() neither reads nor fills the cache
    assert files_under(out) == EXPECTED_FILES  # and writes nothing into the compiled folder


def test_sharded_weights_make_folder_self_contained(compiled, ckpt, tmp_path, monkeypatch):
    """With save_sharded_checkpoint (the default), load() reads weights from the compiled folder:
    the checkpoint's weight files are not needed (nor read)."""
    _, out, reference = compiled
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(ckpt / "config.json", config_only / "config.json")
    calls = []
    monkeypatch.setattr(NeuronApplicationBase, "get_state_dict",
                        classmethod(lambda cls, *a: calls.append(a) or {}))
    model = NeuronLlamaForCausalLM(config_only, neuron_config=neuron_config())
    model.load(out)
    assert calls == []
    assert torch.equal(greedy_runs(model), reference)


def test_unsharded_compile_loads_weights_from_model_path(compiled, ckpt, tmp_path):
    _, _, reference = compiled
    out = tmp_path / "unsharded"
    nc = neuron_config(save_sharded_checkpoint=False)
    NeuronLlamaForCausalLM(ckpt, neuron_config=nc).compile(out)
    assert files_under(out) == EXPECTED_FILES - {WEIGHTS}

    model = NeuronLlamaForCausalLM(ckpt, neuron_config=nc)
    calls = []
    real = NeuronLlamaForCausalLM.get_state_dict.__func__
    model.get_state_dict = lambda path, config: calls.append(path) or real(type(model), path, config)
    model.load(out)
    assert calls == [str(ckpt)]
    assert torch.equal(greedy_runs(model), reference)

    # without weights in model_path the unsharded folder cannot be loaded
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(ckpt / "config.json", config_only / "config.json")
    with pytest.raises(ValueError, match="model.safetensors"):
        NeuronLlamaForCausalLM(config_only, neuron_config=nc).load(out)


def test_persistent_cache_reused_for_same_config(ckpt, tmp_path, isolated_cache):
    first = NeuronLlamaForCausalLM(ckpt, neuron_config=neuron_config())
    assert first.compile_cache.directory == isolated_cache  # $NXDI_COMPILE_CACHE at construction
    first.compile(tmp_path / "a")
    assert (first.compile_cache.hits, first.compile_cache.misses) == (0, N_BUCKETS)
    assert first.backend.compiled_count == N_BUCKETS
    assert len([p for p in isolated_cache.iterdir() if p.suffix == ".pt"]) == N_BUCKETS

    second = NeuronLlamaForCausalLM(ckpt, neuron_config=neuron_config())
    second.compile(tmp_path / "b")
    assert (second.compile_cache.hits, second.compile_cache.misses) == (N_BUCKETS, 0)
    assert second.backend.compiled_count == 0
    assert files_under(tmp_path / "b") == EXPECTED_FILES
    for artifact in ARTIFACTS:
        assert (tmp_path / "a" / artifact).read_bytes() == (tmp_path / "b" / artifact).read_bytes()
    first.load(tmp_path / "a")
    second.load(tmp_path / "b")
    assert torch.equal(greedy_runs(second), greedy_runs(first))


@pytest.mark.parametrize("change, n_graphs", [
    (dict(context_encoding_buckets=[32]), 1 + len(TKG_BUCKETS)),
    (dict(token_generation_buckets=[128]), len(CTE_BUCKETS) + 1),
    (dict(torch_dtype=torch.bfloat16), N_BUCKETS),
])
def test_persistent_cache_misses_when_config_changes(ckpt, tmp_path, change, n_graphs):
    NeuronLlamaForCausalLM(ckpt, neuron_config=neuron_config()).compile(tmp_path / "a")
    changed = NeuronLlamaForCausalLM(ckpt, neuron_config=neuron_config(**change))
    changed.compile(tmp_path / "b")
    assert (changed.compile_cache.hits, changed.compile_cache.misses) == (0, n_graphs)
    assert changed.backend.compiled_count == n_graphs
    changed.load(tmp_path / "b")
    assert changed(torch.tensor([[1, 2, 3]])).logits.shape == (1, 256)


def _fail_on_third_graph(monkeypatch):
    real, calls = TracedCPUBackend.compile, []

    def flaky(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("compiler crashed")
        return real(self, *args, **kwargs)
    monkeypatch.setattr(TracedCPUBackend, "compile", flaky)


def _fail_saving_weights(monkeypatch):
    def broken(self, path):
        raise RuntimeError("disk full")
    monkeypatch.setattr(NeuronApplicationBase, "shard_weights", broken)


@pytest.mark.parametrize("inject", [_fail_on_third_graph, _fail_saving_weights])
def test_failing_compile_leaves_nothing_behind(ckpt, tmp_path, monkeypatch, inject):
    parent = tmp_path / "outputs"
    parent.mkdir()
    model = NeuronLlamaForCausalLM(ckpt, neuron_config=neuron_config())
    inject(monkeypatch)
    with pytest.raises(RuntimeError, match="compiler crashed|disk full"):
        model.compile(parent / "model")
    assert list(parent.iterdir()) == []  # neither the target nor a temporary folder
    assert not model.is_compiled


def test_failing_recompile_keeps_previous_folder(compiled, ckpt, tmp_path, monkeypatch):
    _, _, reference = compiled
    out = tmp_path / "model"
    NeuronLlamaForCausalLM(ckpt, neuron_config=neuron_config()).compile(out)
    before = {name: (out / name).read_bytes() for name in files_under(out)}

    model = NeuronLlamaForCausalLM(ckpt, neuron_config=neuron_config())
    model.compile_cache = CompileCache(enabled=False)  # so the backend really runs
    _fail_on_third_graph(monkeypatch)
    with pytest.raises(RuntimeError, match="compiler crashed"):
        model.compile(out)
    assert [p.name for p in tmp_path.iterdir() if p.name != "compile-cache"] == ["model"]
    assert {name: (out / name).read_bytes() for name in files_under(out)} == before

    monkeypatch.undo()
    survivor = NeuronLlamaForCausalLM(ckpt, neuron_config=neuron_config())
    survivor.load(out)
    assert torch.equal(greedy_runs(survivor), reference)


def test_load_with_other_buckets_asks_to_compile_again(compiled, ckpt):
    _, out, _ = compiled
    model = NeuronLlamaForCausalLM(ckpt, neuron_config=neuron_config(context_encoding_buckets=[32]))
    with pytest.raises(ValueError, match="compile again") as info:
        model.load(out)
    assert "1x16" in str(info.value) and str(out) in str(info.value)


def test_load_with_other_dtype_asks_to_compile_again(compiled, ckpt):
    _, out, _ = compiled
    model = NeuronLlamaForCausalLM(ckpt, neuron_config=neuron_config(torch_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="torch_dtype.*compile again"):
        model.load(out)


@pytest.mark.parametrize("make", ["empty", "missing", "checkpoint"])
def test_load_of_non_compiled_folder(ckpt, tmp_path, make):
    folder = {"empty": tmp_path / "empty", "missing": tmp_path / "missing", "checkpoint": ckpt}[make]
    if make == "empty":
        folder.mkdir()
    model = NeuronLlamaForCausalLM(ckpt, neuron_config=neuron_config())
    with pytest.raises(FileNotFoundError, match="compile") as info:
        model.load(folder)
    assert str(folder) in str(info.value)
    assert not (tmp_path / "missing").exists()
