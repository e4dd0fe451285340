"""``n`` choices of one prompt against a running OpenAI server, as an RL rollout or a
best-of-n sampler sends them: R requests (C at a time) of a PROMPT_TOKENS-token prompt, each
asking for n sampled answers of MAX_TOKENS tokens. Reports the median request latency and the
generated tokens per second; a server that prefills the prompt once for all n choices should
gain more the longer the prompt.

    .venv/bin/python bench/bench_n_choices.py --url http://127.0.0.1:8000 --n 8 \\
        --prompt-tokens 1024 --max-tokens 32 --requests 4 \\
        --tokenizer ~/.cache/nxdi_serving/SmolLM2-135M-Instruct

Prompts are different windows of bench_scoring.py's passage (no two requests share a
prefix, so a prefix cache helps only within a request; ``--skip`` moves a run's windows past an
earlier run's)."""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx

from bench_scoring import windows


async def one(client: httpx.AsyncClient, args, model: str, prompt: list[int], seed: int) -> dict:
    body = {"model": model, "prompt": prompt, "n": args.n, "max_tokens": args.max_tokens,
            "temperature": 1.0, "seed": seed, "ignore_eos": True}
    start = time.perf_counter()
    r = await client.post(f"{args.url}/v1/completions", json=body)
    elapsed = time.perf_counter() - start
    if r.status_code != 200:
        return {"error": f"HTTP {r.status_code}: {r.text[:200]}"}
    return {"seconds": elapsed, "tokens": r.json()["usage"]["completion_tokens"]}


async def run(args, prompts: list[list[int]]):
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=900) as client:
        model = args.model or (await client.get(f"{args.url}/v1/models")).json()["data"][0]["id"]
        await one(client, args, model, prompts[-1], 0)  # warm-up, a prompt not measured

        async def limited(i, p):
            async with sem:
                return await one(client, args, model, p, 1000 + i)
        start = time.perf_counter()
        results = await asyncio.gather(*(limited(i, p) for i, p in enumerate(prompts[:-1])))
        return results, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="model id (default: the server's first)")
    p.add_argument("--tokenizer", required=True, help="the checkpoint's tokenizer folder")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--skip", type=int, default=0,
                   help="start at the passage's window SKIP (runs with different --skip share "
                        "no prompt, so an earlier run's prefix cache does not help)")
    args = p.parse_args()
    from transformers import AutoTokenizer
    prompts = windows(AutoTokenizer.from_pretrained(args.tokenizer),
                      args.skip + args.requests + 1, args.prompt_tokens)[args.skip:]
    results, seconds = asyncio.run(run(args, prompts))
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        print(f"{len(errors)} of {len(results)} failed; first: {errors[0]}")
        return
    tokens = sum(r["tokens"] for r in results)
    print(f"{args.url}: {len(results)} requests of n={args.n}, {args.prompt_tokens}-token "
          f"prompts, {args.max_tokens} tokens each, concurrency {args.concurrency}: median "
          f"latency {statistics.median(r['seconds'] for r in results):.2f} s, "
          f"{tokens / seconds:.1f} generated tokens/s")


if __name__ == "__main__":
    main()
