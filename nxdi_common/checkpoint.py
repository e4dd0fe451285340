"""HF checkpoints on disk: safetensors and pickle, single and sharded (``*.index.json``).

The four layouts are the ones NxD Inference's "Checkpoint support" accepts in a model path:

=====================  ==============================
format                 file that marks it
=====================  ==============================
safetensors            model.safetensors
safetensors-sharded    model.safetensors.index.json
pickle                 pytorch_model.bin
pickle-sharded         pytorch_model.bin.index.json
=====================  ==============================

safetensors files are memory-mapped (pages are read when a tensor is first touched). Pickles are
only ever read with ``torch.load(weights_only=True)``: a pickle that needs anything but tensors
and plain containers to rebuild is refused, because building it could run arbitrary code.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import secrets
import zipfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
PICKLE_NAME = "pytorch_model.bin"
PICKLE_INDEX_NAME = "pytorch_model.bin.index.json"

# Format name -> the file that marks it, in order of preference (safetensors first).
CHECKPOINT_FILES = {
    "safetensors": SAFETENSORS_NAME,
    "safetensors-sharded": SAFETENSORS_INDEX_NAME,
    "pickle": PICKLE_NAME,
    "pickle-sharded": PICKLE_INDEX_NAME,
}
# Shard file names are f"{stem}-00001-of-00003{suffix}", as transformers writes them.
_SHARD_STEM_SUFFIX = {"safetensors": ("model", ".safetensors"), "pickle": ("pytorch_model", ".bin")}
# Globs for every file a checkpoint of either kind may consist of (replaced on save).
_CHECKPOINT_GLOBS = ("model.safetensors*", "model-*-of-*.safetensors",
                     "pytorch_model.bin*", "pytorch_model-*-of-*.bin")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' historical default shard size ("5GB")
CAST_TYPES = ("config", "as-declared")


class CheckpointError(ValueError):
    """A checkpoint file is unreadable, malformed, or does not match its index."""


class UnsafeCheckpointError(CheckpointError):
    """A pickle checkpoint needs more than tensors to rebuild, so it was refused for safety."""


# --------------------------------------------------------------------------------------- detect


def detect_checkpoint_format(model_path: str | os.PathLike) -> str:
    """Name the checkpoint layout in ``model_path`` (a key of ``CHECKPOINT_FILES``).

    safetensors wins when several are present. Raises FileNotFoundError when the directory is
    missing and ValueError (listing the accepted names and what was found) when none is there.
    """
    directory = Path(model_path)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {directory}")
    for fmt, name in CHECKPOINT_FILES.items():
        if (directory / name).is_file():
            return fmt
    found = sorted(entry.name for entry in directory.iterdir())
    shown = ", ".join(found[:20]) + (f", ... ({len(found)} entries)" if len(found) > 20 else "")
    raise ValueError(
        f"no checkpoint in {directory}: expected one of {', '.join(CHECKPOINT_FILES.values())}; "
        f"found {shown or 'an empty directory'}"
    )


# ----------------------------------------------------------------------------------------- load


def load_state_dict(model_path: str | os.PathLike, *, mmap: bool = True) -> dict[str, torch.Tensor]:
    """Load the checkpoint in ``model_path`` (any of the four layouts) as a name -> tensor dict.

    With ``mmap`` the tensors are views of memory-mapped files (nothing is read until touched);
    without it they are copies in ordinary memory. Raises CheckpointError naming the file for a
    corrupt file, a missing shard or a tensor the index lists but its shard lacks.
    """
    directory = Path(model_path)
    fmt = detect_checkpoint_format(directory)
    path = directory / CHECKPOINT_FILES[fmt]
    if fmt.endswith("-sharded"):
        return _load_sharded(path, mmap)
    return _load_file(path, mmap)


def _load_file(path: Path, mmap: bool) -> dict[str, torch.Tensor]:
    """Load one safetensors or pickle file, chosen by its suffix."""
    if path.name.endswith(".safetensors"):
        return _load_safetensors(path, mmap)
    return _load_pickle(path, mmap)


def _load_safetensors(path: Path, mmap: bool) -> dict[str, torch.Tensor]:
    """Read a safetensors file through ``safe_open``, which maps the file rather than reading it."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"cannot read safetensors file {path}: {err}") from err
    if not mmap:
        tensors = {name: tensor.clone() for name, tensor in tensors.items()}
    return tensors


def _load_pickle(path: Path, mmap: bool) -> dict[str, torch.Tensor]:
    """Read a torch pickle with ``weights_only=True``; anything else in it is refused."""
    use_mmap = mmap and zipfile.is_zipfile(path)  # legacy (pre-zip) pickles cannot be mapped
    try:
        loaded = torch.load(path, weights_only=True, mmap=use_mmap, map_location="cpu")
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(
            f"refused to load {path} for safety: it needs more than tensors to unpickle, and "
            f"building arbitrary objects could run code. Convert it to safetensors where the "
            f"file is trusted. ({_unpickler_reason(err)})"
        ) from err
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        raise CheckpointError(f"cannot read pickle checkpoint {path}: {err}") from err
    return _require_tensor_dict(loaded, path)


