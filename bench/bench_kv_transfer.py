"""KV transfer throughput with the receiver placed like a decode worker, by chunk size and by
HTTP/2 channel option set, beside raw loopback TCP measured in the same run.

    python bench/bench_kv_transfer.py [--chunk-kib 512 1024 4096 16384] [--repeats 5] [--receiver-cpu 1]

Starts 1 prefill worker pinned to CPU 0 (and a decode worker on CPU 1, as the quick start runs
them), pins this process (the receiver: every chunk validated and copied into K/V tensors as the
decode worker does) to --receiver-cpu, and streams 1024-token prompts' KV, timed from the
first-token event (sent just before the first chunk or the KV socket offer) to the end of the
stream: first over the prefill worker's KV socket (the default data path), then as kv_chunk
events on the gRPC stream with each HTTP/2 option set. Also measures the gRPC transport alone
(the same stream of bytes-only messages, no KV logic) to show its own ceiling here. Raw
loopback TCP is measured before and after; ratios use the faster of the two. bench_serving.py
measures the same with the receiver unpinned, which moves the figure a lot on two cores."""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serving as bs  # noqa: E402
from decode_service import convert as decode_convert  # noqa: E402
from nxdi_common import kv_transfer  # noqa: E402
from nxdi_common.runtime import keep_large_buffers_in_heap  # noqa: E402
from nxdi_common.serving import kv_socket  # noqa: E402
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


async def transfer_rate(addr: str, fingerprint, chunk: int, extra: list, repeats: int,
                        socket: bool = False, tokens: int = 1024) -> tuple[float, float]:
    """Median (bytes/s, seconds) of ``repeats`` transfers of a ``tokens``-token prompt's KV."""
    options = [("grpc.max_receive_message_length", kv_transfer.max_message_bytes(chunk)), *extra]
    rates, times = [], []
    async with grpc.aio.insecure_channel(addr, options=options) as channel:
        prefill = decode_convert.prefill_call(channel)
        for r in range(repeats + 1):  # the first is warm-up
            rate, size = await bs._one_transfer(prefill, fingerprint,
                                                bs.prompt(tokens, 700 + r), chunk,
                                                kv_socket.split_host(addr) if socket else None)
            if r:
                rates.append(rate)
                times.append(size / rate)
    return statistics.median(rates), statistics.median(times)


async def small_prompts(addr: str, fingerprint, tokens: list[int], repeats: int) -> None:
    """Transfer time of short prompts' KV on each path (default chunk size): the KV socket's
    connection set-up against the stream's messages."""
    for n in tokens:
        chunk = kv_transfer.DEFAULT_MAX_CHUNK_BYTES
        (_, t_socket), (_, t_stream) = [
            await transfer_rate(addr, fingerprint, chunk, [], repeats, socket=s, tokens=n)
            for s in (True, False)]
        print(f"{n:5d}-token prompt: KV socket {t_socket * 1e3:6.2f} ms, stream "
              f"{t_stream * 1e3:6.2f} ms (medians)", flush=True)


async def measure(addr: str, chunk_kib: list[int], repeats: int, option_sets: list[str],
                  short_tokens: list[int]) -> dict:
    async with grpc.aio.insecure_channel(addr) as channel:
        load = await pb_grpc.PrefillStub(channel).GetLoad(pb.GetLoadRequest())
    await small_prompts(addr, load.fingerprint, short_tokens, repeats)
    out = {}
    for kib in chunk_kib:
        out[("KV socket", kib)] = (await transfer_rate(addr, load.fingerprint, kib << 10, [],
                                                       repeats, socket=True))[0]
        print(f"{'KV socket':18s} {kib:6d} KiB chunks: {out[('KV socket', kib)] / 1e9:5.2f} GB/s",
              flush=True)
    for name in option_sets:
        extra = OPTION_SETS[name]
        for kib in chunk_kib:
            out[(name, kib)] = (await transfer_rate(addr, load.fingerprint, kib << 10, extra,
                                                    repeats))[0]
            print(f"{name:18s} {kib:6d} KiB chunks: {out[(name, kib)] / 1e9:5.2f} GB/s", flush=True)
    return out


