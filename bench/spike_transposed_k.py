"""Design spike (not used by the services): would decode attention's K pass gain from a block
cache whose keys lie transposed ([block][Hkv][dim pairs][16 positions]), so that the scores come
straight out of vdpbf16ps instead of 16-lane sums? (BENCHMARKS.md, issue 2, session 34.)

    .venv/bin/python bench/spike_transposed_k.py --rows 16 --length 576 [--warm] [--threads 2]

Builds bench/spike/transposed_k.cpp (AVX512-BF16 CPUs), checks that both layouts give the same
scores, then times the K pass alone over 30 layers' caches (each its own, from memory; --warm:
layer 0's for every layer) in both layouts, alternating, and prints the medians."""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from nxdi_common.runtime import huge_page_zeros

LAYERS, BLOCK, KV_HEADS, DIM, HEADS = 30, 16, 3, 64, 9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--length", type=int, default=576)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warm", action="store_true")
    p.add_argument("--rounds", type=int, default=12)
    args = p.parse_args(argv)
    ext = load("nxdi_spike_transposed_k", [str(Path(__file__).parent / "spike/transposed_k.cpp")],
               extra_cflags=["-O3", "-march=native", "-fopenmp"])
    torch.set_num_threads(args.threads)
    width = -(-args.length // BLOCK)
    blocks = args.rows * width + 8
    g = torch.Generator().manual_seed(0)
    shape = (blocks, BLOCK, KV_HEADS, DIM)
    rows = [huge_page_zeros(shape, torch.bfloat16).copy_(torch.randn(shape, generator=g))
            for _ in range(1 if args.warm else LAYERS)]
    # the same keys transposed: [blocks][Hkv][32 pairs][16 positions][2]
    cols = [c.view(blocks, BLOCK, KV_HEADS, DIM // 2, 2).permute(0, 2, 3, 1, 4).contiguous()
            for c in rows]
    table = torch.randperm(blocks, generator=g)[:args.rows * width].view(args.rows, width)
    q = torch.randn(args.rows, HEADS, DIM, generator=g).bfloat16()
    diff = (ext.kpass(q, rows[0], table, args.length, False)
            - ext.kpass(q, cols[0], table, args.length, True)).abs().max().item()
    print(f"largest score difference between the layouts: {diff:.2e}")

    def step(caches, transposed: bool) -> float:
        start = time.perf_counter()
        for layer in range(LAYERS):
            ext.kpass(q, caches[layer % len(caches)], table, args.length, transposed)
        return time.perf_counter() - start

    times = {False: [], True: []}
    for r in range(args.rounds):
        for transposed in ((False, True) if r % 2 else (True, False)):
            caches = cols if transposed else rows
            step(caches, transposed)
            times[transposed].append(statistics.median(step(caches, transposed)
                                                       for _ in range(5)))
    old, new = (statistics.median(times[t]) for t in (False, True))
    print(f"{args.rows} x {args.length} {'warm' if args.warm else 'from memory'}, "
          f"{args.threads} threads: K pass {old * 1e3:.2f} ms (rows), {new * 1e3:.2f} ms "
          f"(transposed) a {LAYERS}-layer step: {new / old:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
