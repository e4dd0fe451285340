"""Our C++ CPU kernels, built on first use with the machine's C++ compiler and cached.

One library, built (once per source, torch version and CPU) from `paged_attention.cpp`
(`torch.ops.nxdi.paged_decode_attention`), `fused_ops.cpp` (`torch.ops.nxdi.rms_norm`,
`rope_qk`, `rope_qk_store`, `silu_mul`, `topk`), `causal_attention.cpp`
(`torch.ops.nxdi.causal_attention`, context encoding's attention, and `chunk_attention`, a prompt
chunk's over the cache) and `panel_linear.cpp` (`torch.ops.nxdi.panel_linear`, linear layers in
bf16 panels, on AMX tiles where the CPU has them), which share `simd.h`. `paged_attention()` and
`fused_ops()` build and load it. The build needs a C++ compiler and ninja (both on the target
machines; the `ninja` wheel is a dependency); where it fails, `kernels_unavailable_reason()` says
why and the models keep the torch paths. Build output lands under $NXDI_KERNEL_CACHE (default
~/.cache/nxdi_serving/kernels)."""
from __future__ import annotations

import functools
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
# RMSNorm, RoPE, silu * up, the sampler's top-K and context encoding's causal attention on the
# CPU backends (NeuronConfig.cpu_fused_ops resolves to one).
TORCH_OPS, FUSED = "torch", "fused"

_HERE = Path(__file__).parent
_SOURCES = (_HERE / "paged_attention.cpp", _HERE / "fused_ops.cpp",
            _HERE / "causal_attention.cpp", _HERE / "panel_linear.cpp")
_HEADERS = (_HERE / "simd.h", _HERE / "panel_tile.h")
# -ffp-contract=off: a product and a sum stay two roundings, as in the torch ops replaced.
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
_lock = threading.Lock()
_state: dict[str, str | None] = {}  # "error": None once loaded, else why it is unavailable


def kernel_cache_dir() -> Path:
    return Path(os.environ.get("NXDI_KERNEL_CACHE",
                               Path.home() / ".cache" / "nxdi_serving" / "kernels"))


@functools.cache
def _cpuinfo_line(key: str) -> str | None:
    """The first line of /proc/cpuinfo that starts with `key` (None where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(key):
                return line
    except OSError:
        pass
    return None


def _cpu_identity() -> str:
    """The CPU's feature flags: the build uses -march=native, so another CPU builds its own."""
    import platform
    return _cpuinfo_line("flags") or platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """The x86 CPU's feature flags from /proc/cpuinfo (empty elsewhere)."""
    line = _cpuinfo_line("flags")
    return frozenset(line.split(":", 1)[1].split()) if line else frozenset()


@functools.cache
def cpu_is_intel() -> bool:
    """True on Intel CPUs (vendor GenuineIntel in /proc/cpuinfo), where the kernels' defaults
    differ (panel_linear.cpp stream_prefetch and fma_min_rows, paged_attention.cpp
    bf16_dot_attention)."""
    try:
        return "GenuineIntel" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def cpu_family() -> int:
    """The x86 CPU's family from /proc/cpuinfo ("cpu family": AMD Zen 4 25, Zen 5 26; Intel 6),
    0 where it is not listed. panel_linear.cpp's stream_prefetch reads the same from CPUID."""
    line = _cpuinfo_line("cpu family")
    try:
        return int(line.split(":", 1)[1]) if line else 0
    except ValueError:
        return 0


def panels_suit_this_cpu(quantized: bool = False) -> bool:
    """True on x86 CPUs with AVX2 and FMA where our panel kernel beats torch's and oneDNN's
    bfloat16 products (modules/linear.py). Without AMX: without bfloat16 dot products torch's
    GEMM converts element by element and oneDNN cannot pack bfloat16; with AVX512-BF16 (e.g. AMD
    Zen 4) the kernel runs on those dot products and reads a one-row product's weights faster
    than oneDNN. With AMX (Intel Sapphire Rapids and later) the kernel multiplies bfloat16 pairs
    on AMX tiles, faster than oneDNN's packed weights at every row count measured (1 to 512),
    where the library is built for them and Linux grants the tile state; not for `quantized`
    (int8) weights, whose panels widen to float32 there and lose to torch's int8 kernel."""
    flags = cpu_flags()
    if not {"avx2", "fma"} <= flags:
        return False
    if "amx_bf16" not in flags:
        return True
    return not quantized and panel_amx_tiles()


def panel_amx_tiles() -> bool:
    """True where our library is loaded and multiplies bfloat16 pairs on AMX tiles: built for a
    CPU with them, granted the tile state by Linux, and not turned off with
    NXDI_PANEL_AMX_MIN_ROWS=0 (kernels/panel_linear.cpp)."""
    return kernels_unavailable_reason() is None and bool(torch.ops.nxdi.panel_amx_tiles())


def _build_name() -> str:
    digest = hashlib.sha256()
    for path in _SOURCES + _HEADERS:
        digest.update(path.read_bytes())
    for part in (torch.__version__.encode(), _cpu_identity().encode()):
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
    log.info("building the CPU kernels (once per machine) in %s", build_dir)
    cpp_extension.load(name=name, sources=[str(p) for p in _SOURCES], build_directory=str(build_dir),
                       extra_cflags=list(_CFLAGS),
                       extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)


def _wait_for(lock: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while lock.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"another process has been building the kernel for {timeout_s:.0f} s;"
                               f" delete {lock} if that process is gone")
        time.sleep(0.2)


def kernels_unavailable_reason() -> str | None:
    """None when our kernel library is loaded (building it if needed), else why it cannot be (the
    reason is kept: a failed build is not retried in this process)."""
    with _lock:
        if "error" not in _state:
            try:
                _build_and_load()
                _state["error"] = None
            except Exception as exc:  # noqa: BLE001 - compiler/ninja/linker failures all mean "no"
                _state["error"] = f"the C++ kernel could not be built or loaded ({exc})"
                log.warning("CPU kernels unavailable: %s", _state["error"])
        return _state["error"]


def panel_fma_rows() -> int:
    """From how many rows our panel kernel multiplies bfloat16 pairs on float32 FMAs (0: never):
    by default 4 on Intel CPUs with AVX512-BF16 (where vdpbf16ps is half-rate), else 0;
    NXDI_PANEL_FMA_MIN_ROWS decides where set (kernels/panel_linear.cpp). 0 where the library is
    unavailable or not built for AVX512-BF16."""
    if kernels_unavailable_reason() is not None or not torch.ops.nxdi.panel_pairs_native():
        return 0
    return int(torch.ops.nxdi.panel_fma_min_rows())


def library_path() -> Path | None:
    """The file of the kernel library this process loaded, or None where it is unavailable."""
    if kernels_unavailable_reason() is not None:
        return None
    name = _build_name()
    return kernel_cache_dir() / name / f"{name}.so"


def source_files() -> tuple[Path, ...]:
    """The C++ sources compiled into the kernel library (one translation unit each)."""
    return _SOURCES


def compile_flags() -> list[str]:
    """The flags _build gives the compiler besides torch's own (the target: -march=native)."""
    return list(_CFLAGS)


def paged_attention():
    """torch.ops.nxdi.paged_decode_attention, built and loaded; RuntimeError when it cannot be."""
    reason = kernels_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    return torch.ops.nxdi.paged_decode_attention


def fused_ops():
    """torch.ops.nxdi (rms_norm, rope_qk, rope_qk_store, silu_mul, topk, causal_attention), built and loaded;
    RuntimeError when it cannot be."""
    reason = kernels_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    return torch.ops.nxdi