def load_pickle_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """One torch pickle file of tensors (weights_only=True), memory-mapped when possible."""
    return _load_pickle(Path(path), mmap=True)


def _unpickler_reason(err: pickle.UnpicklingError) -> str:
    """The line of torch's long weights-only error that names what was blocked."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    blocked = [line for line in lines if "GLOBAL" in line or "Unsupported" in line]
    return (blocked or lines or [type(err).__name__])[0]


def _require_tensor_dict(loaded: object, path: Path) -> dict[str, torch.Tensor]:
    """Check a loaded pickle is a flat name -> tensor dict."""
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{path} holds a {type(loaded).__name__}, not a name -> tensor dict")
    for name, value in loaded.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"{path}: entry {name!r} is a {type(value).__name__}, not a tensor (a state dict is "
                f"a flat name -> tensor dict)"
            )
    return loaded


def _load_sharded(index_path: Path, mmap: bool) -> dict[str, torch.Tensor]:
    """Load every shard an index names, once each, keeping the index's tensor order."""
    weight_map = _read_weight_map(index_path)
    names_by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        names_by_shard.setdefault(shard, []).append(name)
    loaded: dict[str, torch.Tensor] = {}
    for shard, names in names_by_shard.items():
        shard_path = _shard_path(index_path, shard)
        tensors = _load_file(shard_path, mmap)
        missing = [name for name in names if name not in tensors]
        if missing:
            raise CheckpointError(
                f"{index_path.name} places {len(missing)} tensor(s) in {shard}, but {shard_path} "
                f"lacks them: {', '.join(missing[:5])}"
            )
        loaded.update((name, tensors[name]) for name in names)
    return {name: loaded[name] for name in weight_map}


def _read_weight_map(index_path: Path) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file name) of a sharded checkpoint's index."""
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read checkpoint index {index_path}: {err}") from err
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{index_path} has no 'weight_map' object of tensor name -> shard file")
    return weight_map


def _shard_path(index_path: Path, shard: str) -> Path:
    """The path of a shard named in an index; it must be a plain file name next to the index."""
    if Path(shard).name != shard or shard in ("", ".", ".."):
        raise CheckpointError(f"{index_path} names shard {shard!r}, which is not a plain file name")
    path = index_path.parent / shard
    if not path.is_file():
        raise CheckpointError(f"shard file {shard} listed in {index_path.name} is missing from {path.parent}")
    return path


# --------------------------------------------------------------------------------------- rename


def rename_prefix(state_dict: dict[str, torch.Tensor], old_prefix: str, new_prefix: str) -> dict[str, torch.Tensor]:
    """Replace ``old_prefix`` with ``new_prefix`` on the keys that start with it (order kept).

    This is the ``_STATE_DICT_MODEL_PREFIX`` -> ``_NEW_STATE_DICT_MODEL_PREFIX`` rename of
    ``get_state_dict`` (for example ``"model."`` -> ``""``). Raises ValueError when two keys
    would end up with the same name.
    """
    renamed: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        new_name = new_prefix + name[len(old_prefix):] if name.startswith(old_prefix) else name
        if new_name in renamed:
            raise ValueError(
                f"renaming prefix {old_prefix!r} -> {new_prefix!r} maps two keys to {new_name!r}"
            )
        renamed[new_name] = tensor
    return renamed


# ----------------------------------------------------------------------------------------- cast


def cast_state_dict(state_dict: dict[str, torch.Tensor], dtype: torch.dtype | str,
                    cast_type: str = "config") -> dict[str, torch.Tensor]:
    """Apply NeuronConfig's ``cast_type`` to a state dict (a new dict; inputs are not modified).

    ``"config"`` casts every floating-point tensor to ``dtype`` (the config's ``torch_dtype``);
    ``"as-declared"`` keeps each tensor's own dtype. Integer and bool tensors are never cast.
    """
    if cast_type not in CAST_TYPES:
        raise ValueError(f"cast_type must be one of {CAST_TYPES}, got {cast_type!r}")
    if cast_type == "as-declared":
        return dict(state_dict)
    target = _as_dtype(dtype)
    return {name: t.to(target) if t.is_floating_point() else t for name, t in state_dict.items()}


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A floating torch dtype from a dtype or its name ("bfloat16", "torch.float16")."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"cast dtype must be a floating torch dtype, got {dtype!r}")
    return dtype


# ----------------------------------------------------------------------------------------- save


