"""How many concurrent chat requests without max_tokens a running server takes: N at once
(closed loop, --rounds times), each a different user turn, sampled at temperature 0.8 with a
fixed seed per request; prints the HTTP status counts, the tokens generated and the wall time,
and the router's and decode workers' admission counters from /metrics.

    .venv/bin/python bench/bench_admission.py --url http://127.0.0.1:8000 --concurrency 8

A chat request without max_tokens may generate up to the model's whole context: a decode worker
that reserves prompt + max_tokens at admission (--reserve-max-tokens) fits 4 of them in the
quickstart's 512 blocks of 16 tokens and answers the rest 429 when the router does not queue
(--queue-timeout-seconds 0); with blocks on demand and the router's queue (the defaults) all are
served (BENCHMARKS.md, serving, session 34)."""
from __future__ import annotations

import argparse
import asyncio
import collections
import time

import httpx


async def one(client: httpx.AsyncClient, url: str, model: str, i: int) -> tuple[int, int]:
    r = await client.post(f"{url}/v1/chat/completions", json={
        "model": model, "temperature": 0.8, "seed": i,
        "messages": [{"role": "user", "content": f"Write a long story about dragon number {i}."}]})
    return r.status_code, r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0


def counters(url: str) -> dict:
    wanted = ("nxdi_admission_waits_total", "nxdi_preemptions_total")
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith(wanted)}


async def main_async(args) -> None:
    async with httpx.AsyncClient(timeout=1200) as client:
        model = (await client.get(f"{args.url}/v1/models")).json()["data"][0]["id"]
        for r in range(args.rounds):
            start = time.perf_counter()
            results = await asyncio.gather(*(one(client, args.url, model, r * 1000 + i)
                                             for i in range(args.concurrency)))
            codes = collections.Counter(code for code, _ in results)
            print(f"round {r}: {dict(sorted(codes.items()))}, "
                  f"{sum(n for _, n in results)} tokens in {time.perf_counter() - start:.1f} s",
                  flush=True)
    print("router:", counters(args.url))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=1)
    asyncio.run(main_async(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
