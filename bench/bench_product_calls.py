"""What a batch-1 decode step's many product calls cost: the 121 weight products of SmolLM2-135M's
shapes (bf16 panels as the decode workers pack them, one input row) against one product over as
many weight bytes (576 inputs), on two threads and on one, in rounds alternating in one process
(this machine is too noisy to compare separate runs). Prints each round's times and GB/s, the
read probe of bench_model.py, and per thread count the median ratio of the 121 calls' time per
byte to the one call's: ~1.0 means each call's start and end cost nothing; more is what the
calls add (session 53, AMD Zen 5: 1.09-1.21 on two threads, 1.03-1.04 on one).

    .venv/bin/python bench/bench_product_calls.py [--rounds 5] [--rows 1]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from bench_model import _median_time, read_bandwidth_gbs
from nxdi_common import kernels
from nxdi_common.modules.linear import pack_panels, panel_pairs_native
from nxdi_common.runtime import keep_large_buffers_in_heap

SHAPES = [(576 + 2 * 192, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def median_s(fn, repeats: int = 20) -> float:
    """Median seconds of fn over `repeats` runs after one warm-up run."""
    fn()
    return _median_time(fn, repeats)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rows", type=int, default=1)
    args = p.parse_args(argv)
    keep_large_buffers_in_heap()  # as the workers run: weights on huge pages where granted
    reason = kernels.kernels_unavailable_reason()
    if reason is not None:
        sys.exit(f"our panel kernel is needed: {reason}")
    pairs = panel_pairs_native()
    op = torch.ops.nxdi.panel_linear
    weights = [pack_panels(torch.randn(s, dtype=torch.bfloat16), pairs=pairs) for s in SHAPES]
    xs = [torch.randn(args.rows, s[1], dtype=torch.bfloat16) for s in SHAPES]
    total = sum(n * k for n, k in SHAPES)
    n_one = total // 576 // 16 * 16
    one_w = pack_panels(torch.randn(n_one, 576, dtype=torch.bfloat16), pairs=pairs)
    one_x = torch.randn(args.rows, 576, dtype=torch.bfloat16)

    def many():
        for w, x, (n, _) in zip(weights, xs, SHAPES):
            op(x, w, n)

    def one():
        op(one_x, one_w, n_one)

    ratios: dict[int, list[float]] = {2: [], 1: []}
    for r in range(args.rounds):
        cells = []
        for threads in ratios:
            torch.set_num_threads(threads)
            t_many, t_one = median_s(many), median_s(one)
            ratios[threads].append((t_many / total) / (t_one / (n_one * 576)))
            cells.append(f"{threads} threads: 121 calls {t_many * 1e3:.2f} ms "
                         f"({2 * total / t_many / 1e9:.1f} GB/s), one call {t_one * 1e3:.2f} ms "
                         f"({2 * n_one * 576 / t_one / 1e9:.1f} GB/s)")
        torch.set_num_threads(2)
        print(f"round {r + 1}: probe {read_bandwidth_gbs():.1f} GB/s; " + "; ".join(cells),
              flush=True)
    for threads, values in ratios.items():
        print(f"{threads} threads: 121 calls / one call, time per byte: median "
              f"{statistics.median(values):.3f} (rounds {', '.join(f'{v:.3f}' for v in values)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
