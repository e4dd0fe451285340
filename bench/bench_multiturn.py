"""Multi-turn chats against a running OpenAI server, as a chat service sees them: C
conversations, each T turns, every one starting with the same SYSTEM_TOKENS-token system prompt
and adding a USER_TOKENS-token question and the model's answer (MAX_TOKENS greedy tokens) per
turn, so a turn's prompt is the previous turn's prompt, its answer and the next question.
--concurrency conversations run at once, each turn sent when the previous one has finished.
Reports, over the turns after the first: time to first token (median, p90) and the share of
prompt tokens the server reported as cached (usage.prompt_tokens_details.cached_tokens); and
the wall time of the whole run. Made to compare the router's policies with several decode
workers: where a turn lands on the worker holding its history, only the new tokens are
computed. With --url given more than once, a chat's turns go to each URL in turn: several
routers in front of the same workers, each seeing only part of a chat.

    .venv/bin/python bench/bench_multiturn.py --url http://127.0.0.1:8000 \\
        --conversations 8 --turns 4 --concurrency 4 --system-tokens 300 --user-tokens 60 \\
        --max-tokens 32 --tokenizer ~/.cache/nxdi_serving/SmolLM2-135M-Instruct

System prompt and questions are windows of bench_scoring.py's passage (the questions from its
far end, 7 tokens apart per conversation and turn), decoded to text."""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

from bench_scoring import windows


async def turn(client: httpx.AsyncClient, url: str, model: str, messages: list[dict],
               max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, text, usage = None, [], None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text.append(piece)
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {"ttft": ttft, "answer": "".join(text), "prompt": usage["prompt_tokens"],
            "cached": details.get("cached_tokens", 0)}


async def conversation(client, args, model: str, system: str, questions: list[str], c: int):
    messages = [{"role": "system", "content": system}]
    results = []
    for i, question in enumerate(questions):
        messages.append({"role": "user", "content": question})
        url = args.url[(c + i) % len(args.url)]  # several routers: turns alternate between them
        result = await turn(client, url, model, messages, args.max_tokens)
        messages.append({"role": "assistant", "content": result["answer"]})
        results.append(result)
    return results


async def run(args, system: str, questions: list[list[str]]):
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=900) as client:
        model = args.model or \
            (await client.get(f"{args.url[0]}/v1/models")).json()["data"][0]["id"]

        async def limited(qs, c):
            async with sem:
                return await conversation(client, args, model, system, qs, c)
        start = time.perf_counter()
        out = await asyncio.gather(*(limited(qs, c) for c, qs in enumerate(questions)))
        return out, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", action="append",
                   help="the server (default http://127.0.0.1:8000); repeated: routers of one "
                        "cluster, a chat's turns sent to each in turn (as a load balancer "
                        "without session affinity would)")
    p.add_argument("--model", help="model id (default: the server's first)")
    p.add_argument("--tokenizer", required=True, help="the checkpoint's tokenizer folder")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=300)
    p.add_argument("--user-tokens", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    args.url = args.url or ["http://127.0.0.1:8000"]
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    system = tokenizer.decode(windows(tokenizer, 1, args.system_tokens)[0])
    count = args.conversations * args.turns
    asks = [tokenizer.decode(w) for w in windows(tokenizer, 60 + count, args.user_tokens)[60:]]
    questions = [asks[c * args.turns:(c + 1) * args.turns] for c in range(args.conversations)]
    results, seconds = asyncio.run(run(args, system, questions))
    later = [r for conv in results for r in conv[1:]]
    ttfts = sorted(r["ttft"] for r in later)
    p90 = ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]
    cached = sum(r["cached"] for r in later) / max(sum(r["prompt"] for r in later), 1)
    first = sum(conv[0]["cached"] for conv in results) / max(sum(conv[0]["prompt"]
                                                                 for conv in results), 1)
    print(f"{' '.join(args.url)}: {args.conversations} chats x {args.turns} turns ({args.concurrency} at "
          f"once), system {args.system_tokens} tokens, questions {args.user_tokens}, answers "
          f"{args.max_tokens}: turns 2+: TTFT median {statistics.median(ttfts):.3f} s, p90 "
          f"{p90:.3f} s, cached {cached:.0%} of prompt tokens (first turns {first:.0%}); "
          f"mean prompt {statistics.mean(r['prompt'] for r in later):.0f} tokens; "
          f"run {seconds:.1f} s")


if __name__ == "__main__":
    main()
