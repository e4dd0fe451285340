"""Structured outputs against a running server: the same chat requests asking for a JSON object,
once as free text and once with ``response_format`` ``json_schema``; per mode, how many answers
parse and keep to the schema, their tokens, and the streams' time per output token and to the
first token (medians), run C at a time.

    .venv/bin/python bench/bench_structured.py --url http://127.0.0.1:8000 --requests 16

The constrained rows are masked and sampled on the host (nxdi_common/serving/structured.py):
the TPOT ratio between the two modes is that cost as a stream sees it. Constrained answers are
shorter, so requests also arrive more often a step; ``--fixed-tokens N`` makes every answer N
tokens long in both modes to separate the two."""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 40}},
    "required": ["name", "age", "city"], "additionalProperties": False}
# --fixed-tokens: one long string (at least 2000 characters), so a constrained answer runs to
# max_tokens too
STORY = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}},
         "required": ["story"]}


def valid(text: str) -> bool:
    """Whether the answer is a JSON object of SCHEMA (a fenced ```json block counts)."""
    body = text.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    try:
        value = json.loads(body)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == {"name", "age", "city"}
            and isinstance(value["name"], str) and isinstance(value["city"], str)
            and isinstance(value["age"], int) and 0 <= value["age"] <= 120)


async def one(client: httpx.AsyncClient, url: str, model: str, i: int, constrained: bool,
              max_tokens: int, fixed: bool) -> dict:
    body = {"model": model, "temperature": 0.7, "seed": i, "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content":
                          f"Describe person number {i} as a JSON object with the fields name "
                          f"(string), age (integer) and city (string). Answer with JSON only."}]}
    if fixed:  # every request max_tokens long: a free row against an unbounded-string one
        body["ignore_eos"] = True
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "person", "schema": STORY if fixed else SCHEMA}}
    start, times, text, tokens = time.perf_counter(), [], "", 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", ()):
                piece = choice["delta"].get("content")
                if piece:
                    times.append(time.perf_counter())
                    text += piece
    ttft = times[0] - start if times else float("nan")
    tpot = (times[-1] - times[0]) / (tokens - 1) if tokens > 1 and times else float("nan")
    return {"valid": valid(text), "tokens": tokens, "ttft": ttft, "tpot": tpot, "text": text}


async def run_mode(client, args, model: str, constrained: bool) -> dict:
    sem = asyncio.Semaphore(args.concurrency)

    async def limited(i):
        async with sem:
            return await one(client, args.url, model, i, constrained,
                             args.fixed_tokens or args.max_tokens, bool(args.fixed_tokens))

    start = time.perf_counter()
    results = await asyncio.gather(*(limited(i) for i in range(args.requests)))
    wall = time.perf_counter() - start
    tpots = [r["tpot"] for r in results if r["tpot"] == r["tpot"]]
    return {"mode": "json_schema" if constrained else "free text",
            "valid": sum(r["valid"] for r in results), "requests": len(results),
            "tokens": statistics.mean(r["tokens"] for r in results),
            "tpot_ms": 1000 * statistics.median(tpots) if tpots else float("nan"),
            "ttft_ms": 1000 * statistics.median(r["ttft"] for r in results),
            "wall_s": wall, "example": results[0]["text"]}


async def main_async(args) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(f"{args.url}/v1/models")).json()["data"][0]["id"]
        rows = []
        for _ in range(args.rounds):  # alternate the modes: the machine's state drifts
            for constrained in (False, True):
                rows.append(await run_mode(client, args, model, constrained))
    print("| mode | valid answers | mean tokens | median TPOT (ms) | median TTFT (ms) | wall (s) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['valid']}/{r['requests']} | {r['tokens']:.1f} | "
              f"{r['tpot_ms']:.2f} | {r['ttft_ms']:.0f} | {r['wall_s']:.1f} |")
    for r in rows[:2]:
        print(f"\n{r['mode']}, request 0: {r['example']!r:.300}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=120)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--fixed-tokens", type=int, default=0, metavar="N",
                   help="every answer exactly N tokens (ignore_eos; the constrained mode's "
                        "schema is one string of 2000+ characters): the constraint's cost per token at "
                        "equal lengths and arrivals")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