async def rounds(addr: str, n: int, receiver_cpu: int,
                 chunk: int = kv_transfer.DEFAULT_MAX_CHUNK_BYTES) -> list[tuple]:
    """``n`` rounds of (raw TCP, KV socket, stream) bytes/s, back to back so each ratio compares
    figures taken within a second of each other (this VM's speed moves 15-45% within minutes).
    Raw TCP is placed as the KV moves: sender on the prefill worker's CPU 0, receiver on
    ``receiver_cpu``; each transfer is a new 1024-token prompt in chunks of ``chunk`` bytes."""
    async with grpc.aio.insecure_channel(addr) as channel:
        load = await pb_grpc.PrefillStub(channel).GetLoad(pb.GetLoadRequest())
    out = []
    options = [("grpc.max_receive_message_length", kv_transfer.max_message_bytes(chunk))]
    async with grpc.aio.insecure_channel(addr, options=options) as channel:
        prefill = decode_convert.prefill_call(channel)
        for r in range(n + 1):  # the first round is warm-up
            tcp = bs.raw_tcp_bytes_per_second(256 << 20, sender_cpu=0, sink_cpu=receiver_cpu)
            sock, _ = await bs._one_transfer(prefill, load.fingerprint, bs.prompt(1024, 2000 + r),
                                             chunk, kv_socket.split_host(addr))
            stream, _ = await bs._one_transfer(prefill, load.fingerprint,
                                               bs.prompt(1024, 3000 + r), chunk)
            if r:
                out.append((tcp, sock, stream))
                print(f"round {r:2d}: raw TCP {tcp / 1e9:5.2f} GB/s, KV socket {sock / 1e9:5.2f} "
                      f"({sock / tcp:4.0%}), stream {stream / 1e9:5.2f} ({stream / tcp:4.0%})",
                      flush=True)
    return out


