"""Serving benchmark: what disaggregation, the KV transfer and the router cost.

    python bench/bench_serving.py [--dtype bfloat16] [--backend compiled] [--repeats 5]

Measures, on loopback, with the bundled SmolLM2 unless --model is given:
  1. raw loopback TCP throughput (one process sends 4 MiB writes to another), the peer figure;
  2. KV transfer throughput: Prefill.Prefill called directly for a long prompt, every chunk
     validated (ranges, length, CRC32C) and written into a tensor as the decode worker does,
     over the KV socket and on the stream; bytes / (first token .. done), receiver unpinned
     (bench_kv_transfer.py measures it placed as deployed, which is the figure to quote);
  3. TTFT through the router for 128/512/1024-token prompts, disaggregated (1 prefill + 1 decode)
     and aggregated (the same decode worker prefilling locally: no prefill workers);
  4. the router's cost: TTFT through Router.Generate vs Decode.Generate sent straight to the
     decode worker with the same prefill candidate, medians.
Results go to results/bench_serving.json and are printed as a table."""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import time
from pathlib import Path

import grpc
import torch

from decode_service import convert as decode_convert
from nxdi_common import kv_transfer
from nxdi_common.modules.kv_cache import SequenceKVWriter
from nxdi_common.serving import kv_socket
from nxdi_common.serving.launcher import Cluster, LaunchSpec
from protos.nxdi.serving.v1 import serving_pb2 as pb
from protos.nxdi.serving.v1 import serving_pb2_grpc as pb_grpc

PROMPT_LENGTHS = (128, 512, 1024)
TCP_BYTES, TCP_WRITE = 1 << 30, 4 << 20
CHUNK_MIB = (1, 4, 16)  # KV chunk payload bounds tried; 1 MiB is the default


