"""Per-request sampling pieces both workers use: the request's random stream and logprobs.

Random stream: draw i of ``request_generator(seed)`` is the sampler's uniform for generated token
i, whichever worker samples it. The prefill worker takes draw 0 for the first token; a decode worker
that pulled the KV skips draw 0 and goes on, one that prefilled locally takes it itself, so a seeded
request gives the same tokens with local or remote prefill."""
from __future__ import annotations

import torch

from nxdi_common.serving.types import SamplingOptions, TokenLogprob


def request_generator(seed: int | None) -> torch.Generator:
    """The request's random stream: replayable when seeded, randomly seeded otherwise."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def next_uniform(g: torch.Generator) -> float:
    """The next uniform in [0, 1) of the stream (the sampler's ``rand`` for one token)."""
    return float(torch.rand(1, generator=g))


def token_logprobs(logits: torch.Tensor, token_id: int, sampling: SamplingOptions,
                   tokenizer=None) -> tuple[float | None, tuple[TokenLogprob, ...]]:
    """Logprob of token_id and the top alternatives under the temperature-scaled distribution
    (plain log_softmax when greedy); (None, ()) unless logprobs were asked for. logits [vocab]
    float32; alternatives carry their text when a tokenizer is given."""
    if not sampling.logprobs:
        return None, ()
    scaled = logits.float() if sampling.greedy else logits.float() / sampling.temperature
    logp = torch.log_softmax(scaled, dim=-1)  # [vocab]
    top = ()
    if sampling.top_logprobs:
        values, ids = torch.topk(logp, min(sampling.top_logprobs, logp.shape[0]))
        top = tuple(TokenLogprob(int(i), float(v), tokenizer.decode([int(i)]) if tokenizer else "")
                    for v, i in zip(values, ids))
    return float(logp[token_id]), top
