"""Time of one decode step's weight products for SmolLM2-135M's shapes (4 fused projections x 30
layers + the LM head = 121 products) by number of rows: bf16 with plain weights (torch.mv at one row,
F.linear above, as modules.linear does without oneDNN), bf16 with oneDNN-packed weights (the CPU
default, modules.linear.pack_weight) and int8 weights through torch's weight-only kernel
(modules.quantization).

    python bench/bench_projections.py [--threads 1] [--rows 1 4 8 16]

Random weights; median of 7 after 2 warm-up passes."""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from nxdi_common.modules.linear import onednn_ops, pack_weight

SHAPES = [(576 + 2 * 192, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def median_ms(fn, inputs) -> float:
    for _ in range(2):
        [fn(*a) for a in inputs]
    times = []
    for _ in range(7):
        start = time.perf_counter()
        [fn(*a) for a in inputs]
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16])
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    bf16 = [torch.randn(s, dtype=torch.bfloat16) for s in SHAPES]
    int8 = [torch.randint(-127, 128, s, dtype=torch.int8) for s in SHAPES]
    scales = [torch.rand(s[0], dtype=torch.bfloat16) for s in SHAPES]
    linear, _ = onednn_ops()
    packed = [pack_weight(w) for w in bf16]
    print("| rows | bf16 plain (ms) | bf16 packed (ms) | int8 (ms) |\n|---|---|---|---|")
    for m in args.rows:
        xs = [torch.randn(m, s[1], dtype=torch.bfloat16) for s in SHAPES]
        dense = median_ms((lambda w, x: torch.mv(w, x[0])) if m == 1 else
                          (lambda w, x: F.linear(x, w)), list(zip(bf16, xs)))
        onednn = median_ms(lambda w, x: linear(x, w, None), list(zip(packed, xs)))
        quant = median_ms(torch.ops.aten._weight_int8pack_mm, list(zip(xs, int8, scales)))
        print(f"| {m} | {dense:.1f} | {onednn:.1f} | {quant:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
