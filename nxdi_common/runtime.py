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
import logging
import platform

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20   # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD = 256 << 20  # free heap kept before memory is returned to the system


def keep_large_buffers_in_heap() -> bool:
    """Pin glibc's mmap and trim thresholds (see module doc). True when applied; False on a C
    library without mallopt (then nothing changes)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    except (OSError, AttributeError) as exc:
        log.debug("mallopt unavailable: %s", exc)
        return False
    return ok
