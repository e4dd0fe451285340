"""torch.ops.nxdi.paged_decode_attention alone, as one decode step runs it: 30 layers' block
caches (the bundled model's 9 query and 3 KV heads of 64, bf16, 16-token blocks), each row's
blocks in a random order, every row attending over --length positions, on huge pages as the
KV cache managers allocate it (runtime.huge_page_zeros). Each layer has its own
cache, and before each step a --stream-mb tensor is summed (untimed), as a decode step's weight
products stream ~270 MB through the CPU's caches between two steps' attention: so the step reads
the cache from memory as a decode worker's does. Without that stream the 30 layers' caches (the
rows' blocks only: 16 MB at 1 x 576) stayed in the L3 of the Intel VM with AMX (480 MB listed),
and the kernel measured 0.7-0.8 ms where the model's attention took 1.0-1.4 (session 56).
--warm: every layer reads layer 0's cache, which stays in the CPU's caches, and no stream.

    python bench/bench_paged_op.py [--threads 1] [--rows 8] [--length 1792] [--warm]
                                   [--small-pages] [--steps 20] [--stream-mb 512]

Prints the median step time over --steps after 2 warm-up steps and the cache bytes read per second."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from nxdi_common.kernels import paged_attention
from nxdi_common.runtime import huge_page_zeros

HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--length", type=int, default=1792)
    p.add_argument("--warm", action="store_true")
    p.add_argument("--steps", type=int, default=20, help="timed steps (the median is printed)")
    p.add_argument("--stream-mb", type=int, default=512,
                   help="MB summed before each step (untimed) to leave the caches as a decode "
                        "step's weight stream does; 0: none")
    p.add_argument("--small-pages", action="store_true",
                   help="the caches on 4 KiB pages (torch's allocator), not huge pages")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    op = paged_attention()
    width = -(-args.length // BLOCK)
    blocks = args.rows * width + 8
    g = torch.Generator().manual_seed(0)

    def cache():  # where the KV cache managers put it (huge pages unless --small-pages)
        shape = (blocks, BLOCK, KV_HEADS, DIM)
        out = (torch.empty(shape, dtype=torch.bfloat16) if args.small_pages
               else huge_page_zeros(shape, torch.bfloat16))
        return out.copy_(torch.randn(shape, generator=g))

    caches = [(cache(), cache()) for _ in range(1 if args.warm else LAYERS)]
    table = torch.randperm(blocks, generator=g)[:args.rows * width].view(args.rows, width)
    pos = torch.full((args.rows, 1), args.length - 1)
    q = torch.randn(args.rows, HEADS, 1, DIM, generator=g).bfloat16()

    stream = torch.rand(0 if args.warm else args.stream_mb * 1024 * 1024 // 4)

    def step() -> float:
        stream.sum()
        start = time.perf_counter()
        for layer in range(LAYERS):
            k, v = caches[layer % len(caches)]
            op(q, k, v, table, pos, DIM ** -0.5)
        return time.perf_counter() - start

    for _ in range(2):
        step()
    seconds = statistics.median(step() for _ in range(args.steps))
    read = LAYERS * args.rows * args.length * KV_HEADS * DIM * 2 * 2  # K and V, bf16
    print(f"threads {args.threads} rows {args.rows} length {args.length} "
          f"{'warm' if args.warm else 'from memory'}: {seconds * 1e3:.1f} ms a step "
          f"({LAYERS} layers), {read / seconds / 1e9:.1f} GB/s of cache")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