def save_state_dict(state_dict: dict[str, torch.Tensor], directory: str | os.PathLike, *,
                    format: str = "safetensors", max_shard_bytes: int | None = None) -> Path:
    """Write ``state_dict`` into ``directory`` in one of the four layouts; returns the entry file.

    Sharded layouts split at ``max_shard_bytes`` (default ``DEFAULT_MAX_SHARD_BYTES``) and write
    ``{"metadata": {"total_size": N}, "weight_map": {...}}``. Files are written to a staging
    directory first: a new directory appears whole by one rename; into an existing one the entry
    file (the single file or the index) is moved in last, and older checkpoint files of either
    kind are removed so the directory holds exactly this checkpoint. Tensors that share storage
    are cloned for safetensors (which refuses shared storage).
    """
    if format not in CHECKPOINT_FILES:
        raise ValueError(f"format must be one of {tuple(CHECKPOINT_FILES)}, got {format!r}")
    sharded = format.endswith("-sharded")
    if max_shard_bytes is not None and not sharded:
        raise ValueError(f"max_shard_bytes applies to sharded formats: pass format='{format}-sharded'")
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    kind = format.removesuffix("-sharded")
    tensors = _owned_tensors(state_dict, keep_shared=kind == "pickle")
    directory = Path(directory)
    staging = make_staging_dir(directory)
    try:
        if sharded:
            _write_sharded(tensors, staging, kind, max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)
        else:
            _write_file(tensors, staging / CHECKPOINT_FILES[format], kind)
        _publish(staging, directory, entry=CHECKPOINT_FILES[format])
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory / CHECKPOINT_FILES[format]


def make_staging_dir(target: Path) -> Path:
    """Create an empty hidden directory next to ``target`` to write into before renaming.

    Its name is ``.{target name}.staging-{pid}-{random}``: on the same file system as ``target``
    (so the rename is atomic), and it tells which process made it.
    """
    staging = target.parent / f".{target.name}.staging-{os.getpid()}-{secrets.token_hex(4)}"
    staging.mkdir(parents=True)  # mode 0o777 less the umask, like any directory the user makes
    return staging


def _owned_tensors(state_dict: dict[str, torch.Tensor], keep_shared: bool) -> dict[str, torch.Tensor]:
    """Detached tensors that each cover their whole storage, cloning where needed.

    A view of a larger storage is cloned (torch.save would write the whole storage; safetensors
    refuses it). A second tensor on an already-seen storage (tied weights) is cloned unless
    ``keep_shared``: torch.save stores shared storage once and restores it shared.
    """
    owned: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state dict entry {name!r} is a {type(tensor).__name__}, not a tensor")
        tensor = tensor.detach().cpu()
        storage = tensor.untyped_storage()
        partial = not tensor.is_contiguous() or tensor.nbytes != storage.nbytes()
        shared = tensor.numel() > 0 and storage.data_ptr() in seen
        if partial or (shared and not keep_shared):
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        seen.add(tensor.untyped_storage().data_ptr())
        owned[name] = tensor
    return owned


def _write_file(tensors: dict[str, torch.Tensor], path: Path, kind: str) -> None:
    """Write one safetensors or pickle file."""
    if kind == "safetensors":
        save_file(tensors, str(path), metadata={"format": "pt"})  # transformers requires "format"
    else:
        torch.save(tensors, path)


def _write_sharded(tensors: dict[str, torch.Tensor], staging: Path, kind: str, max_shard_bytes: int) -> None:
    """Write the shards, then the index that names them."""
    stem, suffix = _SHARD_STEM_SUFFIX[kind]
    shards = _split_shards(tensors, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for number, names in enumerate(shards, start=1):
        file_name = f"{stem}-{number:05d}-of-{len(shards):05d}{suffix}"
        _write_file({name: tensors[name] for name in names}, staging / file_name, kind)
        weight_map.update(dict.fromkeys(names, file_name))
    total_size = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    index_name = CHECKPOINT_FILES[f"{kind}-sharded"]
    (staging / index_name).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def _split_shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Group tensor names, in order, into shards of at most ``max_shard_bytes`` (a tensor larger
    than that gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += tensor.nbytes
    return shards


def _publish(staging: Path, directory: Path, entry: str) -> None:
    """Move the staged files into ``directory``: by one rename if it is new, else file by file
    with ``entry`` last, then drop older checkpoint files the new checkpoint does not include."""
    if not directory.exists():
        os.rename(staging, directory)
        return
    new_files = sorted(p.name for p in staging.iterdir())
    for name in sorted(new_files, key=lambda n: n == entry):
        os.replace(staging / name, directory / name)
    for pattern in _CHECKPOINT_GLOBS:
        for stale in directory.glob(pattern):
            if stale.name not in new_files:
                stale.unlink()
