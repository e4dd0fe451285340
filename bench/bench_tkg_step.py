"""Token-generation step time of a decode worker's model by batch and context length.

    python bench/bench_tkg_step.py [--threads 1] [--batches 1 8 16] [--lengths 256 1024 2048]
                                   [--quantize int8]

Loads the bundled model as the decode worker does (block KV cache, bf16, compiled backend,
max batch 16, 1024 blocks of 16 tokens) and times one TKG call for every (batch, length): every
row attends over `length` cached positions. Median of 5 after 2 warm-up calls."""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from nxdi_common.serving.worker import ModelOptions, decode_neuron_config, load_model

BLOCK, BLOCKS, MAX_BATCH = 16, 1024, 16


def step_inputs(batch: int, length: int) -> dict:
    width = length // BLOCK
    table = torch.tensor([[(i * width + j) % BLOCKS for j in range(width)] for i in range(batch)])
    last = length - 1
    slots = [[int(table[i][last // BLOCK]) * BLOCK + last % BLOCK] for i in range(batch)]
    return dict(seq_ids=torch.arange(batch), position_ids=torch.full((batch, 1), last),
                sampling_params=torch.tensor([[1, 1.0, 1.0]] * batch),
                slot_mapping=torch.tensor(slots), block_table=table, rand=torch.rand(batch))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--quantize", choices=("int8",), help="int8 weights, as --quantize on a worker")
    args = p.parse_args(argv)
    opts = ModelOptions(threads=args.threads, quantize=args.quantize)
    model = load_model(opts, decode_neuron_config(opts, MAX_BATCH, BLOCKS, BLOCK))
    with torch.no_grad():
        for batch in args.batches:
            for length in args.lengths:
                kw = step_inputs(batch, length)
                ids = torch.ones(batch, 1, dtype=torch.long)
                times = []
                for i in range(7):
                    start = time.perf_counter()
                    model.forward(ids, **kw)
                    if i >= 2:
                        times.append(time.perf_counter() - start)
                print(f"threads {args.threads}  batch {batch:2d}  length {length:4d}: "
                      f"{statistics.median(times) * 1000:6.1f} ms/step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
