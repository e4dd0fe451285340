"""Process-wide settings for running the graphs on CPU.

glibc serves an allocation above its mmap threshold with a fresh mmap and unmaps it on free; the
threshold adapts as the program runs (128 KiB, rising with freed chunks up to 32 MiB). Token
generation allocates several MiB per layer per step (the K and V gathered from the block cache:
12.6 MB each for 16 sequences of 2048 tokens of SmolLM2). When those land above the threshold,
every one of them page-faults in afresh on every step, and whether they do depends on the order of
earlier allocations: a harmless change to the model code once doubled a 16 x 2048 decode step
(224 -> 504 ms, bench/bench_tkg_step.py). Fixing both thresholds keeps such buffers in the heap,
where they are reused, and makes step time independent of allocation history."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import os
import platform

import torch

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20   # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD = 256 << 20  # free heap kept before memory is returned to the system


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def keep_large_buffers_in_heap() -> bool:
    """Pin glibc's mmap and trim thresholds (see module doc). True when applied; False on a C
    library without mallopt (then nothing changes)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = _libc()
        ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    except (OSError, AttributeError) as exc:
        log.debug("mallopt unavailable: %s", exc)
        return False
    return ok


HUGE_PAGE = 2 << 20   # x86-64's transparent huge page
_MADV_HUGEPAGE = 14   # linux/mman.h
_ALIGN = 64           # tensors handed out start on a cache line
HUGE_PAGES_ENV = "NXDI_HUGE_PAGES"  # "0": HugePageArena falls back to 4 KiB pages (comparisons)


class HugePageArena:
    """Tensors in one anonymous mapping on transparent huge pages, for what every step streams
    through (the packed weights). The mapping is 2 MiB aligned and madvised MADV_HUGEPAGE before
    anything touches it, so Linux (transparent_hugepage "madvise" or "always") backs it with
    2 MiB pages as it is written: reading the 269 MB of the bundled model's packed weights then
    takes one TLB entry per 2 MiB instead of per 4 KiB, and a batch-1 decode step's products ran
    1.07-1.10x faster on the Zen 4 VM (bench/bench_step_split.py; BENCHMARKS.md, session 28).
    Where madvise is refused (no THP, not Linux, or NXDI_HUGE_PAGES=0) the mapping is ordinary
    memory: `huge` says which.

    take() hands out tensors front to back, each 64-byte aligned; they keep the mapping alive
    (torch.frombuffer holds its buffer), so the arena object itself may be dropped."""

    def __init__(self, nbytes: int):
        if nbytes < 0:
            raise ValueError(f"HugePageArena: nbytes must be >= 0, got {nbytes}")
        pages = max(-(-nbytes // HUGE_PAGE), 1) * HUGE_PAGE  # whole huge pages from `start`
        self._map = mmap.mmap(-1, pages + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._view = memoryview(self._map)
        address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._next = (-address) % HUGE_PAGE
        self._end = self._next + nbytes
        self.huge = _madvise_huge(address + self._next, pages)

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor of `shape` and `dtype` from the arena's next free bytes."""
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        start = -(-self._next // _ALIGN) * _ALIGN
        if start + nbytes > self._end:
            raise ValueError(f"HugePageArena: {nbytes} bytes asked with "
                             f"{max(self._end - start, 0)} left")
        self._next = start + nbytes
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self._view[start:start + nbytes], dtype=dtype).view(shape)

    @staticmethod
    def size_of(shapes_and_dtypes) -> int:
        """Bytes an arena needs for tensors of these (shape, dtype), alignment included."""
        total = 0
        for shape, dtype in shapes_and_dtypes:
            total = -(-total // _ALIGN) * _ALIGN + math.prod(shape) * dtype.itemsize
        return total


def _madvise_huge(address: int, length: int) -> bool:
    if os.environ.get(HUGE_PAGES_ENV, "1") == "0" or platform.system() != "Linux":
        return False
    try:
        libc = _libc()
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise(address, length, _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError) as exc:
        log.debug("madvise unavailable: %s", exc)
        return False


def huge_page_zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) in its own HugePageArena: for the KV cache, which decode
    steps stream through like the weights. Written once here, as torch.zeros does, so all of it
    is resident from the start (a worker that lacks the memory fails at load, not under load)."""
    return HugePageArena(HugePageArena.size_of([(shape, dtype)])).take(shape, dtype).zero_()
