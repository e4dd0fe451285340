"""runtime.HugePageArena / huge_page_zeros: tensors packed into one mapping on transparent huge
pages (the packed weights of pack_linear_weights, the KV cache), checked through the kernel's own
accounting (/proc/self/smaps: AnonHugePages of the mapping that holds them)."""
import gc
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from nxdi_common import kernels
from nxdi_common.modules.linear import (PANELS, Linear, pack_linear_weights, pack_panels,
                                       panels_shape)
from nxdi_common.runtime import HUGE_PAGE, HugePageArena, huge_page_zeros

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(
    platform.system() != "Linux" or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages are off or absent here")


def anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (0 if none)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= address < hi:
                for field in lines[i + 1:]:
                    if field.startswith("AnonHugePages:"):
                        return int(field.split()[1])
    return 0


def test_take_hands_out_aligned_disjoint_tensors_that_outlive_the_arena():
    shapes = [((3, 5), torch.bfloat16), ((1000,), torch.float32), ((7,), torch.int8),
              ((0, 4), torch.float16), ((2, 2), torch.float8_e4m3fn)]
    arena = HugePageArena(HugePageArena.size_of(shapes))
    tensors = [arena.take(shape, dtype) for shape, dtype in shapes]
    for t, (shape, dtype) in zip(tensors, shapes):
        assert tuple(t.shape) == shape and t.dtype == dtype
    live = [t for t in tensors if t.numel()]
    assert all(t.data_ptr() % 64 == 0 for t in live)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in live)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert live[0].data_ptr() % HUGE_PAGE == 0  # the mapping starts on a huge page
    for i, t in enumerate(live):
        t.view(torch.uint8).fill_(i + 1)
    with pytest.raises(ValueError, match="bytes asked"):
        arena.take((1,), torch.uint8)  # sized exactly: nothing left
    del arena
    gc.collect()
    junk = [torch.full((1 << 16,), 9, dtype=torch.uint8) for _ in range(64)]
    for i, t in enumerate(live):
        assert bool((t.view(torch.uint8) == i + 1).all())
    assert junk


def test_size_of_counts_alignment():
    assert HugePageArena.size_of([((1,), torch.uint8), ((1,), torch.uint8)]) == 65
    with pytest.raises(ValueError, match="nbytes"):
        HugePageArena(-1)


def test_huge_page_zeros_reads_as_zeros():
    for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn):
        t = huge_page_zeros((3, 64, 5), dtype)
        assert t.shape == (3, 64, 5) and t.dtype == dtype and not t.float().any()


@needs_thp
def test_arena_is_backed_by_huge_pages_once_written():
    arena = HugePageArena(8 * HUGE_PAGE)
    assert arena.huge
    t = arena.take((8 * HUGE_PAGE,), torch.uint8)
    t.fill_(1)
    assert anon_huge_kib(t.data_ptr()) >= HUGE_PAGE // 1024


def test_the_switch_turns_huge_pages_off():
    code = ("from nxdi_common.runtime import HugePageArena; import torch; "
            "a = HugePageArena(1 << 22); print(a.huge)")
    env = {**os.environ, "NXDI_HUGE_PAGES": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False"]


def test_pack_panels_into_out_and_refuses_a_wrong_out():
    w = torch.randn(40, 33).bfloat16()
    for pairs in (False, True):
        want = pack_panels(w, pairs)
        out = torch.full(panels_shape(40, 33, pairs), 7.0, dtype=torch.bfloat16)
        got = pack_panels(w, pairs, out)
        assert got.data_ptr() == out.data_ptr() and torch.equal(got, want)
    with pytest.raises(ValueError, match="out must be"):
        pack_panels(w, False, torch.empty(2, 33, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be"):
        pack_panels(w, False, torch.empty(panels_shape(40, 33, False), dtype=torch.float32))


@needs_thp
@pytest.mark.skipif(kernels.kernels_unavailable_reason() is not None,
                    reason="the panel kernel does not build here")
def test_pack_linear_weights_puts_every_panel_in_one_huge_page_mapping():
    torch.manual_seed(0)
    model = nn.Sequential(*[Linear(1024, 1024 + 16 * (i % 2), bias=False)
                            for i in range(8)]).to(torch.bfloat16)
    x = torch.randn(3, 1024).bfloat16()
    want = model[1](model[0](x)).float()
    assert pack_linear_weights(model, PANELS) == 8
    weights = [m.weight for m in model]
    assert all(w.dim() == 3 for w in weights)
    starts = [w.data_ptr() for w in weights]
    assert starts == sorted(starts) and all(s % 64 == 0 for s in starts)
    end = starts[-1] + weights[-1].numel() * weights[-1].element_size()
    assert end - starts[0] < 2 * sum(w.numel() * w.element_size() for w in weights)
    assert anon_huge_kib(starts[0]) >= HUGE_PAGE // 1024
    got = model[1](model[0](x)).float()
    assert torch.allclose(got, want, atol=0.05, rtol=0.02)


@needs_thp
@pytest.mark.skipif(kernels.kernels_unavailable_reason() is not None,
                    reason="the panel kernel does not build here")
def test_int8_panels_share_the_arena():
    from nxdi_common.modules.quantization import QuantizedLinear
    torch.manual_seed(0)
    q = QuantizedLinear(1024, 2048, bias=False, dtype=torch.bfloat16)
    q.weight.copy_(torch.randint(-127, 128, (2048, 1024), dtype=torch.int8))
    q.scale.copy_(torch.rand(2048).bfloat16() / 100)
    model = nn.Sequential(Linear(1024, 1024, bias=False).to(torch.bfloat16), q)
    x = torch.randn(2, 1024).bfloat16()
    want = model(x).float()
    assert pack_linear_weights(model, PANELS) == 2
    bf16, int8 = model[0].weight, model[1].weight
    assert bf16.dim() == 3 and int8.dim() == 3 and int8.dtype == torch.int8
    gap = int8.data_ptr() - (bf16.data_ptr() + bf16.numel() * bf16.element_size())
    assert 0 <= gap < 64  # packed next to each other, in the same mapping
    assert anon_huge_kib(int8.data_ptr()) >= HUGE_PAGE // 1024
    assert torch.allclose(model(x).float(), want, atol=0.05, rtol=0.02)
