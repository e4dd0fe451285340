"""Token-generation step time of a decode worker's model by batch and context length.

    python bench/bench_tkg_step.py [--threads 1] [--batches 1 8 16] [--lengths 256 1024 2048]
                                   [--mixes 7x256+1x2048 ...] [--quantize int8]
                                   [--attention-kernel auto|paged|sdpa] [--kv-cache-dtype fp8]

Loads the bundled model as the decode worker does (block KV cache, bf16, compiled backend,
max batch 16 unless --max-batch, 2048 blocks of 16 tokens) and times one decode step for every
(batch, length): every row attends over `length` cached positions; and for every mix (rows of
different lengths, e.g. 7x256+1x2048). A step runs as the decode engine runs it: one TKG call,
or with sdpa attention the short and long rows as two calls when split_by_length finds that
cheaper. Median of 5 after 2 warm-up steps."""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from decode_service.engine import EngineConfig
from decode_service.scheduler import split_by_length
from nxdi_common.serving.compute import use_torch_threads
from nxdi_common.serving.worker import ModelOptions, decode_neuron_config, load_model

BLOCK, BLOCKS = 16, 2048


def parse_mix(text: str) -> list[int]:
    """'7x256+1x2048' -> [256] * 7 + [2048]"""
    lengths = []
    for part in text.split("+"):
        count, length = part.split("x")
        lengths += [int(length)] * int(count)
    return lengths


def step_inputs(lengths: list[int]) -> dict:
    """One decode step's inputs: row i has lengths[i] cached positions (its own blocks)."""
    width = -(-max(lengths) // BLOCK)
    table = torch.tensor([[(i * width + j) % BLOCKS for j in range(width)]
                          for i in range(len(lengths))])
    last = [n - 1 for n in lengths]
    slots = [[int(table[i][p // BLOCK]) * BLOCK + p % BLOCK] for i, p in enumerate(last)]
    return dict(seq_ids=torch.arange(len(lengths)), position_ids=torch.tensor(last).unsqueeze(1),
                sampling_params=torch.tensor([[1, 1.0, 1.0]] * len(lengths)),
                slot_mapping=torch.tensor(slots), block_table=table,
                rand=torch.rand(len(lengths)))


def step(model, lengths: list[int]) -> int:
    """Run one decode step as the engine would; returns the number of TKG calls."""
    tkg = model.token_generation_model
    groups = split_by_length(lengths, tkg.length_buckets, tkg.batch_buckets,
                             EngineConfig().split_call_cost_row_tokens)
    for group in groups:
        rows = [lengths[i] for i in group]
        model.forward(torch.ones(len(rows), 1, dtype=torch.long), **step_inputs(rows))
    return len(groups)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--mixes", nargs="*", default=[], type=parse_mix, metavar="NxL+NxL",
                   help="steps whose rows have different lengths, e.g. 7x256+1x2048")
    p.add_argument("--max-batch", type=int, default=16,
                   help="the decode worker's --max-batch-size (largest TKG batch bucket)")
    p.add_argument("--batch-buckets", type=int, nargs="+",
                   help="TKG batch buckets (as the decode worker's --batch-buckets; default its own)")
    p.add_argument("--quantize", choices=("int8",), help="int8 weights, as --quantize on a worker")
    p.add_argument("--attention-kernel", choices=("auto", "paged", "sdpa"), default="auto")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="as --kv-cache-dtype on a worker")
    args = p.parse_args(argv)
    use_torch_threads(args.threads)  # load_model leaves torch's count to the caller
    opts = ModelOptions(threads=args.threads, quantize=args.quantize,
                        attention_kernel=args.attention_kernel,
                        kv_cache_dtype=args.kv_cache_dtype)
    model = load_model(opts, decode_neuron_config(opts, args.max_batch, BLOCKS, BLOCK,
                                                      batch_buckets=args.batch_buckets))
    shapes = [[n] * b for b in args.batches for n in args.lengths] + args.mixes
    print(f"attention: {model.attention_kernel}; TKG batch buckets "
          f"{model.token_generation_model.batch_buckets}, length buckets "
          f"{model.token_generation_model.length_buckets}", flush=True)
    with torch.no_grad():
        for lengths in shapes:
            times = []
            for i in range(7):
                start = time.perf_counter()
                calls = step(model, lengths)
                if i >= 2:
                    times.append(time.perf_counter() - start)
            label = "+".join(f"{lengths.count(n)}x{n}" for n in sorted(set(lengths)))
            print(f"threads {args.threads}  rows {len(lengths):2d}  {label:>14}: "
                  f"{statistics.median(times) * 1000:6.1f} ms/step ({calls} call"
                  f"{'s' if calls > 1 else ''})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
