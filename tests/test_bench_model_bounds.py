"""bench/bench_model.py's read bounds: the KV bytes a decode step reads per row, and batch 16 set
against the bound of everything its steps read (weights and 16 rows' caches)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench_model():
    spec = importlib.util.spec_from_file_location("bench_model", ROOT / "bench" / "bench_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kv_bytes_per_row_follow_the_layout(bench_model, tmp_path):
    """Block layout: the positions each step attends to (512..639, 576.5 on average); flat: the
    whole 640-position bucket. Layers x (K, V) x KV heads x head_dim x dtype bytes a position;
    head_dim from config or hidden_size / heads."""
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
         "hidden_size": 576}))
    per_position = 30 * 2 * 3 * 64 * 2
    assert bench_model.kv_bytes_per_row(str(tmp_path), torch.bfloat16, "block") == int(
        per_position * 576.5)
    flat = bench_model.kv_bytes_per_row(str(tmp_path), torch.float32, "flat")
    assert flat == 2 * per_position * 640
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "head_dim": 32}))
    flat = bench_model.kv_bytes_per_row(str(tmp_path), torch.bfloat16, "flat")
    assert flat == 2 * 2 * 4 * 32 * 2 * 640


def test_read_bound_shares(bench_model):
    """Batch B's bound is B x bandwidth / (weights + B x KV a row)."""
    shares = bench_model.read_bound_shares(20.0, 100_000_000, 10_000_000, {1: 90.0, 16: 700.0})
    assert shares["b1_share_of_read_bound"] == pytest.approx(90.0 / (20e9 / 110e6))
    assert shares["b16_share_of_read_bound"] == pytest.approx(700.0 / (16 * 20e9 / 260e6))


def test_markdown_sets_batch_16_against_all_the_bytes_its_steps_read(bench_model):
    """With 100 MB of weights and 10 MB of KV a row at 20 GB/s: batch 1's bound 181.8 tok/s,
    batch 16's 16 x 20e9 / 260e6 = 1230.8 tok/s; at equal shares the ratio is 16 x 110 / 260."""
    w, kv, gbs = 100e6, 10e6, 20.0
    b1, b16 = 0.9 * gbs * 1e9 / (w + kv), 0.7 * 16 * gbs * 1e9 / (w + 16 * kv)
    rnd = {"read_bandwidth_gbs": gbs, "decode_b1_tok_s": b1, "decode_b16_tok_s": b16,
           "b16_over_b1": b16 / b1, "b1_share_of_bound": b1 / (gbs * 1e9 / w),
           "b1_share_of_read_bound": 0.9, "b16_share_of_read_bound": 0.7}
    ours = {"prefill_tok_s": 1.0, **rnd, "rounds": [rnd], "load_rss_growth_bytes": 1,
            "warm_rss_growth_bytes": 1, "kv_cache_bytes": 1}
    text = bench_model.markdown({"nxdi": ours, "read_bandwidth_gbs": gbs, "weight_bytes": w,
                                 "bound_tok_s": gbs * 1e9 / w, "kv_bytes_per_row": kv})
    line = next(x for x in text.splitlines() if x.startswith("against all the bytes"))
    assert "batch 1 median 90%" in line and "batch 16 median 70%" in line
    assert f"{16 * 110 / 260:.1f}x" in line
