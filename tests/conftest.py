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
def compile_cache_dir(tmp_path, monkeypatch):
    """A private persistent compile cache for the test (never ~/.cache); CompileCache reads
    $NXDI_COMPILE_CACHE when a model is constructed."""
    cache = tmp_path / "compile-cache"
    monkeypatch.setenv("NXDI_COMPILE_CACHE", str(cache))
    return cache
