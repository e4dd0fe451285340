"""Per-request sampling pieces both workers use: the request's random stream, logprobs, and what
changes a row's logits on the host (presence / frequency / repetition penalties, logit_bias,
min_p, structured output).

Random stream: draw i of ``request_generator(seed)`` is the sampler's uniform for generated token
i, whichever worker samples it. The prefill worker takes draw 0 for the first token; a decode worker
that pulled the KV skips draw 0 and goes on, one that prefilled locally takes it itself, so a seeded
request gives the same tokens with local or remote prefill.

Penalties: the graph samples every row on device (no token history goes in); a decode worker takes
a penalized row's logits (the graph returns them beside the tokens), lowers the logits of the
tokens it has generated (``penalized_logits``) and samples that row again on the host with the
same sampler and the same uniform (``sample_row``), so a seeded request stays replayable.
logit_bias, the repetition penalty (which counts the prompt's tokens too), min_p and a
structured-output constraint (nxdi_common/serving/structured.py) change the logits or the
sampler the same way (``host_logits``, ``sample_row``), the first token's too: a prefill worker
samples a request's first token on the host when it has any of them."""
from __future__ import annotations

import torch

from nxdi_common.serving.types import PromptLogprob, SamplingOptions, TokenLogprob

LOGPROB_FLOOR = -9999.0  # the logprob reported for an impossible token (token_logprobs)
# prompt positions per LM-head pass when scoring a prompt (score_positions): bounds the float32
# logits held at once (256 x a 49152-token vocabulary: 50 MB)
SCORE_ROWS = 256


