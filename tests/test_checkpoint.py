"""Checkpoint loading and saving in the four layouts NxD Inference accepts."""

import gc
import json
import os
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from nxdi_common import checkpoint
from nxdi_common.checkpoint import (
    CHECKPOINT_FILES,
    CheckpointError,
    UnsafeCheckpointError,
    cast_state_dict,
    detect_checkpoint_format,
    load_state_dict,
    rename_prefix,
    save_state_dict,
)

FORMATS = list(CHECKPOINT_FILES)
SMALL_SHARD_BYTES = 100_000  # the tiny model is ~0.4 MB, so this makes several shards


def tiny_llama(tie_word_embeddings=False):
    """A random 2-layer Llama with GQA (4 query heads, 2 KV heads)."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                         max_position_embeddings=64, tie_word_embeddings=tie_word_embeddings)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def reference(model):
    """The model's own state dict, detached: what every layout must load back exactly."""
    return {name: t.detach() for name, t in model.state_dict().items()}


def assert_same_tensors(loaded, expected):
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert torch.equal(loaded[name], tensor), name


def shard_files(directory):
    return sorted(p.name for p in directory.iterdir() if "-of-" in p.name)


# ------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("fmt", FORMATS)
def test_save_then_load_each_format(tmp_path, reference, fmt, mmap):
    kwargs = {"max_shard_bytes": SMALL_SHARD_BYTES} if fmt.endswith("-sharded") else {}
    entry = save_state_dict(reference, tmp_path / "ckpt", format=fmt, **kwargs)
    assert entry == tmp_path / "ckpt" / CHECKPOINT_FILES[fmt]
    assert detect_checkpoint_format(tmp_path / "ckpt") == fmt
    assert_same_tensors(load_state_dict(tmp_path / "ckpt", mmap=mmap), reference)


@pytest.mark.parametrize("fmt", ["safetensors-sharded", "pickle-sharded"])
def test_sharded_index_layout(tmp_path, reference, fmt):
    save_state_dict(reference, tmp_path, format=fmt, max_shard_bytes=SMALL_SHARD_BYTES)
    index = json.loads((tmp_path / CHECKPOINT_FILES[fmt]).read_text())
    shards = shard_files(tmp_path)
    assert len(shards) >= 2
    assert set(index) == {"metadata", "weight_map"}
    assert index["metadata"] == {"total_size": sum(t.nbytes for t in reference.values())}
    assert sorted(index["weight_map"]) == sorted(reference)
    assert sorted(set(index["weight_map"].values())) == shards
    assert shards[0] == ("model-00001-of-" if fmt.startswith("safe") else "pytorch_model-00001-of-") + \
        f"{len(shards):05d}" + (".safetensors" if fmt.startswith("safe") else ".bin")


@pytest.mark.parametrize("max_shard_size, fmt", [("1GB", "safetensors"), ("100KB", "safetensors-sharded")])
def test_loads_transformers_save_pretrained(tmp_path, model, reference, max_shard_size, fmt):
    model.save_pretrained(tmp_path, max_shard_size=max_shard_size)
    assert detect_checkpoint_format(tmp_path) == fmt
    if fmt.endswith("-sharded"):
        assert len(shard_files(tmp_path)) >= 2
    assert_same_tensors(load_state_dict(tmp_path), reference)


@pytest.mark.parametrize("zipfile_format", [True, False])
def test_loads_plain_torch_save(tmp_path, reference, zipfile_format):
    """transformers 5 no longer writes pickles; torch.save is how such files were made. The
    legacy (pre-zip) format cannot be memory-mapped and is read without mmap."""
    torch.save(reference, tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=zipfile_format)
    assert_same_tensors(load_state_dict(tmp_path, mmap=True), reference)


