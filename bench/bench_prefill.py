"""Context-encoding (prefill) time of a prefill worker's model by prompt length, and the causal
attention op against torch's SDPA on the bundled model's head shapes.

    python bench/bench_prefill.py [--lengths 512 1024 1792] [--fused-ops fused torch] [--cpu 1]
                                  [--weight-layouts auto panels onednn] [--skip-attention]

Loads the bundled model as a prefill worker does (bf16, compiled backend, one torch thread,
quartered prompt buckets) once per --fused-ops value and times one prompt of each length (median
of 5 after 2 warm-up calls). Then times one layer's attention at each length: torch's SDPA
(causal, GQA) against torch.ops.nxdi.causal_attention, both from the strided q/k/v views the
QKV projection produces and both ending in the [B, S, H * D] layout the output projection reads.
Pins itself to --cpu (a prefill worker runs on one core)."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from nxdi_common.serving.worker import ModelOptions, load_model, prefill_neuron_config


def median_ms(fn, repeats: int = 5, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def prefill_times(kind: str, lengths: list[int], layout: str = "auto") -> dict[int, float]:
    opts = ModelOptions(None, "bfloat16", 2048, "compiled", None, 1)
    config = prefill_neuron_config(opts, 1, 1)
    config.cpu_fused_ops = kind
    config.cpu_weight_layout = layout
    model = load_model(opts, config)
    out = {}
    for n in lengths:
        ids = torch.randint(0, 40000, (1, n), generator=torch.Generator().manual_seed(n))
        out[n] = median_ms(lambda: model.forward(
            ids, seq_ids=torch.tensor([0]), position_ids=torch.arange(n).unsqueeze(0),
            sampling_params=torch.tensor([[1, 1.0, 1.0]])))
    return out


def attention_times(lengths: list[int], heads=9, kv_heads=3, dim=64) -> dict[int, tuple]:
    from nxdi_common.kernels import fused_ops
    ops = fused_ops()
    out = {}
    for n in lengths:
        x = torch.randn(1, n, heads + 2 * kv_heads, dim).bfloat16()
        q, k, v = x.transpose(1, 2).split([heads, kv_heads, kv_heads], dim=1)
        sdpa = median_ms(lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2).flatten(2), 7)
        ours = median_ms(lambda: ops.causal_attention(q, k, v, dim ** -0.5).flatten(2), 7)
        out[n] = (sdpa, ours)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 1792])
    p.add_argument("--fused-ops", nargs="*", default=["fused", "torch"],
                   choices=["fused", "torch"])
    p.add_argument("--weight-layouts", nargs="+", default=["auto"],
                   choices=["auto", "panels", "onednn", "plain"],
                   help="NeuronConfig.cpu_weight_layout values to time the prefill with")
    p.add_argument("--cpu", type=int, default=1)
    p.add_argument("--skip-attention", action="store_true",
                   help="prefill only (e.g. to time an older tree through PYTHONPATH)")
    args = p.parse_args(argv)
    os.sched_setaffinity(0, {args.cpu})
    torch.set_num_threads(1)
    for layout in args.weight_layouts:
        for kind in args.fused_ops:
            for n, ms in prefill_times(kind, args.lengths, layout).items():
                print(f"prefill {n:5d} tokens, cpu_fused_ops={kind:5s}, weights {layout:6s}: "
                      f"{ms:7.1f} ms", flush=True)
    if args.skip_attention:
        return 0
    for n, (sdpa, ours) in attention_times(args.lengths).items():
        print(f"attention, one layer, {n:5d} tokens: SDPA {sdpa:6.2f} ms, causal_attention "
              f"{ours:6.2f} ms ({sdpa / ours:.2f}x)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
