"""How fast a received prompt's KV lands in a decode worker's block pool: write_prompt_range with
our kernel's copy_blocks (non-temporal stores) against its numpy fallback, in one process.

    python bench/bench_kv_write.py [--tokens 1024] [--repeats 9] [--cpu 1]

The bundled SmolLM2's KV shape (30 layers, 3 KV heads, head_dim 64, bf16: 23.6 MB for 1024
tokens), written a layer at a time (K then V, as 1 MiB chunks arrive) through a shuffled block
table into one of three pools of 8x the prompt's blocks, taken in turn so the destination is
cold, as a large pool's free blocks are. The two paths alternate; medians are printed."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nxdi_common import kernels  # noqa: E402
from nxdi_common.modules import kv_cache  # noqa: E402

LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16


def write_all(pool: torch.Tensor, table: list[int], data: torch.Tensor) -> float:
    start = time.perf_counter()
    for layer in range(LAYERS):
        for which in (kv_cache.K, kv_cache.V):
            kv_cache.write_prompt_range(pool[layer:layer + 1, which], table, 0, data)
    return time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--cpu", type=int, default=1, help="pin to this CPU (a decode worker's)")
    args = p.parse_args(argv)
    os.sched_setaffinity(0, {args.cpu})
    torch.set_num_threads(1)
    reason = kernels.kernels_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"our kernels are unavailable: {reason}")
    blocks = -(-args.tokens // BLOCK)
    pools = [torch.zeros(LAYERS, 2, 8 * blocks + 1, BLOCK, HEADS, HEAD_DIM, dtype=torch.bfloat16)
             for _ in range(3)]
    table = torch.randperm(8 * blocks, generator=torch.Generator().manual_seed(0))[:blocks].tolist()
    data = torch.randn(1, args.tokens, HEADS, HEAD_DIM).to(torch.bfloat16)
    numpy_only = lambda: "measuring the numpy path"  # noqa: E731
    times = {"copy_blocks": [], "numpy": []}
    real, turn = kv_cache.kernels.kernels_unavailable_reason, 0
    for r in range(args.repeats + 1):  # the first round is warm-up
        for name in times:
            kv_cache.kernels.kernels_unavailable_reason = real if name == "copy_blocks" \
                else numpy_only
            turn += 1  # the pool written longest ago
            elapsed = write_all(pools[turn % 3], table, data)
            if r:
                times[name].append(elapsed)
    kv_cache.kernels.kernels_unavailable_reason = real
    size = 2 * LAYERS * data.numel() * data.element_size()
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"{name:12s} {t * 1e3:6.2f} ms for {size / 1e6:.1f} MB ({size / t / 1e9:5.2f} GB/s); "
              f"all: {' '.join(f'{x * 1e3:.2f}' for x in ts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