@pytest.mark.parametrize("fmt", FORMATS)
def test_tied_embeddings_round_trip(tmp_path, fmt):
    state_dict = tiny_llama(tie_word_embeddings=True).state_dict()
    assert state_dict["lm_head.weight"].data_ptr() == state_dict["model.embed_tokens.weight"].data_ptr()
    kwargs = {"max_shard_bytes": SMALL_SHARD_BYTES} if fmt.endswith("-sharded") else {}
    save_state_dict(state_dict, tmp_path, format=fmt, **kwargs)
    assert_same_tensors(load_state_dict(tmp_path), state_dict)


def test_pickle_keeps_tied_storage_shared(tmp_path):
    state_dict = tiny_llama(tie_word_embeddings=True).state_dict()
    save_state_dict(state_dict, tmp_path, format="pickle")
    loaded = load_state_dict(tmp_path)
    assert loaded["lm_head.weight"].data_ptr() == loaded["model.embed_tokens.weight"].data_ptr()


def test_views_are_saved_without_their_base(tmp_path):
    base = torch.arange(1000, dtype=torch.float32)
    state_dict = {"head": base[:10], "strided": base.view(10, 100)[:, 0]}
    for fmt in ("safetensors", "pickle"):
        save_state_dict(state_dict, tmp_path / fmt, format=fmt)
        assert (tmp_path / fmt / CHECKPOINT_FILES[fmt]).stat().st_size < 2000  # not the 4 kB base
        assert_same_tensors(load_state_dict(tmp_path / fmt), state_dict)


# ---------------------------------------------------------------------------------- detect


