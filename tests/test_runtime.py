"""runtime.keep_large_buffers_in_heap: multi-MiB tensors come from the heap (reused), not from a
fresh mmap per allocation. Checked in fresh processes through glibc's own accounting (mallinfo2:
hblkhd = bytes currently in mmapped chunks)."""
import platform
import subprocess
import sys

import pytest

PROBE = """
import ctypes, sys, torch
from nxdi_common.runtime import keep_large_buffers_in_heap
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
applied = keep_large_buffers_in_heap() if sys.argv[1] == "1" else None
before = libc.mallinfo2().hblkhd
t = torch.ones(20 << 20, dtype=torch.uint8)  # 20 MiB, as a decode step's gathered K or V
print(applied, libc.mallinfo2().hblkhd - before)
"""

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc tuning")


def _mmapped_bytes(apply: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, apply], capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0], int(out[1])


def test_large_tensor_is_mmapped_by_default_and_heap_allocated_when_tuned():
    _, default = _mmapped_bytes("0")
    applied, tuned = _mmapped_bytes("1")
    assert default >= 20 << 20  # the control: glibc's default threshold maps it
    assert applied == "True" and tuned == 0
