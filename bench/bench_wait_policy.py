"""The read-bandwidth probe and the decode step under OpenMP's two wait policies, alternating.

    python bench/bench_wait_policy.py [--pairs 4] [--rows 1 16]

Each pair runs two fresh processes, one with OMP_WAIT_POLICY unset (libgomp's default: spin a
while, then sleep) and one with OMP_WAIT_POLICY=active (spin), the order alternating. Each
process loads the bundled model as a decode worker does (bf16, block KV cache, compiled, two
threads), measures bench_model's read-bandwidth probe twice, times token-generation steps (one
row per entry of --rows, 256 cached positions each; median of 35 after 5), then probes twice
more. On the Zen 4 VM the probe is bimodal (~30 or ~50+ GB/s), which moves the bandwidth bound
that bench_model reports by as much."""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent


def measure(rows: list[int]) -> str:
    import torch

    sys.path.insert(0, str(HERE))
    import bench_tkg_step as tkg
    from bench_model import read_bandwidth_gbs
    opts = tkg.ModelOptions(threads=2)
    model = tkg.load_model(opts, tkg.decode_neuron_config(opts, 16, tkg.BLOCKS, tkg.BLOCK))
    with torch.no_grad():
        for _ in range(5):
            tkg.step(model, [256])
        probes = [read_bandwidth_gbs() for _ in range(2)]
        steps = {}
        for n in rows:
            times = []
            for _ in range(40):
                began = time.perf_counter()
                tkg.step(model, [256] * n)
                times.append(time.perf_counter() - began)
            steps[n] = statistics.median(times[5:]) * 1e3
        probes += [read_bandwidth_gbs() for _ in range(2)]
    return (f"probe {' '.join(f'{p:.0f}' for p in probes)} GB/s; "
            + ", ".join(f"step {n} row{'s' if n > 1 else ''} {ms:.2f} ms" for n, ms in steps.items()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(measure(args.rows), flush=True)
        return 0
    for i in range(args.pairs):
        order = ("default", "active") if i % 2 == 0 else ("active", "default")
        for policy in order:
            env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
            if policy == "active":
                env["OMP_WAIT_POLICY"] = "active"
            out = subprocess.run([sys.executable, __file__, "--child", "--rows",
                                  *map(str, args.rows)], env=env, capture_output=True, text=True,
                                 check=True).stdout.strip().splitlines()[-1]
            print(f"pair {i + 1} {policy:>7}: {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