def test_detect_prefers_safetensors(tmp_path, reference):
    save_state_dict(reference, tmp_path / "a", format="pickle")
    save_state_dict(reference, tmp_path / "b", format="safetensors")
    os.replace(tmp_path / "b" / "model.safetensors", tmp_path / "a" / "model.safetensors")
    assert detect_checkpoint_format(tmp_path / "a") == "safetensors"
    (tmp_path / "a" / "model.safetensors").unlink()
    (tmp_path / "a" / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    assert detect_checkpoint_format(tmp_path / "a") == "safetensors-sharded"


def test_detect_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        detect_checkpoint_format(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_state_dict(tmp_path / "nowhere")


def test_detect_no_checkpoint_lists_accepted_and_found(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError) as excinfo:
        detect_checkpoint_format(tmp_path)
    message = str(excinfo.value)
    for name in CHECKPOINT_FILES.values():
        assert name in message
    assert "config.json" in message and "model.gguf" in message


def test_detect_empty_directory(tmp_path):
    with pytest.raises(ValueError, match="empty directory"):
        detect_checkpoint_format(tmp_path)


# ---------------------------------------------------------------------------------- safety


class RunsCode:
    """Unpickling this calls os.mkdir(path): what a hostile checkpoint would do."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


@pytest.mark.parametrize("mmap", [True, False])
def test_pickle_with_code_is_refused(tmp_path, mmap):
    marker = tmp_path / "code-ran"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    torch.save({"weight": torch.ones(2), "payload": RunsCode(marker)}, ckpt / "pytorch_model.bin")
    assert b"mkdir" in (ckpt / "pytorch_model.bin").read_bytes()  # the payload really is there
    with pytest.raises(UnsafeCheckpointError, match="refused.*for safety.*GLOBAL \\w+\\.mkdir") as excinfo:
        load_state_dict(ckpt, mmap=mmap)
    assert str(ckpt / "pytorch_model.bin") in str(excinfo.value)
    assert not marker.exists()


def test_pickle_must_be_a_tensor_dict(tmp_path):
    torch.save([torch.ones(2)], tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="not a name -> tensor dict"):
        load_state_dict(tmp_path)
    torch.save({"w": torch.ones(2), "step": 3}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="'step' is a int"):
        load_state_dict(tmp_path)


# ---------------------------------------------------------------------------------- corrupt


@pytest.mark.parametrize("fmt", FORMATS)
def test_truncated_file_names_the_file(tmp_path, reference, fmt):
    kwargs = {"max_shard_bytes": SMALL_SHARD_BYTES} if fmt.endswith("-sharded") else {}
    save_state_dict(reference, tmp_path, format=fmt, **kwargs)
    victim = tmp_path / (shard_files(tmp_path)[-1] if kwargs else CHECKPOINT_FILES[fmt])
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as excinfo:
        load_state_dict(tmp_path)
    assert str(victim) in str(excinfo.value)
    assert not isinstance(excinfo.value, UnsafeCheckpointError)


def test_garbage_safetensors_names_the_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"this is not a safetensors file")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_state_dict(tmp_path)


@pytest.mark.parametrize("fmt", ["safetensors-sharded", "pickle-sharded"])
def test_missing_shard_names_it(tmp_path, reference, fmt):
    save_state_dict(reference, tmp_path, format=fmt, max_shard_bytes=SMALL_SHARD_BYTES)
    missing = shard_files(tmp_path)[1]
    (tmp_path / missing).unlink()
    with pytest.raises(CheckpointError, match=f"shard file {missing} listed in .* is missing"):
        load_state_dict(tmp_path)


@pytest.mark.parametrize("fmt", ["safetensors-sharded", "pickle-sharded"])
def test_tensor_listed_but_absent_from_shard(tmp_path, reference, fmt):
    save_state_dict(reference, tmp_path, format=fmt, max_shard_bytes=SMALL_SHARD_BYTES)
    index_path = tmp_path / CHECKPOINT_FILES[fmt]
    index = json.loads(index_path.read_text())
    first_shard = shard_files(tmp_path)[0]
    index["weight_map"]["model.layers.9.ghost.weight"] = first_shard
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"{first_shard}.*model.layers.9.ghost.weight"):
        load_state_dict(tmp_path)


@pytest.mark.parametrize("text", ["{not json", '{"metadata": {}}', '{"weight_map": {"a": 3}}'])
def test_malformed_index_names_it(tmp_path, text):
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        load_state_dict(tmp_path)


def test_shard_outside_the_directory_is_refused(tmp_path):
    (tmp_path / "ckpt").mkdir()
    save_state_dict({"w": torch.ones(2)}, tmp_path / "elsewhere", format="safetensors")
    index = {"weight_map": {"w": "../elsewhere/model.safetensors"}}
    (tmp_path / "ckpt" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="not a plain file name"):
        load_state_dict(tmp_path / "ckpt")


# ------------------------------------------------------------------------------------- mmap


def resident_mib():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def mapped_files():
    with open("/proc/self/maps") as maps:
        return {line.split(maxsplit=5)[-1].strip() for line in maps if "/" in line}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
@pytest.mark.parametrize("fmt", ["safetensors", "pickle"])
def test_mmap_maps_the_file_instead_of_reading_it(tmp_path, fmt):
    """64 MiB of weights: with mmap the file is mapped and almost nothing becomes resident."""
    state_dict = {f"w{i}": torch.ones(4, 1024, 1024) for i in range(4)}
    save_state_dict(state_dict, tmp_path, format=fmt)
    del state_dict
    gc.collect()
    before = resident_mib()
    loaded = load_state_dict(tmp_path, mmap=True)
    assert resident_mib() - before < 16
    assert str(tmp_path / CHECKPOINT_FILES[fmt]) in mapped_files()
    assert not loaded["w0"].untyped_storage().resizable()  # a file mapping, not an allocation
    assert float(loaded["w3"][3, 1023, 1023]) == 1.0


def test_without_mmap_tensors_are_ordinary_memory(tmp_path):
    save_state_dict({"w": torch.ones(8)}, tmp_path)
    loaded = load_state_dict(tmp_path, mmap=False)
    assert loaded["w"].untyped_storage().resizable()
    (tmp_path / "model.safetensors").unlink()
    assert torch.equal(loaded["w"], torch.ones(8))


# ------------------------------------------------------------------------------------- save


def test_failed_save_leaves_nothing(tmp_path, reference, monkeypatch):
    real_write = checkpoint._write_file
    calls = []

    def fail_on_second_shard(tensors, path, kind):
        calls.append(path.name)
        if len(calls) == 2:
            raise OSError("disk full")
        real_write(tensors, path, kind)

    monkeypatch.setattr(checkpoint, "_write_file", fail_on_second_shard)
    with pytest.raises(OSError, match="disk full"):
        save_state_dict(reference, tmp_path / "new", format="safetensors-sharded",
                        max_shard_bytes=SMALL_SHARD_BYTES)
    assert os.listdir(tmp_path) == []


def test_failed_save_keeps_the_old_checkpoint(tmp_path, reference, monkeypatch):
    save_state_dict(reference, tmp_path, format="pickle")
    monkeypatch.setattr(checkpoint, "save_file", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        save_state_dict({"other": torch.zeros(1)}, tmp_path, format="safetensors")
    assert sorted(os.listdir(tmp_path)) == ["pytorch_model.bin"]
    assert_same_tensors(load_state_dict(tmp_path), reference)


def test_save_replaces_the_previous_checkpoint(tmp_path, reference):
    (tmp_path / "config.json").write_text("{}")
    save_state_dict(reference, tmp_path, format="pickle-sharded", max_shard_bytes=SMALL_SHARD_BYTES)
    save_state_dict(reference, tmp_path, format="safetensors")
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    save_state_dict(reference, tmp_path, format="safetensors-sharded", max_shard_bytes=SMALL_SHARD_BYTES)
    assert "model.safetensors" not in os.listdir(tmp_path)
    assert detect_checkpoint_format(tmp_path) == "safetensors-sharded"
    assert_same_tensors(load_state_dict(tmp_path), reference)


def test_save_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="format must be one of"):
        save_state_dict({}, tmp_path, format="gguf")
    with pytest.raises(ValueError, match="format='safetensors-sharded'"):
        save_state_dict({}, tmp_path, format="safetensors", max_shard_bytes=10)
    with pytest.raises(TypeError, match="'step' is a int"):
        save_state_dict({"step": 3}, tmp_path)


# ----------------------------------------------------------------------------- rename / cast


def test_rename_prefix():
    a, b, c = torch.ones(1), torch.zeros(1), torch.ones(2)
    renamed = rename_prefix({"model.layers.0.w": a, "lm_head.weight": b, "model.norm.weight": c}, "model.", "")
    assert list(renamed) == ["layers.0.w", "lm_head.weight", "norm.weight"]
    assert renamed["layers.0.w"] is a and renamed["lm_head.weight"] is b
    assert list(rename_prefix({"model.x": a, "other.model.x": b}, "model.", "decoder.")) == \
        ["decoder.x", "other.model.x"]


def test_rename_prefix_collision():
    with pytest.raises(ValueError, match="two keys to 'norm.weight'"):
        rename_prefix({"norm.weight": torch.ones(1), "model.norm.weight": torch.ones(1)}, "model.", "")


def test_cast_state_dict():
    state_dict = {"w": torch.ones(2), "h": torch.ones(2, dtype=torch.float16), "ids": torch.arange(3),
                  "mask": torch.ones(2, dtype=torch.bool), "q": torch.ones(2, dtype=torch.int8)}
    cast = cast_state_dict(state_dict, torch.bfloat16)
    assert {k: t.dtype for k, t in cast.items()} == {
        "w": torch.bfloat16, "h": torch.bfloat16, "ids": torch.int64, "mask": torch.bool, "q": torch.int8}
    assert state_dict["w"].dtype == torch.float32  # input untouched
    assert cast_state_dict(state_dict, "float16")["w"].dtype == torch.float16
    declared = cast_state_dict(state_dict, torch.bfloat16, cast_type="as-declared")
    assert {k: t.dtype for k, t in declared.items()} == {k: t.dtype for k, t in state_dict.items()}


def test_cast_state_dict_errors():
    with pytest.raises(ValueError, match="cast_type must be one of"):
        cast_state_dict({}, torch.float16, cast_type="auto")
    with pytest.raises(ValueError, match="floating torch dtype"):
        cast_state_dict({}, torch.int8)
    with pytest.raises(ValueError, match="floating torch dtype"):
        cast_state_dict({}, "float17")
