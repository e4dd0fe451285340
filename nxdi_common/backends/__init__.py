"""Execution backends for the per-bucket sub-model graphs.

* `cpu-eager` (`to_cpu()`): runs the torch modules directly.
* `cpu`: traces each (sub-model, bucket) with torch.jit.trace into a TorchScript artifact that a
  new process loads and runs without tracing again.
* `neuron`: compiles each (sub-model, bucket) with torch-neuronx into a NEFF-backed artifact; the
  Neuron SDK is imported only when this backend is asked for.
"""
from __future__ import annotations


def get_backend(name: str):
    """The backend object for a NeuronConfig.backend value ("auto", "cpu", "neuron")."""
    from nxdi_common.backends.cpu import TracedCPUBackend
    from nxdi_common.backends.neuron import NeuronBackend, neuron_available
    if name == "auto":
        name = "neuron" if neuron_available() else "cpu"
    if name == "cpu":
        return TracedCPUBackend()
    if name == "neuron":
        return NeuronBackend()
    raise ValueError(f"backend {name!r} is unknown; use 'auto', 'cpu' or 'neuron'")
