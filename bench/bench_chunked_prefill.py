"""A decode worker's local prefill of one long prompt: in one context-encoding call, and in pieces
of --chunk tokens (the first by context encoding, the rest by the chunked-prefill sub-model over
the cache), as the decode worker runs them (decode_service/engine.py).

    python bench/bench_chunked_prefill.py [--length 1792] [--chunks 128 256 512] [--threads 1]
                                          [--backend compiled|eager]

Loads the bundled model as a decode worker does (bf16, block KV cache, the default kernels) once
per chunk size and prints, per repeat, the one-call time, the pieces' total, and the first,
second and last pieces' times (a piece late in a long prompt attends over more of the cache).
Runs unchanged at fa6c340 (chunk attention on the paged decode kernel) for the before figures.
--op-only times one layer's attention for the last --chunk of the prompt instead (bundled model's
heads: 9 query, 3 KV, 64 wide): torch.ops.nxdi.chunk_attention against gather + masked SDPA.
--decode-rows R (with --row-length L) times what a decode worker does while R sequences of L
positions are running: each piece and a decode step of the R rows as two calls (piece, then
token generation) and as one call (forward_mixed, the mixed sub-model); the pieces after the
first, as the first of a prompt with no running batch is a context-encoding call either way."""
from __future__ import annotations

import argparse
import time

import torch

from nxdi_common.serving import worker

BLOCK = 16


def run(length: int, chunk: int, threads: int, backend: str, repeats: int) -> None:
    opts = worker.ModelOptions(None, "bfloat16", 2048, backend, None, threads)
    nc = worker.decode_neuron_config(opts, 8, length // BLOCK + 8, BLOCK, chunk)
    model = worker.load_model(opts, nc)
    ids = [(i * 37 + 11) % 40000 + 100 for i in range(length)]
    table = list(range(length // BLOCK + 1))

    def piece(start: int, end: int) -> float:
        began = time.perf_counter()
        model.forward(torch.tensor([ids[start:end]]), seq_ids=torch.tensor([0]),
                      position_ids=torch.arange(start, end).unsqueeze(0),
                      slot_mapping=torch.tensor([[table[p // BLOCK] * BLOCK + p % BLOCK
                                                  for p in range(start, end)]]),
                      block_table=torch.tensor([table]), rand=torch.tensor([0.0]))
        return time.perf_counter() - began

    for _ in range(repeats):
        whole = piece(0, length)
        times = [piece(s, min(length, s + chunk)) for s in range(0, length, chunk)]
        print(f"chunk {chunk:4d}: one call {whole * 1e3:5.0f} ms; pieces "
              f"{sum(times) * 1e3:5.0f} ms ({sum(times) / whole:.2f}x), first "
              f"{times[0] * 1e3:4.0f}, second {times[1] * 1e3:4.0f}, last "
              f"{times[-1] * 1e3:4.0f} ms", flush=True)


def mixed_times(length: int, chunk: int, threads: int, backend: str, repeats: int,
                rows: int, row_length: int) -> None:
    opts = worker.ModelOptions(None, "bfloat16", 2048, backend, None, threads)
    row_blocks = row_length // BLOCK + 1
    nc = worker.decode_neuron_config(opts, max(8, rows), length // BLOCK + 8 + rows * row_blocks,
                                     BLOCK, chunk)
    model = worker.load_model(opts, nc)
    ids = [(i * 37 + 11) % 40000 + 100 for i in range(length)]
    table = list(range(length // BLOCK + 1))
    first = len(table)
    row_tables = [list(range(first + r * row_blocks, first + (r + 1) * row_blocks))
                  for r in range(rows)]

    def piece(start: int, end: int) -> dict:
        return dict(input_ids=torch.tensor([ids[start:end]]), seq_ids=torch.tensor([0]),
                    position_ids=torch.arange(start, end).unsqueeze(0),
                    slot_mapping=torch.tensor([[table[p // BLOCK] * BLOCK + p % BLOCK
                                                for p in range(start, end)]]),
                    block_table=torch.tensor([table]), rand=torch.tensor([0.0]))

    step = dict(input_ids=torch.full((rows, 1), 500), seq_ids=torch.arange(rows),
                position_ids=torch.full((rows, 1), row_length),
                slot_mapping=torch.tensor([[t[-1] * BLOCK + row_length % BLOCK]
                                           for t in row_tables]),
                block_table=torch.tensor(row_tables), rand=torch.zeros(rows))
    model.forward(**piece(0, chunk))  # the first piece (context encoding)
    starts = range(chunk, length, chunk)
    for _ in range(repeats):
        times = {"two calls": [], "one mixed call": []}
        for s in starts:
            args = piece(s, min(length, s + chunk))
            began = time.perf_counter()
            model.forward(**args)
            model.forward(**step)
            times["two calls"].append(time.perf_counter() - began)
            began = time.perf_counter()
            model.forward_mixed(chunk=args, decode=step)
            times["one mixed call"].append(time.perf_counter() - began)
        print(f"chunk {chunk}, {rows} rows at {row_length}: " + "; ".join(
            f"{name} {sum(t) * 1e3:5.0f} ms in all, {sum(t) / len(t) * 1e3:5.1f} per piece"
            for name, t in times.items()), flush=True)


def op_times(length: int, chunk: int, repeats: int = 20) -> None:
    import torch.nn.functional as F
    from nxdi_common.kernels import fused_ops
    ops = fused_ops()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 9, chunk, 64, generator=g).bfloat16()
    k = torch.randn(1, 3, 2048, 64, generator=g).bfloat16()
    v = torch.randn(1, 3, 2048, 64, generator=g).bfloat16()
    pos = (length - chunk + torch.arange(chunk)).unsqueeze(0)
    mask = torch.arange(2048).view(1, 1, 1, -1) <= pos.view(1, 1, -1, 1)
    for name, fn in (("chunk_attention", lambda: ops.chunk_attention(q, k, v, pos, 0.125)),
                     ("masked SDPA", lambda: F.scaled_dot_product_attention(
                         q, k, v, attn_mask=mask, enable_gqa=True))):
        fn()
        began = time.perf_counter()
        for _ in range(repeats):
            fn()
        print(f"{name:16s} {chunk} queries at {length - chunk}..{length - 1}: "
              f"{(time.perf_counter() - began) / repeats * 1e3:.2f} ms per layer", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=1792)
    p.add_argument("--chunks", type=int, nargs="+", default=[128, 256, 512])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", choices=("compiled", "eager"), default="compiled")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--op-only", action="store_true")
    p.add_argument("--decode-rows", type=int, default=0)
    p.add_argument("--row-length", type=int, default=512)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.op_only:
        for chunk in args.chunks:
            op_times(args.length, chunk)
        return
    for chunk in args.chunks:
        if args.decode_rows:
            mixed_times(args.length, chunk, args.threads, args.backend, args.repeats,
                        args.decode_rows, args.row_length)
        else:
            run(args.length, chunk, args.threads, args.backend, args.repeats)


if __name__ == "__main__":
    main()
