"""Weights as graph inputs. Traced graphs take the model's parameters as one tuple input instead of
embedding them, so each per-bucket artifact is small and all buckets (and both sub-models) share
one copy of the weights, loaded memory-mapped — the NEFF-plus-weights split of NxD Inference."""
from __future__ import annotations

import contextlib

from torch import nn


def unique_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) once per distinct parameter (tied weights appear once), in module order."""
    return list(model.named_parameters(remove_duplicate=True))


def weights_tuple(model: nn.Module) -> tuple:
    return tuple(p.detach() for _, p in unique_parameters(model))


def _slots(model: nn.Module):
    """(module, leaf name, index into weights_tuple) for every parameter reference, aliases too."""
    index = {id(p): i for i, (_, p) in enumerate(unique_parameters(model))}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for leaf, param in module._parameters.items():
            if param is not None:
                yield module, leaf, index[id(param)]


@contextlib.contextmanager
def swapped_parameters(model: nn.Module, weights: tuple):
    """Within the block, every parameter of `model` is replaced by the matching tensor of
    `weights` (so a tracer sees them as inputs); restored afterwards."""
    saved = []
    try:
        for module, leaf, i in list(_slots(model)):
            saved.append((module, leaf, module._parameters[leaf]))
            module._parameters[leaf] = weights[i]
        yield
    finally:
        for module, leaf, old in reversed(saved):
            module._parameters[leaf] = old
