"""Neuron backend: each (sub-model, bucket) graph is compiled by torch-neuronx (neuronx-cc) into a
NEFF-backed TorchScript artifact. The Neuron SDK is not on PyPI (only empty placeholder packages
are); install it from the Neuron SDK's own index (see README). It is imported only here, lazily."""
from __future__ import annotations

import importlib
import os
from pathlib import Path

NEURON_INSTALL_HINT = (
    "the Neuron SDK (torch-neuronx, neuronx-cc) is not installed; on an Inferentia/Trainium host run "
    "`pip install --extra-index-url https://pip.repos.neuron.amazonaws.com torch-neuronx neuronx-cc "
    "neuronx-distributed`, or set NeuronConfig(backend='cpu') to run on CPU")


def _import_torch_neuronx():
    try:
        module = importlib.import_module("torch_neuronx")
    except ImportError as exc:
        raise RuntimeError(NEURON_INSTALL_HINT) from exc
    if not hasattr(module, "trace"):  # the PyPI placeholder package has no API
        raise RuntimeError(NEURON_INSTALL_HINT + " (found an empty placeholder torch_neuronx)")
    return module


def neuron_available() -> bool:
    try:
        _import_torch_neuronx()
    except RuntimeError:
        return False
    return True


class NeuronBackend:
    """torch_neuronx.trace per bucket, saved with torch.jit.save, loaded with torch.jit.load."""

    name = "neuron"
    artifact_suffix = ".neff.pt"

    def __init__(self):
        self.torch_neuronx = _import_torch_neuronx()
        self.compiled_count = 0

    @property
    def version(self) -> str:
        version = getattr(self.torch_neuronx, "__version__", "unknown")
        try:
            cc = importlib.import_module("neuronxcc").__version__
        except (ImportError, AttributeError):
            cc = "unknown"
        return f"torch-neuronx-{version}/neuronx-cc-{cc}"

    def compile(self, graph_fn, example_inputs: tuple, artifact: Path, compiler_args=None) -> None:
        """Compile graph_fn for the example shapes into a NEFF and save it atomically."""
        workdir = artifact.with_name(artifact.name + ".workdir")
        traced = self.torch_neuronx.trace(graph_fn, example_inputs, compiler_args=compiler_args,
                                          compiler_workdir=str(workdir))
        self.compiled_count += 1
        import torch
        tmp = artifact.with_name(artifact.name + f".tmp{os.getpid()}")
        torch.jit.save(traced, str(tmp))
        os.replace(tmp, artifact)

    def load(self, artifact: Path):
        import torch
        return torch.jit.load(str(artifact))
