"""Fixtures shared by the test modules."""

import pytest


@pytest.fixture(scope="session")
def bundled_model_path():
    """The bundled SmolLM2-135M-Instruct checkpoint in the default cache (converted once, ~15 s)."""
    from nxdi_common.bundled import prepare_bundled_model

    return prepare_bundled_model()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one thread (no OpenMP spin-waiting on a busy machine)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def torch_threads():
    """torch_threads(n): a context of n intra-op threads, the caller's count again after (a
    test that changes it must put it back: one_torch_thread is module-scoped)."""
    import contextlib

    import torch

    @contextlib.contextmanager
    def threads(n: int):
        previous = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            yield
        finally:
            torch.set_num_threads(previous)
    return threads


@pytest.fixture
def compile_cache_dir(tmp_path, monkeypatch):
    """A private persistent compile cache for the test (never ~/.cache); CompileCache reads
    $NXDI_COMPILE_CACHE when a model is constructed."""
    cache = tmp_path / "compile-cache"
    monkeypatch.setenv("NXDI_COMPILE_CACHE", str(cache))
    return cache


@pytest.fixture(scope="module")
def tiny_llama_ckpt(tmp_path_factory):
    """A tiny random GQA Llama (hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 256) saved with
    save_pretrained; built once per test module."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, vocab_size=256)
    path = tmp_path_factory.mktemp("ckpt")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, bundled_model_path):
    """A tiny random Llama (hidden 64, 2 layers, 4 heads, 2 KV heads) with the bundled model's
    vocabulary, tokenizer and chat template: serving tests that need real text in and out but not
    real answers start in a second and run fast. Tied embeddings; eos_token_id 2 as SmolLM2."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, vocab_size=49152,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2, max_position_embeddings=4096)
    path = tmp_path_factory.mktemp("tiny-chat")
    LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled_model_path / name, path / name)
    return path


class _Service:
    """A service process started by the ``spawn`` fixture: its ready info and output tail."""

    def __init__(self, module: str, args: list[str], timeout: float):
        import collections
        import json
        import subprocess
        import sys
        import threading
        import time

        self.module, self.tail = module, collections.deque(maxlen=300)
        self.proc = subprocess.Popen([sys.executable, "-u", "-m", module, *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.info, ready = None, threading.Event()

        def drain():
            for line in self.proc.stdout:
                self.tail.append(line.rstrip())
                if line.startswith("NXDI_READY ") and self.info is None:
                    self.info = json.loads(line.split(" ", 1)[1])
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.2) and time.monotonic() < deadline:
            pass
        if self.info is None:
            self.stop()
            raise RuntimeError(f"{module} did not start:\n" + "\n".join(self.tail))

    @property
    def grpc(self) -> str:
        return self.info["grpc"]

    def output(self) -> str:
        return "\n".join(self.tail)

    def stop(self) -> None:
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _spawner():
    started = []

    def start(module: str, *args: str, timeout: float = 180.0) -> _Service:
        service = _Service(module, [str(a) for a in args], timeout)
        started.append(service)
        return service
    return start, started


@pytest.fixture
def spawn():
    """spawn(module, *args, timeout=180) starts ``python -m module args`` (a real service process
    on loopback), waits for its NXDI_READY line and returns a _Service; all are stopped after."""
    start, started = _spawner()
    yield start
    for service in reversed(started):
        service.stop()


@pytest.fixture(scope="module")
def spawn_module():
    """spawn, for services shared by a whole test module."""
    start, started = _spawner()
    yield start
    for service in reversed(started):
        service.stop()
