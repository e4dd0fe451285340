"""Where a batch-1 decode step's time goes beyond its weight products, in one process.

    python bench/bench_step_split.py [--threads 2] [--rounds 4] [--length 256]

1. The step against its products alone: the bundled model as a decode worker loads it (bf16,
   block KV cache, compiled); one token-generation step (one row at --length cached positions)
   and the same model's 121 panel products (its own weights, one random input row each) called
   back to back, alternating 40 times a round; the difference is what the step adds to its
   products. Each round first measures the read bandwidth (bench_model's probe) and prints both
   as a share of the bandwidth bound.
2. The application's own work per token-generation call (NeuronBaseForCausalLM.forward:
   checks, bucket choice, padding, outputs) with the graph replaced by a stub returning its
   last outputs: warm (1000 calls in a row), and each call right after summing a tensor the
   size of the weights, as a real step leaves the caches."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_tkg_step as tkg  # noqa: E402
from bench_model import read_bandwidth_gbs  # noqa: E402

from nxdi_common.modules.linear import Linear  # noqa: E402


def products_of(model):
    """(x, panels, out_features) for every linear layer of the model, in forward order."""
    linears = [m for m in model._model.modules() if isinstance(m, Linear)]
    if not all(m._panels() for m in linears):
        sys.exit(f"the weights are in the {model.weight_layout!r} layout, not panels: this "
                 "benchmark times the panel kernel (CPUs with AVX2 and without AMX)")
    return [(torch.randn(1, 1, m.in_features, dtype=torch.bfloat16), m.weight, m.out_features)
            for m in linears]


def step_against_products(model, length: int, rounds: int) -> None:
    prods = products_of(model)
    nbytes = sum(w.numel() * w.element_size() for _, w, _ in prods)
    inputs, ids = tkg.step_inputs([length]), torch.ones(1, 1, dtype=torch.long)

    def products():
        for x, w, out in prods:
            torch.ops.nxdi.panel_linear(x, w, out, None)

    def step():
        model.forward(ids, **inputs)
    print(f"{len(prods)} products, {nbytes / 1e6:.1f} MB of weights", flush=True)
    for _ in range(rounds):
        bound = nbytes / (read_bandwidth_gbs() * 1e9)
        times = {"step": [], "products": []}
        for i in range(40):
            pair = (("step", step), ("products", products))
            for name, fn in pair if i % 2 else pair[::-1]:
                began = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - began)
        s, p = (statistics.median(times[k][4:]) for k in ("step", "products"))
        print(f"bound {bound * 1e3:.2f} ms; step {s * 1e3:.2f} ms ({bound / s:.0%} of the bound), "
              f"products alone {p * 1e3:.2f} ms ({bound / p:.0%}), step - products "
              f"{(s - p) * 1e3:.2f} ms", flush=True)


def application_overhead(model, rounds: int) -> None:
    """Per-call time of forward() around a stubbed graph, warm and after a cache-sized stream."""
    tkg_model = model.token_generation_model
    last = {}
    for key, fn in list(tkg_model.runnables.items()):
        def stub(*args, _fn=fn, _key=key):
            if _key not in last:
                last[_key] = _fn(*args)
            return last[_key]
        tkg_model.runnables[key] = stub
    stream = torch.rand(sum(p.numel() * p.element_size() for p in model.weights) // 4)
    model.reset()
    model(torch.randint(100, 20000, (1, 64)))
    token = torch.ones(1, 1, dtype=torch.long)

    def call():
        model._next = [100] * len(model._next)  # the stub's step never ends the sequence
        model(token)
    for _ in range(rounds):
        began = time.perf_counter()
        for _ in range(1000):
            call()
        warm = (time.perf_counter() - began) / 1000
        cold = 0.0
        for _ in range(200):
            stream.sum()
            began = time.perf_counter()
            call()
            cold += time.perf_counter() - began
        print(f"application per call: warm {warm * 1e3:.3f} ms, after streaming "
              f"{stream.numel() * 4 / 1e6:.0f} MB {cold / 200 * 1e3:.3f} ms", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--length", type=int, default=256)
    args = p.parse_args(argv)
    tkg.use_torch_threads(args.threads)  # load_model leaves torch's count to the caller
    opts = tkg.ModelOptions(threads=args.threads)
    model = tkg.load_model(opts, tkg.decode_neuron_config(opts, 16, tkg.BLOCKS, tkg.BLOCK))
    with torch.no_grad():
        step_against_products(model, args.length, args.rounds)
        application_overhead(model, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
