"""KV transfer throughput with the receiver placed like a decode worker, by chunk size and by
HTTP/2 channel option set, beside raw loopback TCP measured in the same run.

    python bench/bench_kv_transfer.py [--chunk-mib 4 16 32] [--repeats 5] [--receiver-cpu 1]

Starts 1 prefill worker pinned to CPU 0 (and a decode worker on CPU 1, as the quick start runs
them), pins this process (the receiver: every chunk validated and copied into K/V tensors as the
decode worker does) to --receiver-cpu, and streams 1024-token prompts' KV. bench_serving.py
measures the same with the receiver unpinned, which moves the figure a lot on two cores."""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serving as bs  # noqa: E402
from nxdi_common import kv_transfer  # noqa: E402
from nxdi_common.serving.launcher import Cluster, LaunchSpec  # noqa: E402
from protos.nxdi.serving.v1 import serving_pb2 as pb  # noqa: E402
from protos.nxdi.serving.v1 import serving_pb2_grpc as pb_grpc  # noqa: E402

OPTION_SETS = {
    "default": [],
    "lookahead 64 MiB": [("grpc.http2.lookahead_bytes", 64 << 20)],
    "no BDP probe": [("grpc.http2.bdp_probe", 0)],
    "no BDP + lookahead": [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 64 << 20)],
    "max frame 16 MiB": [("grpc.http2.max_frame_size", (16 << 20) - 1)],
}


async def transfer_rate(addr: str, fingerprint, chunk: int, extra: list, repeats: int) -> float:
    options = [("grpc.max_receive_message_length", kv_transfer.max_message_bytes(chunk)), *extra]
    rates = []
    async with grpc.aio.insecure_channel(addr, options=options) as channel:
        stub = pb_grpc.PrefillStub(channel)
        for r in range(repeats + 1):  # the first is warm-up
            rate, _ = await bs._one_transfer(stub, fingerprint, bs.prompt(1024, 700 + r), chunk)
            if r:
                rates.append(rate)
    return statistics.median(rates)


async def measure(addr: str, chunk_mib: list[int], repeats: int) -> dict:
    async with grpc.aio.insecure_channel(addr) as channel:
        load = await pb_grpc.PrefillStub(channel).GetLoad(pb.GetLoadRequest())
    out = {}
    for name, extra in OPTION_SETS.items():
        for mib in chunk_mib:
            out[(name, mib)] = await transfer_rate(addr, load.fingerprint, mib << 20, extra, repeats)
            print(f"{name:18s} {mib:3d} MiB chunks: {out[(name, mib)] / 1e9:5.2f} GB/s", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunk-mib", type=int, nargs="+", default=[4, 16, 32])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--receiver-cpu", type=int, default=1)
    args = p.parse_args(argv)
    tcp = bs.raw_tcp_bytes_per_second()
    print(f"raw loopback TCP: {tcp / 1e9:.2f} GB/s", flush=True)
    spec = LaunchSpec(prefill_workers=1, decode_workers=1, threads=1,
                      cpus={"prefill0": [0], "decode0": [1]},
                      prefill_args=["--max-chunk-bytes", str(max(args.chunk_mib) << 20)])
    with Cluster(spec) as cluster:
        os.sched_setaffinity(0, {args.receiver_cpu})
        rates = asyncio.run(measure(cluster.worker("prefill", 0).grpc, args.chunk_mib,
                                    args.repeats))
    best = max(rates.values())
    print(f"best: {best / 1e9:.2f} GB/s = {best / tcp:.0%} of raw loopback TCP")
    return 0


if __name__ == "__main__":
    sys.exit(main())
