"""Time of one decode step's weight products for SmolLM2-135M's shapes (4 fused projections x 30
layers + the LM head = 121 products) by number of rows: bf16 with plain weights (torch.mv at one row,
F.linear above, as modules.linear does without a packed layout), bf16 with oneDNN-packed weights
(the default where the CPU has bf16 dot products, modules.linear.pack_weight), bf16 in panels
(our kernel, the default on CPUs without them, modules.linear.pack_panels; [K, 16] panels,
and on CPUs with bf16 dot products also the pairs layout packed there), float32 with plain
weights (torch's MKL sgemm: what the panels are measured against), and int8 weights through torch's
weight-only kernel and in panels (modules.quantization: the latter where bf16 goes to panels). Past 64 rows (a prefill) the LM head is left out: a
prefill computes it for one row.

    python bench/bench_projections.py [--threads 1] [--rows 1 4 8 16 32 512]

Random weights; median of 7 after 2 warm-up passes; '-' where the CPU or torch build cannot run
a layout."""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from nxdi_common import kernels
from nxdi_common.modules.linear import (onednn_ops, onednn_unavailable_reason, pack_panels,
                                       pack_weight, panel_pairs_native)

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
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16, 32])
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    bf16 = [torch.randn(s, dtype=torch.bfloat16) for s in SHAPES]
    fp32 = [w.float() for w in bf16]
    int8 = [torch.randint(-127, 128, s, dtype=torch.int8) for s in SHAPES]
    scales = [torch.rand(s[0], dtype=torch.bfloat16) for s in SHAPES]
    onednn = onednn_unavailable_reason(torch.bfloat16) is None
    packed = [pack_weight(w) for w in bf16] if onednn else None
    ours = kernels.kernels_unavailable_reason() is None
    panels = [pack_panels(w, pairs=False) for w in bf16] if ours else None
    native = ours and panel_pairs_native()
    pairs = [pack_panels(w, pairs=True) for w in bf16] if native else None
    int8_panels = [pack_panels(w) for w in int8] if ours else None
    print("| rows | bf16 plain (ms) | bf16 oneDNN-packed (ms) | bf16 panels (ms) "
          "| bf16 pairs (ms) | fp32 plain (ms) | int8 (ms) | int8 panels (ms) |\n"
          "|---|---|---|---|---|---|---|---|")
    for m in args.rows:
        n = len(SHAPES) if m <= 64 else len(SHAPES) - 1
        xs = [torch.randn(m, s[1], dtype=torch.bfloat16) for s in SHAPES[:n]]
        cells = [median_ms((lambda w, x: torch.mv(w, x[0])) if m == 1 else
                           (lambda w, x: F.linear(x, w)), list(zip(bf16, xs)))]
        cells.append(median_ms(lambda w, x: onednn_ops()[0](x, w, None), list(zip(packed, xs)))
                     if packed else None)
        cells.append(median_ms(lambda w, x, o: torch.ops.nxdi.panel_linear(x, w, o),
                               [(w, x, s[0]) for w, x, s in zip(panels, xs, SHAPES)])
                     if panels else None)
        cells.append(median_ms(lambda w, x, o: torch.ops.nxdi.panel_linear(x, w, o),
                               [(w, x, s[0]) for w, x, s in zip(pairs, xs, SHAPES)])
                     if pairs else None)
        cells.append(median_ms(lambda w, x: F.linear(x, w),
                               [(w, x.float()) for w, x in zip(fp32, xs)]))
        cells.append(median_ms(torch.ops.aten._weight_int8pack_mm, list(zip(xs, int8, scales))))
        cells.append(median_ms(lambda w, x, o, sc: torch.ops.nxdi.panel_linear(x, w, o, None, None,
                                                                              sc),
                               [(w, x, s[0], sc) for w, x, s, sc in
                                zip(int8_panels, xs, SHAPES, scales)])
                     if int8_panels else None)
        print(f"| {m} | " + " | ".join("-" if c is None else f"{c:.1f}" for c in cells) + " |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