class _BytesOnly(pb_grpc.PrefillServicer):
    """The transport alone: ``kv_token_start`` messages of ``max_chunk_bytes`` zero bytes."""

    async def Prefill(self, request, context):  # noqa: N802 - gRPC method name
        half = bytes(request.max_chunk_bytes // 2)
        for _ in range(request.kv_token_start):
            await context.write(pb.PrefillEvent(kv_chunk=pb.KVChunk(request_id="t", k=half, v=half)))


def _bytes_only_server(ports, cpu: int, max_bytes: int) -> None:
    os.sched_setaffinity(0, {cpu})
    keep_large_buffers_in_heap()  # as every worker process runs

    async def serve():
        options = [("grpc.max_send_message_length", max_bytes),
                   ("grpc.max_receive_message_length", max_bytes)]
        server = grpc.aio.server(options=options)
        pb_grpc.add_PrefillServicer_to_server(_BytesOnly(), server)
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()
    asyncio.run(serve())


async def transport_rate(port: int, chunk: int, total: int, repeats: int) -> float:
    options = [("grpc.max_receive_message_length", chunk + (1 << 20))]
    rates = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        stub = pb_grpc.PrefillStub(channel)
        for r in range(repeats + 1):
            start, got = time.perf_counter(), 0
            req = pb.PrefillRequest(kv_token_start=max(1, total // chunk), max_chunk_bytes=chunk)
            async for event in stub.Prefill(req):
                got += len(event.kv_chunk.k) + len(event.kv_chunk.v)
            if r:
                rates.append(got / (time.perf_counter() - start))
    return statistics.median(rates)


def measure_transport(chunk_kib: list[int], repeats: int, receiver_cpu: int) -> dict:
    ports = multiprocessing.Queue()
    server = multiprocessing.Process(target=_bytes_only_server, daemon=True,
                                     args=(ports, 0, (max(chunk_kib) << 10) + (1 << 20)))
    server.start()
    try:
        port = ports.get(timeout=60)
        os.sched_setaffinity(0, {receiver_cpu})
        out = {}
        for kib in chunk_kib:
            out[kib] = asyncio.run(transport_rate(port, kib << 10, 24 << 20, repeats))
            print(f"{'transport only':18s} {kib:6d} KiB msgs:   {out[kib] / 1e9:5.2f} GB/s",
                  flush=True)
        return out
    finally:
        server.kill()
        os.sched_setaffinity(0, set(range(os.cpu_count())))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunk-kib", type=int, nargs="+", default=[512, 1024, 4096, 16384])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--receiver-cpu", type=int, default=1)
    p.add_argument("--short-prompts", type=int, nargs="*", default=[16, 128],
                   help="also time the transfer of these prompt lengths' KV on both paths")
    p.add_argument("--rounds", type=int, default=0,
                   help="instead of the sweep: this many rounds of raw TCP, KV socket and stream "
                        "back to back (chunks of the first --chunk-kib), with per-round ratios "
                        "and their medians")
    p.add_argument("--option-sets", nargs="+", default=list(OPTION_SETS), choices=list(OPTION_SETS),
                   help="HTTP/2 channel option sets to measure the KV transfer with")
    args = p.parse_args(argv)
    # The receiver allocates like a decode worker: glibc's mmap/trim thresholds pinned (workers
    # do this at start). Left at glibc's defaults, every received MiB was a fresh mmap that
    # page-faulted in and was unmapped again, which held gRPC alone to ~1.2 GB/s here.
    keep_large_buffers_in_heap()
    if args.rounds:
        return _main_rounds(args)
    tcp = bs.raw_tcp_bytes_per_second()
    print(f"raw loopback TCP: {tcp / 1e9:.2f} GB/s", flush=True)
    measure_transport(args.chunk_kib, args.repeats, args.receiver_cpu)
    spec = LaunchSpec(prefill_workers=1, decode_workers=1, threads=1,
                      cpus={"prefill0": [0], "decode0": [1]},
                      # --kv-socket-min-bytes 0: offer the socket for short prompts too, to
                      # time both paths there
                      prefill_args=["--max-chunk-bytes", str(max(args.chunk_kib) << 10),
                                    "--kv-socket-min-bytes", "0"])
    with Cluster(spec) as cluster:
        os.sched_setaffinity(0, {args.receiver_cpu})
        # One torch thread on one core, as the decode worker runs (two OpenMP threads sharing a
        # core made every chunk's copy wait ~16 ms for a scheduler slice).
        torch.set_num_threads(1)
        rates = asyncio.run(measure(cluster.worker("prefill", 0).grpc, args.chunk_kib,
                                    args.repeats, args.option_sets, args.short_prompts))
    tcp_after = bs.raw_tcp_bytes_per_second()
    print(f"raw loopback TCP again: {tcp_after / 1e9:.2f} GB/s", flush=True)
    tcp = max(tcp, tcp_after)  # the faster probe: the ratios below are not flattered by a slow one
    for path in ("KV socket", "stream"):
        best = max(v for (name, _), v in rates.items()
                   if (name == "KV socket") == (path == "KV socket"))
        print(f"best {path}: {best / 1e9:.2f} GB/s = {best / tcp:.0%} of raw loopback TCP "
              f"({tcp / 1e9:.2f} GB/s)")
    return 0


def _main_rounds(args) -> int:
    chunk = args.chunk_kib[0] << 10
    spec = LaunchSpec(prefill_workers=1, decode_workers=1, threads=1,
                      cpus={"prefill0": [0], "decode0": [1]},
                      prefill_args=["--max-chunk-bytes", str(chunk)])
    with Cluster(spec) as cluster:
        os.sched_setaffinity(0, {args.receiver_cpu})
        torch.set_num_threads(1)
        out = asyncio.run(rounds(cluster.worker("prefill", 0).grpc, args.rounds,
                                 args.receiver_cpu, chunk))
    med = statistics.median
    print(f"medians over {len(out)} rounds: raw TCP {med(t for t, _, _ in out) / 1e9:.2f} GB/s; "
          f"KV socket {med(s for _, s, _ in out) / 1e9:.2f} GB/s, "
          f"{med(s / t for t, s, _ in out):.0%} of raw TCP; stream "
          f"{med(g for _, _, g in out) / 1e9:.2f} GB/s, {med(g / t for t, _, g in out):.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
