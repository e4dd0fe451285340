"""Questions about one shared document against a running OpenAI server, as a RAG service or an
app with a long system prompt sends them: R requests (C at a time), each the same
PREFIX_TOKENS-token prefix followed by its own SUFFIX_TOKENS tokens, MAX_TOKENS greedy tokens
each, streamed. Reports time to first token (median, p90) and the median request latency; a
server that keeps the prefix's KV computes only the suffix.

    .venv/bin/python bench/bench_shared_prefix.py --url http://127.0.0.1:8000 \\
        --prefix-tokens 1024 --suffix-tokens 200 --max-tokens 16 --requests 12 \\
        --tokenizer ~/.cache/nxdi_serving/SmolLM2-135M-Instruct

The prefix and the suffixes are windows of bench_scoring.py's passage (the suffixes 7 tokens
apart, so no two share a whole block); one warm-up request (not measured) puts the prefix in
the server's cache, as the first question about a document would."""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

from bench_scoring import windows


async def one(client: httpx.AsyncClient, args, model: str, prompt: list[int]) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    ttft = None
    async with client.stream("POST", f"{args.url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"]
            if ttft is None and choice and choice[0].get("text"):
                ttft = time.perf_counter() - start
    return {"ttft": ttft, "seconds": time.perf_counter() - start}


async def run(args, prompts: list[list[int]]):
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=900) as client:
        model = args.model or (await client.get(f"{args.url}/v1/models")).json()["data"][0]["id"]
        await one(client, args, model, prompts[-1])  # warm-up: the prefix enters the cache

        async def limited(p):
            async with sem:
                return await one(client, args, model, p)
        return await asyncio.gather(*(limited(p) for p in prompts[:-1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="model id (default: the server's first)")
    p.add_argument("--tokenizer", required=True, help="the checkpoint's tokenizer folder")
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--suffix-tokens", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--skip", type=int, default=0,
                   help="start the suffixes at window SKIP (runs with different --skip share "
                        "the prefix only; a run that repeats an earlier one's prompts finds them "
                        "whole in the cache)")
    args = p.parse_args()
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    prefix = windows(tokenizer, 1, args.prefix_tokens)[0]
    # suffixes from the passage's far end, 7 tokens apart: none shares a block with another
    first = 40 + args.skip
    suffixes = windows(tokenizer, first + args.requests + 1, args.suffix_tokens)[first:]
    results = asyncio.run(run(args, [prefix + s for s in suffixes]))
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        print(f"{len(errors)} of {len(results)} failed; first: {errors[0]}")
        return
    ttfts = sorted(r["ttft"] for r in results)
    p90 = ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]
    print(f"{args.url}: {len(results)} requests of a {args.prefix_tokens}-token shared prefix "
          f"+ {args.suffix_tokens} own tokens, {args.max_tokens} tokens each, concurrency "
          f"{args.concurrency}: TTFT median {statistics.median(ttfts):.3f} s, p90 {p90:.3f} s; "
          f"median latency {statistics.median(r['seconds'] for r in results):.3f} s")


if __name__ == "__main__":
    main()
