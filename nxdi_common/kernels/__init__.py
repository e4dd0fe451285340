"""Our C++ CPU kernels, built on first use with the machine's C++ compiler and cached.

`paged_attention()` builds (once per source, torch version and CPU) and loads
`paged_attention.cpp`, which registers `torch.ops.nxdi.paged_decode_attention`. The build needs a
C++ compiler and ninja (both on the target machines; the `ninja` wheel is a dependency); where it
fails, `paged_attention_unavailable_reason()` says why and the models keep the torch attention path.
Build output lands under $NXDI_KERNEL_CACHE (default ~/.cache/nxdi_serving/kernels)."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Token generation's attention on the CPU backends (NeuronConfig.cpu_attention_kernel resolves to
# one): gather the blocks and run torch SDPA, or the paged kernel.
SDPA, PAGED = "sdpa", "paged"

_SOURCE = Path(__file__).with_name("paged_attention.cpp")
_lock = threading.Lock()
_state: dict[str, str | None] = {}  # "error": None once loaded, else why it is unavailable


def kernel_cache_dir() -> Path:
    return Path(os.environ.get("NXDI_KERNEL_CACHE",
                               Path.home() / ".cache" / "nxdi_serving" / "kernels"))


def _cpu_identity() -> str:
    """The CPU's feature flags: the build uses -march=native, so another CPU builds its own."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def _build_name() -> str:
    digest = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), torch.__version__.encode(), _cpu_identity().encode()):
        digest.update(part)
    return f"nxdi_paged_attention_{digest.hexdigest()[:16]}"


def _build_and_load() -> None:
    """Load the built library, building it first when missing. Several processes may start at
    once (a launcher's workers): one builds under a lock file, the others wait for it."""
    name = _build_name()
    build_dir = kernel_cache_dir() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    built, lock = build_dir / f"{name}.so", build_dir / "nxdi-build.lock"
    if not built.is_file():
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            _wait_for(lock)
        else:
            try:
                if not built.is_file():
                    _build(name, build_dir)
            finally:
                os.close(fd)
                lock.unlink()
    torch.ops.load_library(str(built))


def _build(name: str, build_dir: Path) -> None:
    from torch.utils import cpp_extension

    # ninja from the `ninja` wheel lives beside this interpreter; the venv may not be on PATH.
    bindir = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None:
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    log.info("building the paged attention kernel (once per machine) in %s", build_dir)
    cpp_extension.load(name=name, sources=[str(_SOURCE)], build_directory=str(build_dir),
                       extra_cflags=["-O3", "-march=native", "-fopenmp"],
                       extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)


def _wait_for(lock: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while lock.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"another process has been building the kernel for {timeout_s:.0f} s;"
                               f" delete {lock} if that process is gone")
        time.sleep(0.2)


def paged_attention_unavailable_reason() -> str | None:
    """None when torch.ops.nxdi.paged_decode_attention is loaded (building it if needed), else why
    it cannot be (the reason is kept: a failed build is not retried in this process)."""
    with _lock:
        if "error" not in _state:
            try:
                _build_and_load()
                _state["error"] = None
            except Exception as exc:  # noqa: BLE001 - compiler/ninja/linker failures all mean "no"
                _state["error"] = f"the C++ kernel could not be built or loaded ({exc})"
                log.warning("paged attention kernel unavailable: %s", _state["error"])
        return _state["error"]


def paged_attention():
    """torch.ops.nxdi.paged_decode_attention, built and loaded; RuntimeError when it cannot be."""
    reason = paged_attention_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    return torch.ops.nxdi.paged_decode_attention
