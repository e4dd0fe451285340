"""Fixtures shared by the test modules."""

import pytest


@pytest.fixture(scope="session")
def bundled_model_path():
    """The bundled SmolLM2-135M-Instruct checkpoint in the default cache (converted once, ~15 s)."""
    from nxdi_common.bundled import prepare_bundled_model

    return prepare_bundled_model()
