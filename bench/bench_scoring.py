"""Prompt scoring against a running OpenAI server, as lm-evaluation-harness's loglikelihood
tasks drive it: each request is a token-id prompt with ``echo``, ``logprobs`` 1, ``max_tokens``
1 and temperature 0, and the answer's ``token_logprobs`` are the prompt tokens' scores. Reports
requests and prompt tokens per second (C requests at a time), and with ``--hf-model`` how far
the scores are from transformers' float32 log-probabilities of the same checkpoint (mean and
max absolute difference over every scored token, and how often the server's top alternative is
transformers' argmax). ``--plain`` sends the same prompts unscored (max_tokens 1): the
prefill the scores ride on, for what scoring adds.

    .venv/bin/python bench/bench_scoring.py --url http://127.0.0.1:8000 --requests 32 \\
        --prompt-tokens 256 --hf-model ~/.cache/nxdi_serving/SmolLM2-135M-Instruct

Prompts are windows of ``--prompt-tokens`` tokens at different offsets of a fixed English
passage (tokenized by the checkpoint's tokenizer), so every server scores the same ids."""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx

PASSAGE = (
    "The river rose slowly through the night, and by morning the lower fields were under "
    "water. Farmers who had lived in the valley for generations knew the signs: a week of rain "
    "in the hills, a warm wind from the south, and the sound of the weir changing its note. "
    "They moved the animals to the high pasture, carried sacks of grain into the lofts, and "
    "waited. In the town the baker kept his ovens going, because people always want bread when "
    "they are worried, and the schoolteacher let the children watch the water from the bridge "
    "until the constable sent them home. By the third day the river began to fall. It left "
    "behind a layer of fine grey silt, branches caught in the fences, and a rowing boat that "
    "nobody could claim, resting upright in the middle of the churchyard as if someone had "
    "placed it there on purpose. The old men argued about the flood of their childhood, which "
    "had been worse, or better, depending on who was telling it. The young ones photographed "
    "the boat. Within a month the fields were green again, greener than before, and the "
    "farmers said, as they always said, that the river takes with one hand and gives with the "
    "other. Scientists from the university came to measure the silt and to ask questions about "
    "the old flood marks on the mill wall, and they wrote a report that nobody in the valley "
    "read, although everyone agreed that it was a fine thing to have been studied. ")


def windows(tokenizer, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` tokens, windows of the passage (repeated as needed)."""
    ids = tokenizer.encode(PASSAGE)
    while len(ids) < length + n * 7:
        ids = ids + ids
    return [ids[7 * i:7 * i + length] for i in range(n)]


async def score(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                plain: bool = False) -> dict:
    body = {"model": model, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 1,
            "temperature": 0}
    if plain:  # the same prefill and one token, nothing scored
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    r = await client.post(f"{url}/v1/completions", json=body)
    elapsed = time.perf_counter() - start
    if r.status_code != 200:
        return {"error": f"HTTP {r.status_code}: {r.text[:200]}", "seconds": elapsed}
    if plain:
        return {"seconds": elapsed}
    lp = r.json()["choices"][0]["logprobs"]
    n = len(prompt)
    top = [max(t, key=t.get) if t else None for t in lp["top_logprobs"][1:n]]
    return {"seconds": elapsed, "logprobs": lp["token_logprobs"][1:n], "top": top}


async def run(args, prompts: list[list[int]]) -> tuple[list[dict], float]:
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        model = args.model or (await client.get(f"{args.url}/v1/models")).json()["data"][0]["id"]
        await score(client, args.url, model, prompts[0], args.plain)  # warm-up

        async def limited(p):
            async with sem:
                return await score(client, args.url, model, p, args.plain)
        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        return results, time.perf_counter() - start


def reference(path: str, prompts: list[list[int]]):
    """transformers' float32 log-probabilities of each prompt's tokens after the first, and the
    argmax token at each position."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            logp = torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1)
            ids = torch.tensor(p[1:])
            out.append((logp[:-1].gather(1, ids[:, None])[:, 0].tolist(),
                        logp[:-1].argmax(-1).tolist()))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="model id (default: the server's first)")
    p.add_argument("--tokenizer", help="tokenizer folder (default: --hf-model)")
    p.add_argument("--hf-model", help="checkpoint to compare the scores with (float32)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--plain", action="store_true",
                   help="baseline: the same prompts with max_tokens 1 and nothing scored")
    args = p.parse_args()
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.hf_model)
    prompts = windows(tokenizer, args.requests, args.prompt_tokens)
    results, seconds = asyncio.run(run(args, prompts))
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        print(f"{len(errors)} of {len(results)} failed; first: {errors[0]}")
        return
    tokens = sum(len(x) for x in prompts)
    print(f"{args.url}{' (plain)' if args.plain else ''}: {len(results)} requests of {args.prompt_tokens} tokens, concurrency "
          f"{args.concurrency}: {seconds:.1f} s, {len(results) / seconds:.2f} req/s, "
          f"{tokens / seconds:.0f} prompt tokens/s, median latency "
          f"{statistics.median(r['seconds'] for r in results):.2f} s")
    if args.hf_model and not args.plain:
        diffs, agree, total = [], 0, 0
        text = [tokenizer.decode([i]) for i in range(len(tokenizer))]
        for r, (want, argmax) in zip(results, reference(args.hf_model, prompts)):
            diffs += [abs(a - b) for a, b in zip(r["logprobs"], want)]
            agree += sum(top == text[i] for top, i in zip(r["top"], argmax))
            total += len(argmax)
        print(f"vs transformers float32: mean |diff| {statistics.fmean(diffs):.4f}, max "
              f"{max(diffs):.3f} over {len(diffs)} tokens; top alternative = transformers' "
              f"argmax at {agree}/{total} positions ({agree / total:.1%})")


if __name__ == "__main__":
    main()
