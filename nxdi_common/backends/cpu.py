"""CPU backends: eager execution, and TorchScript tracing per bucket (the CPU stand-in for a NEFF)."""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch


class EagerBackend:
    """Runs the sub-model graphs as plain torch code (`to_cpu()`)."""

    name = "cpu-eager"

    def runnable(self, graph_fn):
        return graph_fn


class TracedCPUBackend:
    """torch.jit.trace per (sub-model, bucket); artifacts are TorchScript files without weights."""

    name = "cpu"
    artifact_suffix = ".pt"

    def __init__(self):
        self.compiled_count = 0  # graphs traced by this process (tests assert load() traces none)

    @property
    def version(self) -> str:
        return f"torch-{torch.__version__}"

    def compile(self, graph_fn, example_inputs: tuple, artifact: Path, compiler_args=None) -> None:
        """Trace graph_fn on example_inputs and save it to `artifact` atomically."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TracerWarnings for static shapes are intended
            traced = torch.jit.trace(graph_fn, example_inputs, check_trace=False, strict=False)
        self.compiled_count += 1
        tmp = artifact.with_name(artifact.name + f".tmp{os.getpid()}")
        torch.jit.save(traced, str(tmp))
        os.replace(tmp, artifact)

    def load(self, artifact: Path):
        """Load a traced artifact; the returned callable takes (*inputs, kv_cache, weights)."""
        module = torch.jit.load(str(artifact), map_location="cpu")
        return module.eval()
