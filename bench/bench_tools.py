"""Tool calling against a running OpenAI server: the same weather questions with two tools,
per ``tool_choice`` mode (a named function, "required" with parallel_tool_calls false, "auto"),
how many answers carry a call of a given tool whose arguments keep to its schema, how many end
with finish_reason "tool_calls", their tokens and latency (medians), C requests at a time.

    .venv/bin/python bench/bench_tools.py --url http://127.0.0.1:8000 --requests 16

A server that refuses a mode (vLLM without --enable-auto-tool-choice refuses "auto") is
reported with its HTTP status, not dropped. Requests are not streamed: a call arrives whole."""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

CITIES = ["Paris", "Rome", "Berlin", "Madrid", "Lisbon", "Vienna", "Prague", "Oslo"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}
MODES = {"named": {"type": "function", "function": {"name": "get_weather"}},
         "required": "required", "auto": "auto"}


def valid_call(call: dict) -> bool:
    """A call of one of the tools with arguments of its schema."""
    fn = call.get("function") or {}
    try:
        args = json.loads(fn.get("arguments", ""))
    except ValueError:
        return False
    if not isinstance(args, dict):
        return False
    if fn.get("name") == "get_weather":
        return (set(args) == {"city", "unit"} and isinstance(args["city"], str)
                and args["unit"] in ("celsius", "fahrenheit"))
    return fn.get("name") == "get_time" and set(args) == {"city"} and isinstance(args["city"], str)


async def one(client: httpx.AsyncClient, url: str, model: str, i: int, mode: str,
              max_tokens: int) -> dict:
    body = {"model": model, "temperature": 0.7, "seed": i, "max_tokens": max_tokens,
            "tools": [WEATHER, TIME], "tool_choice": MODES[mode],
            "messages": [{"role": "user", "content":
                          f"What is the weather like in {CITIES[i % len(CITIES)]} right now?"}]}
    if mode == "required":
        body["parallel_tool_calls"] = False
    start = time.perf_counter()
    r = await client.post(f"{url}/v1/chat/completions", json=body)
    elapsed = time.perf_counter() - start
    if r.status_code != 200:
        return {"status": r.status_code, "error": r.text[:200]}
    reply = r.json()
    choice = reply["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    return {"status": 200, "calls": len(calls), "valid": bool(calls) and all(map(valid_call, calls)),
            "finish": choice["finish_reason"], "tokens": reply["usage"]["completion_tokens"],
            "latency": elapsed}


async def run_mode(client, args, model: str, mode: str) -> dict:
    gate = asyncio.Semaphore(args.concurrency)

    async def limited(i):
        async with gate:
            return await one(client, args.url, model, i, mode, args.max_tokens)

    results = await asyncio.gather(*(limited(i) for i in range(args.requests)))
    ok = [r for r in results if r["status"] == 200]
    if not ok:
        return {"mode": mode, "refused": f"HTTP {results[0]['status']}: {results[0]['error']}"}
    return {"mode": mode, "answers": len(ok), "with_valid_calls": sum(r["valid"] for r in ok),
            "finish_tool_calls": sum(r["finish"] == "tool_calls" for r in ok),
            "tokens_p50": statistics.median(r["tokens"] for r in ok),
            "latency_p50_s": round(statistics.median(r["latency"] for r in ok), 3),
            "ms_per_token_p50": round(statistics.median(1000 * r["latency"] / max(r["tokens"], 1)
                                                        for r in ok), 1)}


async def main_async(args) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        model = args.model or (await client.get(f"{args.url}/v1/models")).json()["data"][0]["id"]
        for _ in range(args.rounds):
            for mode in args.modes.split(","):
                print(json.dumps(await run_mode(client, args, model, mode)), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=120)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--modes", default="named,required,auto")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
