"""Persistent compile cache (NxD Inference's "Neuron Persistent Cache"): an artifact compiled once is
reused when the backend/compiler version, the model configuration, the bucket, the compiler flags and
the modeling code are all the same."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

_CODE_DIRS = ("models", "modules")


def default_cache_dir() -> Path:
    """$NXDI_COMPILE_CACHE, else ~/.cache/nxdi_serving/compile (read at call time)."""
    env = os.environ.get("NXDI_COMPILE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "nxdi_serving" / "compile"


def code_fingerprint() -> str:
    """Hash of the modeling source: changing the model code invalidates cached graphs."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    files = [root / "model_wrapper.py"] + sorted(
        p for d in _CODE_DIRS for p in (root / d).rglob("*.py"))
    for path in files:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cache_key(*, config_json: str, tag: str, bucket: tuple, backend_version: str,
              compiler_args, code: str, weight_layout: str = "plain",
              attention_kernel: str = "sdpa", fused_ops: str = "torch") -> str:
    payload = json.dumps({"config": config_json, "tag": tag, "bucket": list(bucket),
                          "backend": backend_version, "compiler_args": compiler_args,
                          "code": code, "weight_layout": weight_layout,
                          "attention_kernel": attention_kernel, "fused_ops": fused_ops},
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


class CompileCache:
    """Directory of artifacts named by cache key."""

    def __init__(self, directory: Path | None = None, enabled: bool = True):
        self.directory, self.enabled = Path(directory or default_cache_dir()), enabled
        self.hits = self.misses = 0

    def fetch(self, key: str, suffix: str, dest: Path) -> bool:
        """Copy a cached artifact to dest; False on a miss."""
        src = self.directory / f"{key}{suffix}"
        if not (self.enabled and src.is_file()):
            self.misses += 1
            return False
        shutil.copyfile(src, dest)
        self.hits += 1
        return True

    def store(self, key: str, suffix: str, artifact: Path) -> None:
        if not self.enabled:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".{key}{suffix}.tmp{os.getpid()}"
        shutil.copyfile(artifact, tmp)
        os.replace(tmp, self.directory / f"{key}{suffix}")