def _tcp_sink(port_queue, cpu: int | None = None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    with socket.create_server(("127.0.0.1", 0)) as server:
        port_queue.put(server.getsockname()[1])
        conn, _ = server.accept()
        buffer = bytearray(TCP_WRITE)  # one buffer: a fresh one per read would time the allocator
        with conn:
            while conn.recv_into(buffer):
                pass


def raw_tcp_bytes_per_second(total: int = TCP_BYTES, sender_cpu: int | None = None,
                              sink_cpu: int | None = None) -> float:
    """This process sends ``total`` bytes in TCP_WRITE writes to another over 127.0.0.1 (each
    pinned to the given CPU for the measurement, else left where they are)."""
    ports = multiprocessing.Queue()
    sink = multiprocessing.Process(target=_tcp_sink, args=(ports, sink_cpu))
    sink.start()
    payload = bytes(TCP_WRITE)
    affinity = os.sched_getaffinity(0)
    if sender_cpu is not None:
        os.sched_setaffinity(0, {sender_cpu})
    try:
        with socket.create_connection(("127.0.0.1", ports.get())) as conn:
            start = time.perf_counter()
            for _ in range(total // TCP_WRITE):
                conn.sendall(payload)
            conn.shutdown(socket.SHUT_WR)
            sink.join()
            return total // TCP_WRITE * TCP_WRITE / (time.perf_counter() - start)
    finally:
        os.sched_setaffinity(0, affinity)


def prompt(n: int, salt: int) -> list[int]:
    """Distinct prompts (no prefix-cache hits between runs): ids from a seeded generator."""
    g = torch.Generator().manual_seed(1000 * n + salt)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


async def kv_transfer_rate(prefill_addr: str, fingerprint, n: int, repeats: int,
                           chunk_bytes: int, socket: bool = False) -> dict:
    """Bytes/s of Prefill streams for n-token prompts, received and validated like decode
    (chunks on the KV socket with ``socket``, else on the stream)."""
    options = [("grpc.max_receive_message_length", kv_transfer.max_message_bytes(chunk_bytes))]
    rates, sizes = [], []
    async with grpc.aio.insecure_channel(prefill_addr, options=options) as channel:
        prefill = decode_convert.prefill_call(channel)
        for r in range(repeats + 1):
            ids = prompt(n, 100 + r)
            rate, size = await _one_transfer(prefill, fingerprint, ids, chunk_bytes,
                                             kv_socket.split_host(prefill_addr) if socket
                                             else None)
            if r:  # the first is warm-up
                rates.append(rate)
                sizes.append(size)
    return {"bytes": sizes[0], "chunk_bytes": chunk_bytes, "kv_socket": socket,
            "bytes_per_second_median": statistics.median(rates)}


BENCH_BLOCK_SIZE = 16


def _receiver_cache(fp, num_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """A decode worker's block KV cache [L, 2, blocks + 1, 16, H, D] (zeroed, so its pages are
    touched, as a worker's pool is after start-up) with twice the blocks one prompt needs, and a
    shuffled block table for the prompt (a worker's blocks are rarely in order)."""
    blocks = 2 * -(-num_tokens // BENCH_BLOCK_SIZE)
    cache = torch.zeros(fp.num_layers, 2, blocks + 1, BENCH_BLOCK_SIZE, fp.num_kv_heads,
                        fp.head_dim, dtype=kv_transfer.DTYPES[fp.kv_dtype])
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(num_tokens)).tolist()
    return cache, table[:blocks // 2]


async def _one_transfer(prefill, fingerprint, ids, chunk_bytes,
                        socket_host: str | None = None) -> tuple[float, int]:
    """(bytes/s, payload bytes) of one Prefill stream read as the decode worker reads it
    (``prefill``: decode_service.convert.prefill_call of a channel): each event parsed by the
    worker's convert module, each chunk validated and written into a block cache through a
    block table by the worker's own function. With ``socket_host`` (the prefill worker's host)
    the KV socket is accepted and its chunks are read on a thread, as the decode worker does."""
    fp = kv_transfer.fingerprint_from_proto(fingerprint)
    reservation = kv_transfer.Reservation.for_model(fp, "bench", len(ids))
    cache, table = _receiver_cache(fp, len(ids))
    writer, coverage = SequenceKVWriter(cache, table), kv_transfer.KVCoverage(reservation)
    req = pb.PrefillRequest(request_id="bench", prompt_token_ids=ids, fingerprint=fingerprint,
                            sampling=pb.SamplingParams(temperature=0),
                            max_chunk_bytes=chunk_bytes, accept_kv_socket=socket_host is not None)

    def store(chunk) -> int:
        w = kv_transfer.decode_chunk(chunk, reservation)
        coverage.add(w)
        writer.write(w.layers, w.tokens.start, w.k, w.v, w.heads)
        return len(chunk.k) + len(chunk.v)

    # The clock starts when the first token arrives: the worker sends it just before the first
    # chunk, so the first chunk's own transfer is counted (starting at the first chunk's arrival
    # left it out, which flattered large chunks: one chunk looked nearly free).
    start, payload = None, 0
    async for data in prefill(req):
        kind, chunk = decode_convert.prefill_event(data)
        if kind == "first_token":
            start = time.perf_counter()
        if kind == "kv_chunk":
            payload += store(chunk)
        if kind == "kv_socket":
            port, token = chunk
            payload += (await kv_socket.receive(
                socket_host, port, token, lambda f: store(decode_convert.prefill_event(f)[1]),
                kv_transfer.max_message_bytes(chunk_bytes)))[1]
    return payload / (time.perf_counter() - start), payload


async def ttft(call_fn, repeats: int, n: int, salt: int) -> float:
    """Median seconds from sending to the first token event (first call is warm-up)."""
    times = []
    for r in range(repeats + 1):
        start = time.perf_counter()
        call = call_fn(prompt(n, salt + r))
        await call.read()
        if r:
            times.append(time.perf_counter() - start)
        call.cancel()
    return statistics.median(times)


async def router_overhead(via_router, direct, pairs: int = 40, n: int = 16) -> dict:
    """Median TTFT of short prompts sent through the router and straight to the decode worker,
    alternating (so drift hits both alike)."""
    times = {"router": [], "direct": []}
    for r in range(pairs + 2):
        for name, fn in (("direct", direct), ("router", via_router)):
            start = time.perf_counter()
            call = fn(prompt(n, 5000 + 2 * r + (name == "router")))
            await call.read()
            if r >= 2:
                times[name].append(time.perf_counter() - start)
            call.cancel()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"prompt_tokens": n, "pairs": pairs, "router_median_seconds": med["router"],
            "direct_median_seconds": med["direct"],
            "added_median_seconds": med["router"] - med["direct"]}


def router_call(stub):
    return lambda ids: stub.Generate(pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(temperature=0),
        stop=pb.StopCriteria(max_tokens=2)))


def decode_call(stub, candidates):
    counter = iter(range(1 << 30))
    return lambda ids: stub.Generate(pb.DecodeRequest(
        request_id=f"direct-{next(counter)}", prompt_token_ids=ids,
        sampling=pb.SamplingParams(temperature=0), stop=pb.StopCriteria(max_tokens=2),
        prefill_candidates=candidates))


async def measure_cluster(cluster: Cluster, repeats: int, with_prefill: bool) -> dict:
    decode_addr = cluster.worker("decode", 0).grpc
    out = {}
    async with grpc.aio.insecure_channel(cluster.grpc_address) as rch, \
            grpc.aio.insecure_channel(decode_addr) as dch:
        router, decode = pb_grpc.RouterStub(rch), pb_grpc.DecodeStub(dch)
        for n in PROMPT_LENGTHS:
            out[f"ttft_router_{n}_seconds"] = await ttft(router_call(router), repeats, n, 1)
        if with_prefill:
            cands = [cluster.worker("prefill", 0).grpc]
            for n in (128, 1024):
                out[f"ttft_direct_{n}_seconds"] = await ttft(decode_call(decode, cands),
                                                             repeats, n, 2)
            out["router_overhead"] = await router_overhead(router_call(router),
                                                           decode_call(decode, cands))
            load = await pb_grpc.PrefillStub(grpc.aio.insecure_channel(cands[0])).GetLoad(
                pb.GetLoadRequest())
            out["kv_transfer_1024"] = [
                await kv_transfer_rate(cands[0], load.fingerprint, 1024, repeats, mib << 20,
                                       socket)
                for socket in (True, False) for mib in CHUNK_MIB]
    return out


def spec(args, prefill_workers: int) -> LaunchSpec:
    """As the quick start runs it: prefill pinned to CPU 0, decode to CPU 1 (2-core machine)."""
    cpus = {"decode0": [1], **({"prefill0": [0]} if prefill_workers else {})}
    return LaunchSpec(model=args.model, dtype=args.dtype, backend=args.backend,
                      max_model_len=2048, prefill_workers=prefill_workers, decode_workers=1,
                      threads=args.threads, cpus=cpus,
                      prefill_args=["--max-chunk-bytes", str(max(CHUNK_MIB) << 20)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--backend", default="compiled", choices=("compiled", "eager"))
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="results/bench_serving.json")
    args = p.parse_args(argv)
    results = {"config": vars(args), "raw_tcp_bytes_per_second": raw_tcp_bytes_per_second()}
    with Cluster(spec(args, 1)) as cluster:
        results["disaggregated"] = asyncio.run(measure_cluster(cluster, args.repeats, True))
    with Cluster(spec(args, 0)) as cluster:
        results["aggregated"] = asyncio.run(measure_cluster(cluster, args.repeats, False))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    report(results)
    return 0


def report(r: dict) -> None:
    d, a = r["disaggregated"], r["aggregated"]
    tcp = r["raw_tcp_bytes_per_second"]
    print(f"raw loopback TCP {tcp / 1e9:.2f} GB/s")
    for x in d["kv_transfer_1024"]:
        kv = x["bytes_per_second_median"]
        path = "KV socket" if x.get("kv_socket") else "stream   "
        print(f"KV transfer ({path}), {x['chunk_bytes'] >> 20:2d} MiB chunks: {kv / 1e9:.2f} GB/s "
              f"({kv / tcp:.0%} of TCP), {x['bytes'] / 1e6:.1f} MB per 1024-token prompt")
    for n in PROMPT_LENGTHS:
        dis, agg = d[f"ttft_router_{n}_seconds"], a[f"ttft_router_{n}_seconds"]
        print(f"TTFT {n:5d} tokens: disaggregated {dis * 1e3:8.1f} ms, local prefill "
              f"{agg * 1e3:8.1f} ms, ratio {dis / agg:.3f}")
    o = d["router_overhead"]
    print(f"router adds {o['added_median_seconds'] * 1e3:+.2f} ms to the median TTFT of "
          f"{o['prompt_tokens']}-token prompts ({o['router_median_seconds'] * 1e3:.2f} ms via "
          f"router, {o['direct_median_seconds'] * 1e3:.2f} ms direct, {o['pairs']} pairs)")
    for n in (128, 1024):
        via, direct = d[f"ttft_router_{n}_seconds"], d[f"ttft_direct_{n}_seconds"]
        print(f"router adds {(via - direct) * 1e3:+.2f} ms at {n} tokens (median TTFT "
              f"{via * 1e3:.1f} via router, {direct * 1e3:.1f} direct)")


if __name__ == "__main__":
    raise SystemExit(main())
