"""A/B of one decode step in one process: the bundled model as a decode worker loads it (bf16,
block KV cache, compiled), twice, the second time with one optimisation turned off, and the
two models' steps alternate (--steps each, the first 10 dropped) so that both see the same
machine; prints the medians and the difference.

    python bench/ab_tkg_step.py --without rope-store|attention-layer-op|norm-in-product|panel-prefetch|x-per-thread
                                [--rows 1 8 16] [--length 256] [--steps 120]

--without rope-store: keys rotated and stored apart (rope_qk, split, stack, index_copy_) instead
of nxdi::rope_qk_store. --without attention-layer-op: the paged kernel called on the layer's K
and V selected from the cache, q and its output transposed around it (four selects, two
transposes and a flatten a layer) instead of nxdi::paged_decode_attention_layer. --without
norm-in-product: every RMSNorm its own nxdi::rms_norm node before the product it feeds
(Linear.normed as self(norm(x))) instead of inside panel_linear. The second model compiles
into its own folders (/tmp/nxdi-ab-*). --without panel-prefetch: one model, the panel products'
software prefetch of their weights (torch.ops.nxdi.panel_prefetch) switched off and on before
each step. --without x-per-thread: one model, a decode batch's products making x's pairs and
norm on the calling thread before their parallel region (torch.ops.nxdi.panel_x_per_thread)
instead of in each of its threads."""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_tkg_step as tkg  # noqa: E402

WITHOUT = {"rope-store": ("nxdi_common.modules.attention", "NeuronAttention", "_stores_in_one_op",
                          lambda self, mgr, dtype: False),
           "attention-layer-op": ("nxdi_common.modules.attention", "NeuronAttention",
                                  "_attends_in_one_op", lambda self, mgr, tokens: False),
           "norm-in-product": ("nxdi_common.modules.linear", "Linear", "normed",
                               lambda self, x, norm: self(norm(x)))}
# Kernel settings switched at run time on one model: name -> set(on)
SWITCHES = {"panel-prefetch": lambda on: torch.ops.nxdi.panel_prefetch(int(on)),
            "x-per-thread": lambda on: torch.ops.nxdi.panel_x_per_thread(int(on))}


def load(opts):
    return tkg.load_model(opts, tkg.decode_neuron_config(opts, 16, tkg.BLOCKS, tkg.BLOCK))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--without", choices=sorted(WITHOUT) + sorted(SWITCHES), required=True)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=120)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    with_it = load(tkg.ModelOptions(threads=args.threads))
    switch = SWITCHES.get(args.without)
    if switch is not None:
        without = with_it
    else:
        module, cls, attr, replacement = WITHOUT[args.without]
        setattr(getattr(__import__(module, fromlist=[cls]), cls), attr, replacement)
        for folder in ("/tmp/nxdi-ab-cache", "/tmp/nxdi-ab-compiled"):
            shutil.rmtree(folder, ignore_errors=True)
        os.environ["NXDI_COMPILE_CACHE"] = "/tmp/nxdi-ab-cache"  # the source hash is unchanged
        without = load(tkg.ModelOptions(threads=args.threads,
                                        compiled_root="/tmp/nxdi-ab-compiled"))
    with torch.no_grad():
        for rows in args.rows:
            lengths = [args.length] * rows
            times = {"with": [], "without": []}
            for i in range(args.steps):
                order = (("with", with_it), ("without", without))
                for name, model in order if i % 2 else order[::-1]:
                    if switch is not None:
                        switch(name == "with")
                    began = time.perf_counter()
                    tkg.step(model, lengths)
                    times[name].append(time.perf_counter() - began)
            med = {k: statistics.median(v[10:]) * 1e3 for k, v in times.items()}
            print(f"rows {rows:2d} x {args.length}: with {med['with']:.2f} ms, without "
                  f"{args.without} {med['without']:.2f} ms, saved "
                  f"{med['without'] - med['with']:.2f} ms", flush=True)
    if switch is not None:
        switch(True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
