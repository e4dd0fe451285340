"""One sequence on a decode worker: its blocks, its tokens, its random stream, and the stop rules.

A Sequence is created when the request is admitted (blocks reserved for its prompt; more come as
it generates, engine module doc), gets its prompt KV (pulled from a prefill worker or computed
locally), then joins the running batch until a stop rule fires (maybe preempted for KV blocks on
the way, and resumed). Outputs go to ``emit`` (thread-safe: it hands them to the asyncio side)."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nxdi_common.serving import types as t
from nxdi_common.serving.detokenize import OutputText
from nxdi_common.serving.sampling import next_uniform


@dataclass(eq=False)  # a sequence is itself: two with equal fields are still two requests
class Sequence:
    job: t.DecodeJob
    max_tokens: int
    block_table: list[int]
    num_cached_tokens: int
    text: OutputText
    eos_ids: frozenset[int]
    emit: Callable[[t.TokenOutput | Exception], None]
    rng: torch.Generator  # the request's random stream (nxdi_common.serving.sampling)
    slot: int = -1  # seq_id in the running batch
    prefilled: int = 0  # prompt positions a local prefill has computed so far
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    arrival_ns: int = field(default_factory=time.monotonic_ns)
    last_token_ns: int = 0
    first_token_ns: int = 0  # when add_token recorded the first token (monotonic)
    # while preempted (engine._preempt): its KV, [layers, 2, blocks, block_size, H, D]
    swapped_kv: torch.Tensor | None = None
    last_uniform: float = 0.0  # draw_uniform's last draw
    # the structured-output constraint (structured.TokenConstraint), fed every token; None: free
    constraint: object = None
    # the prompt's scores (prompt_logprobs), sent with the first token: from the prefill
    # worker, or gathered piece by piece by a local prefill
    prompt_logprobs: tuple = ()
    # hold the first token's event until the sequence joins the running batch (release_first;
    # the engine's hold_first_token), unless that token ends it
    hold_first: bool = False
    held: t.TokenOutput | None = None  # the first token's event, while held

    @property
    def request_id(self) -> str:
        return self.job.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.job.prompt_ids)

    @property
    def scored(self) -> bool:
        """The request scores its prompt (prompt_logprobs)."""
        return self.job.sampling.prompt_logprobs is not None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def next_position(self) -> int:
        """Position of the last generated token: the one the next TKG step feeds in."""
        return self.prompt_len + len(self.generated) - 1

    def draw_uniform(self) -> float:
        """This sequence's next sampling uniform (seeded requests replay exactly), kept as
        last_uniform (a penalized row is sampled again on the host with it)."""
        self.last_uniform = next_uniform(self.rng)
        return self.last_uniform

    @property
    def priority(self) -> int:
        """The request's priority: lower is served first where sequences wait."""
        return self.job.priority

    @property
    def wait_order(self) -> tuple[int, int]:
        """Who goes first where sequences wait for a slot or blocks: priority, then age."""
        return self.job.priority, self.arrival_ns

    def banned_ids(self) -> tuple[int, ...]:
        """Token ids the next token may not be: while fewer than min_tokens were generated, the
        EOS tokens (unless ignored) and the stop tokens."""
        stop = self.job.stop
        if len(self.generated) >= stop.min_tokens:
            return ()
        eos = () if stop.ignore_eos else tuple(sorted(self.eos_ids))
        return tuple(sorted({*eos, *stop.stop_token_ids}))

    def add_token(self, token_id: int, logprob=None, top_logprobs=()) -> None:
        """Record a generated token, apply the stop rules, and emit its event. A token the
        constraint does not allow raises (nothing recorded)."""
        if self.constraint is not None:
            self.constraint.accept(token_id)
        self.generated.append(token_id)
        if len(self.generated) == 1:
            self.first_token_ns = time.monotonic_ns()
        stop_token = self._stop_token(token_id)
        if stop_token is not None and not self.job.stop.include_stop_str_in_output:
            text, stop_string = "", False  # the stop token's own text is left out (vLLM's rule)
        else:
            text, stop_string = self.text.add(token_id,
                                              len(self.generated) >= self.job.stop.min_tokens)
        reason = stop_token or self._stop_reason(stop_string)
        if reason is not None and reason != t.STOP_STRING:
            text += self.text.finish()  # held text; it may complete a stop string
            if self.text.stopped and reason == t.LENGTH:
                reason = t.STOP_STRING
        self.finish_reason = reason
        index = len(self.generated) - 1
        out = t.TokenOutput(self.request_id, token_id, index, text, logprob, tuple(top_logprobs),
                            reason, self._usage(reason),
                            tuple(self.prompt_logprobs) if index == 0 else ())
        if index == 0 and self.hold_first and reason is None:
            self.held = out
        else:
            self.emit(out)

    def release_first(self) -> None:
        """Emit the held first token (hold_first): the sequence is joining the running batch, so
        its second token is one step away."""
        if self.held is not None:
            out, self.held = self.held, None
            self.emit(out)

    def fail(self, exc: Exception) -> None:
        """End the sequence with an error; the request's stream ends with its status."""
        self.finish_reason = t.ERROR
        self.emit(exc)

    def _stop_token(self, token_id: int) -> str | None:
        """EOS_TOKEN or STOP_TOKEN when ``token_id`` ends the sequence as a token."""
        if token_id in self.eos_ids and not self.job.stop.ignore_eos:
            return t.EOS_TOKEN
        if token_id in self.job.stop.stop_token_ids:
            return t.STOP_TOKEN
        return None

    def _stop_reason(self, stop_string: bool) -> str | None:
        if stop_string:
            return t.STOP_STRING
        if self.constraint is not None and self.constraint.done:
            return t.EOS_TOKEN  # the constrained output is complete
        if len(self.generated) >= self.max_tokens:
            return t.LENGTH
        return None

    def _usage(self, reason) -> t.Usage | None:
        if reason is None:
            return None
        return t.Usage(self.prompt_len, len(self.generated), self.num_cached_tokens)
