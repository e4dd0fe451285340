"""The 121 products of a SmolLM2-135M decode step (bench_projections.py's shapes) from bfloat16
weights in [K, 16] panels and in k pairs (modules.linear.pack_panels), alternating the two
layouts repetition by repetition in one process, so the machine's drift falls on both alike.

    python bench/ab_panel_pairs.py --threads 1 --rows 1 8 16 64

Prints the median (and the fastest) of --repeats passes per layout after two warm-up passes
each. Needs our kernel library and a CPU with AVX512-BF16 (where pairs are the packed layout)."""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from nxdi_common import kernels
from nxdi_common.modules.linear import pack_panels, panel_pairs_native

SHAPES = [(576 + 2 * 192, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64])
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    reason = kernels.kernels_unavailable_reason()
    if reason is not None or not panel_pairs_native():
        print(f"pairs are not this CPU's layout: {reason or 'no AVX512-BF16'}")
        return 1
    weights = [torch.randn(s, dtype=torch.bfloat16) for s in SHAPES]
    layouts = {"panels": [pack_panels(w, pairs=False) for w in weights],
               "pairs": [pack_panels(w, pairs=True) for w in weights]}
    print(f"| rows | threads | [K, 16] panels (ms) | pairs (ms) |\n|---|---|---|---|")
    for m in args.rows:
        xs = [torch.randn(m, s[1], dtype=torch.bfloat16) for s in SHAPES]
        times: dict[str, list[float]] = {name: [] for name in layouts}
        for rep in range(args.repeats + 2):
            for name, packed in layouts.items():
                start = time.perf_counter()
                for w, x, s in zip(packed, xs, SHAPES):
                    torch.ops.nxdi.panel_linear(x, w, s[0])
                if rep >= 2:
                    times[name].append((time.perf_counter() - start) * 1000)
        cells = [f"{statistics.median(t):.1f} (min {min(t):.1f})" for t in times.values()]
        print(f"| {m} | {args.threads} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
