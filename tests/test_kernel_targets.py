"""The kernel library's C++ compiles for every x86 target its preprocessor branches serve, not
only for this machine's: the build uses -march=native, so a CPU-specific name used outside its
guard breaks the build on other CPUs only (57c49ee did that: the library failed to build on an
AMD Zen 3, AVX2 only, and 370 tests there failed, while the suite passed on the Intel VM it was
written on)."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest

from nxdi_common import kernels

# One target for each set of branches in the sources: scalar C++; AVX2 + FMA; AVX-512 without
# bf16 dot products; AVX512-BF16 without AMX; AMX.
TARGETS = ("x86-64", "x86-64-v3", "icelake-server", "cooperlake", "sapphirerapids")


def _compiler() -> str:
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the kernels' SIMD branches are x86's")
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    return compiler


def _syntax_check(compiler: str, march: str, source) -> tuple[str, int, str]:
    from torch.utils import cpp_extension

    flags = [f for f in kernels.compile_flags() if not f.startswith(("-march=", "-O"))]
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    cmd = [compiler, "-fsyntax-only", "-std=c++20", f"-march={march}", *flags,
           "-DTORCH_EXTENSION_NAME=nxdi_check", "-DTORCH_API_INCLUDE_EXTENSION_H",
           *(f for path in includes for f in ("-isystem", path)), str(source)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    return march, done.returncode, done.stderr


def test_every_source_compiles_for_every_targeted_cpu(tmp_path):
    """All sources as one translation unit a target: torch's headers, most of a source's compile
    time, are parsed once a target instead of once a source (on a 2-core AMD Zen 1, 20 checks of
    ~10 s each took 122 s; one unit of the four sources 12 s). A source that leans on another's
    includes is still caught: the real build (-march=native) compiles each source alone, and
    nearly every test needs it. The compiler's messages name the source of each error."""
    compiler = _compiler()
    sources = kernels.source_files()
    unit = tmp_path / "all_kernels.cpp"
    unit.write_text("".join(f'#include "{source}"\n' for source in sources))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(lambda march: _syntax_check(compiler, march, unit), TARGETS))
    failures = [f"-march={march} ({', '.join(s.name for s in sources)}):\n{stderr[-3000:]}"
                for march, code, stderr in results if code != 0]
    assert not failures, "\n\n".join(failures)
    assert len(results) == len(TARGETS) and len(sources) >= 4
