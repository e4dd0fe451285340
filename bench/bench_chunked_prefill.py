"""A decode worker's local prefill of one long prompt: in one context-encoding call, and in pieces
of --chunk tokens (the first by context encoding, the rest by the chunked-prefill sub-model over
the cache), as the decode worker runs them (decode_service/engine.py).

    python bench/bench_chunked_prefill.py [--length 1792] [--chunks 128 256 512] [--threads 1]
                                          [--backend compiled|eager]

Loads the bundled model as a decode worker does (bf16, block KV cache, the default kernels) once
per chunk size and prints, per repeat, the one-call time, the pieces' total, and the first,
second and last pieces' times (a piece late in a long prompt attends over more of the cache).
Runs unchanged at fa6c340 (chunk attention on the paged decode kernel) for the before figures."""
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=1792)
    p.add_argument("--chunks", type=int, nargs="+", default=[128, 256, 512])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", choices=("compiled", "eager"), default="compiled")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    for chunk in args.chunks:
        run(args.length, chunk, args.threads, args.backend, args.repeats)


if __name__ == "__main__":
    main()