def request_generator(seed: int | None) -> torch.Generator:
    """The request's random stream: replayable when seeded, randomly seeded otherwise."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def penalized_logits(logits: torch.Tensor, generated: list[int],
                     sampling: SamplingOptions, prompt=()) -> torch.Tensor:
    """The penalties on one row's logits [vocab]: the repetition penalty on every token of the
    prompt or generated so far (its logit divided by the penalty where positive, multiplied
    where negative), then OpenAI's: each token generated so far loses frequency_penalty x its
    count + presence_penalty. A new float32 tensor."""
    out = logits.float().clone()
    if sampling.repetition_penalty != 1.0 and (prompt or generated):
        seen = torch.tensor([*prompt, *generated], dtype=torch.long).unique()
        values = out[seen]
        out[seen] = torch.where(values > 0, values / sampling.repetition_penalty,
                                values * sampling.repetition_penalty)
    if generated and sampling.penalized:
        ids, counts = torch.tensor(generated, dtype=torch.long).unique(return_counts=True)
        out[ids] -= sampling.frequency_penalty * counts.float() + sampling.presence_penalty
    return out


def resample_on_host(sampling: SamplingOptions, generated: int) -> bool:
    """Whether a row is sampled again on the host after ``generated`` tokens: with logit_bias,
    a constraint, a repetition penalty or min_p always, with OpenAI's penalties once a token
    was generated."""
    return bool(sampling.logit_bias or sampling.structured is not None
                or sampling.repetition_penalty != 1.0 or sampling.min_p
                or (sampling.penalized and generated))


def host_logits(logits: torch.Tensor, generated: list[int], sampling: SamplingOptions,
                constraint=None, prompt=(), banned=()) -> torch.Tensor:
    """One row's logits [vocab] as the request samples them on the host: penalized (``prompt``
    and the tokens generated so far), logit_bias added, ``banned`` ids at -inf (min_tokens),
    and masked to what the structured-output constraint allows next (a
    structured.TokenConstraint, or None). A new float32 tensor."""
    out = penalized_logits(logits, generated, sampling, prompt)
    if banned:
        out[torch.tensor(banned, dtype=torch.long)] = float("-inf")
    if sampling.logit_bias:
        ids, biases = zip(*sampling.logit_bias)
        out[torch.tensor(ids, dtype=torch.long)] += torch.tensor(biases, dtype=torch.float32)
    if constraint is not None:
        constraint.mask_logits(out)
    return out


def model_global_topk(model) -> int:
    """The model's on-device sampler's global top-k (what a row sampled on the host matches)."""
    from nxdi_common.modules.sampling import DEFAULT_GLOBAL_TOPK
    odsc = model.neuron_config.on_device_sampling_config
    return getattr(odsc, "global_topk", DEFAULT_GLOBAL_TOPK)


def sample_row(logits: torch.Tensor, sampling: SamplingOptions, uniform: float,
               global_topk: int) -> int:
    """The token the on-device sampler picks from one row's logits [vocab] with this request's
    parameters and uniform: the same rule as modules/sampling.sample_from_logits (top-k of the
    global top-K candidates, temperature, nucleus, the uniform's inverse CDF), written for one
    row on the host in a few ops instead of the batched graph's ~20 (~0.3 ms less a token); a
    greedy row is its argmax, the first of equal maxima as on the device. min_p (which the
    device sampler does not take) drops, after temperature, the candidates less likely than
    min_p x the most likely one before the nucleus is taken."""
    logits = logits.float()
    if sampling.greedy:
        return int(logits.argmax())
    top, ids = torch.topk(logits, min(global_topk, logits.shape[-1]))  # sorted, descending
    k = sampling.top_k if 0 < sampling.top_k < top.shape[0] else top.shape[0]
    probs = torch.softmax(top[:k] / sampling.temperature, dim=-1)
    if sampling.min_p:  # sorted: the first is the most likely
        probs = probs[:max(int((probs >= sampling.min_p * probs[0]).sum()), 1)]
        probs = probs / probs.sum()
    cdf = probs.cumsum(-1)
    if sampling.top_p < 1.0:  # keep a candidate while the mass before it is below top_p
        kept = int(((cdf - probs) < sampling.top_p).sum())
        cdf = cdf[:max(kept, 1)]
    index = int((cdf < uniform * cdf[-1]).sum())
    return int(ids[min(index, cdf.shape[0] - 1)])


def next_uniform(g: torch.Generator) -> float:
    """The next uniform in [0, 1) of the stream (the sampler's ``rand`` for one token)."""
    return float(torch.rand(1, generator=g))


def token_logprobs(logits: torch.Tensor, token_id: int, sampling: SamplingOptions,
                   tokenizer=None) -> tuple[float | None, tuple[TokenLogprob, ...]]:
    """Logprob of token_id and the top alternatives under the temperature-scaled distribution
    (plain log_softmax when greedy); (None, ()) unless logprobs were asked for. logits [vocab]
    float32; alternatives carry their text when a tokenizer is given. A token the request made
    impossible (logit_bias -100, structured output) reports LOGPROB_FLOOR rather than -inf,
    which JSON cannot carry (OpenAI reports -9999 the same way)."""
    if not sampling.logprobs:
        return None, ()
    scaled = logits.float() if sampling.greedy else logits.float() / sampling.temperature
    logp = torch.log_softmax(scaled, dim=-1)  # [vocab]
    top = ()
    if sampling.top_logprobs:
        values, ids = torch.topk(logp, min(sampling.top_logprobs, logp.shape[0]))
        top = tuple(TokenLogprob(int(i), max(float(v), LOGPROB_FLOOR),
                                 tokenizer.decode([int(i)]) if tokenizer else "")
                    for v, i in zip(values, ids))
    return max(float(logp[token_id]), LOGPROB_FLOOR), top


def score_positions(model, hidden: torch.Tensor, next_ids, top: int
                    ) -> tuple[list[PromptLogprob], torch.Tensor]:
    """Prompt scores from final hidden states (NeuronBaseForCausalLM.forward_hidden): hidden
    [N, hidden] of N consecutive prompt positions, next_ids the prompt token at each following
    position (N of them, or N - 1 when the last position is the prompt's last). Returns each
    next token's PromptLogprob under the raw distribution (log_softmax of the logits: no
    temperature, penalty or bias), rank and `top` alternatives, and the last position's logits
    [vocab] float32 (the first generated token is sampled from them). The LM head runs
    SCORE_ROWS positions at a time."""
    scores: list[PromptLogprob] = []
    last = None
    for a in range(0, hidden.shape[0], SCORE_ROWS):
        logits = model.lm_logits(hidden[a:a + SCORE_ROWS])  # [n, vocab] float32
        last = logits[-1]
        ids = list(next_ids[a:a + logits.shape[0]])
        if not ids:
            continue
        logp = torch.log_softmax(logits[:len(ids)], dim=-1)
        target = torch.tensor(ids, dtype=torch.long)
        chosen = logp.gather(1, target[:, None])  # [m, 1]
        ranks = (logp > chosen).sum(-1, dtype=torch.int32) + 1  # int32: 2x the default's speed
        alternatives = [()] * len(ids)
        if top:
            values, alt = torch.topk(logp, min(top, logp.shape[-1]))
            alternatives = [tuple(TokenLogprob(i, max(v, LOGPROB_FLOOR)) for v, i in zip(vs, ix))
                            for vs, ix in zip(values.tolist(), alt.tolist())]
        scores += [PromptLogprob(i, max(lp, LOGPROB_FLOOR), r, alts) for i, lp, r, alts in
                   zip(ids, chosen[:, 0].tolist(), ranks.tolist(), alternatives)]
    return scores, last
