"""Regenerate the Python stubs under protos/ from the .proto files there.

    python scripts/gen_protos.py            # rewrite the committed stubs in place
    python scripts/gen_protos.py --out DIR  # write them under DIR instead (tests compare the two)

Runs ``python -m grpc_tools.protoc`` with ``protos/`` as the proto root, so a file
``protos/nxdi/serving/v1/serving.proto`` (package ``nxdi.serving.v1``) yields
``serving_pb2.py``, ``serving_pb2.pyi`` and ``serving_pb2_grpc.py`` next to it. protoc writes
imports between generated modules as if ``protos/`` were on ``sys.path``
(``from nxdi.serving.v1 import serving_pb2``); they are rewritten to work as package imports
(``from protos.nxdi.serving.v1 import serving_pb2, serving_pb2_grpc``): relative within a
directory, absolute under ``protos.`` across directories. Missing ``__init__.py`` files are
created so every directory on the way is a package.

The output depends on the grpcio-tools version (it stamps its protoc and grpcio versions into the
stubs), so regenerate with the pinned grpcio-tools.
"""

from __future__ import annotations

import argparse
import importlib.resources
import re
import subprocess
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parents[1] / "protos"
PY_PACKAGE = "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files(root: Path = PROTO_ROOT) -> list[Path]:
    """All .proto files under ``root``, as paths relative to it, sorted."""
    return sorted(p.relative_to(root) for p in root.rglob("*.proto"))


def run_protoc(root: Path, files: list[Path], out_dir: Path) -> None:
    """Run grpc_tools.protoc on ``files`` (relative to ``root``); write stubs under ``out_dir``."""
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc",
        f"--proto_path={root}", f"--proto_path={well_known}",
        f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}",
        *(str(root / f) for f in files),
    ]
    subprocess.run(cmd, check=True)


def _import_rewrites(files: list[Path], module_dir: Path) -> list[tuple[re.Pattern, str]]:
    """(pattern, replacement) pairs turning protoc's root-relative imports into package imports,
    for a generated module living in ``module_dir`` (relative to the proto root)."""
    rewrites = []
    for f in files:
        dotted = ".".join(f.parent.parts)
        name = f.stem + "_pb2"
        target = "." if f.parent == module_dir else f"{PY_PACKAGE}.{dotted}"
        pattern = re.compile(rf"^from {re.escape(dotted)} import {name}\b", re.MULTILINE)
        rewrites.append((pattern, f"from {target} import {name}"))
    return rewrites


def fix_imports(out_dir: Path, files: list[Path]) -> None:
    """Rewrite imports between generated modules so they work under the ``protos`` package."""
    for f in files:
        rewrites = _import_rewrites(files, f.parent)
        for suffix in GENERATED_SUFFIXES:
            path = out_dir / f.parent / (f.stem + suffix)
            text = path.read_text()
            for pattern, replacement in rewrites:
                text = pattern.sub(replacement, text)
            path.write_text(text)


def ensure_packages(out_dir: Path, files: list[Path]) -> None:
    """Create an empty ``__init__.py`` in every directory from ``out_dir`` down to each stub."""
    for f in files:
        directory = out_dir
        for part in ("",) + f.parent.parts:
            directory = directory / part if part else directory
            init = directory / "__init__.py"
            if not init.exists():
                init.write_text("")


def generated_files(out_dir: Path) -> dict[str, bytes]:
    """Every generated stub under ``out_dir``: relative POSIX path -> contents."""
    return {
        p.relative_to(out_dir).as_posix(): p.read_bytes()
        for p in sorted(out_dir.rglob("*"))
        if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)
    }


def generate(out_dir: Path = PROTO_ROOT, root: Path = PROTO_ROOT) -> list[str]:
    """Regenerate all stubs from the protos under ``root`` into ``out_dir``; return their paths."""
    files = proto_files(root)
    if not files:
        raise FileNotFoundError(f"no .proto files under {root}")
    out_dir.mkdir(parents=True, exist_ok=True)
    run_protoc(root, files, out_dir)
    fix_imports(out_dir, files)
    ensure_packages(out_dir, files)
    return sorted(generated_files(out_dir))


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT,
                        help="directory to write the stubs under (default: protos/ itself)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(args.out / path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
