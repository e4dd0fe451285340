"""Internal request and output types shared by the router and the workers, with their validation.

The services' convert modules turn protobuf messages into these (and back); the HTTP gateway turns
OpenAI JSON into these. Validation lives here once, so every entry point refuses the same inputs
with the same message, naming the field as the client spelled it."""
from __future__ import annotations

import math
from dataclasses import dataclass

from nxdi_common.serving.errors import InvalidRequest

MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256

# Finish reasons (the FinishReason enum of the proto, lower-case, as OpenAI clients see them
# after the gateway maps eos_token/stop_token/stop_string to "stop").
LENGTH, EOS_TOKEN, STOP_TOKEN, STOP_STRING = "length", "eos_token", "stop_token", "stop_string"
CANCELLED, ERROR = "cancelled", "error"
FINISH_REASONS = (LENGTH, EOS_TOKEN, STOP_TOKEN, STOP_STRING, CANCELLED, ERROR)


@dataclass(frozen=True)
class SamplingOptions:
    """How to pick each next token. temperature 0 (or top_k 1) is greedy."""

    temperature: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k filtering
    top_p: float = 1.0
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    # OpenAI's penalties on tokens already generated: each such token's logit is lowered by
    # presence_penalty once and by frequency_penalty per time it was generated (in [-2, 2];
    # negative values favour repeats). Applied by the decode worker on the host (module doc of
    # nxdi_common/serving/sampling.py); the first token, with nothing generated, is unaffected.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def validate(self) -> SamplingOptions:
        t, p = self.temperature, self.top_p
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise InvalidRequest("temperature", f"must be a finite number >= 0 (0 is greedy), "
                                                f"got {t!r}")
        if not isinstance(p, (int, float)) or not math.isfinite(p) or not 0 < p <= 1:
            raise InvalidRequest("top_p", f"must be in (0, 1], got {p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequest("top_k", f"must be an integer >= -1 (-1 or 0 disables top-k), "
                                          f"got {self.top_k!r}")
        if self.seed is not None and not 0 <= self.seed < 2 ** 64:
            raise InvalidRequest("seed", f"must be in [0, 2**64), got {self.seed!r}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], "
                                                 f"got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs", "requires logprobs to be true")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not -2 <= value <= 2:
                raise InvalidRequest(name, f"must be a number in [-2, 2], got {value!r}")
        return self

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def as_row(self) -> tuple[float, float, float]:
        """The on-device sampler's [top_k, top_p, temperature] row (greedy rows use top_k 1)."""
        if self.greedy:
            return 1.0, 1.0, 1.0
        return float(max(self.top_k, 0)), float(self.top_p), float(self.temperature)


@dataclass(frozen=True)
class StopOptions:
    """When to stop. max_tokens None means up to the model's context length."""

    max_tokens: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> StopOptions:
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise InvalidRequest("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise InvalidRequest("stop", f"at most {MAX_STOP_STRINGS} stop strings, "
                                         f"got {len(self.stop_strings)}")
        for s in self.stop_strings:
            if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_STRING_CHARS:
                raise InvalidRequest("stop", f"stop strings must be 1..{MAX_STOP_STRING_CHARS} "
                                             f"characters, got {s!r:.300}")
        return self


@dataclass(frozen=True)
class ModelLimits:
    """What a served model accepts: prompt plus output within max_model_len, ids below vocab."""

    max_model_len: int
    vocab_size: int


def check_prompt(prompt_ids: list[int] | tuple[int, ...], limits: ModelLimits,
                 field_name: str = "prompt") -> None:
    """A prompt must be non-empty, leave room for one generated token, and index the vocab."""
    if not prompt_ids:
        raise InvalidRequest(field_name, "must not be empty")
    if len(prompt_ids) >= limits.max_model_len:
        raise InvalidRequest(field_name, f"is {len(prompt_ids)} tokens; the maximum context is "
                                         f"{limits.max_model_len} tokens including at least one "
                                         f"generated token")
    bad = [t for t in prompt_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequest(field_name, f"token id {bad[0]} is outside [0, {limits.vocab_size})")


def resolve_max_tokens(prompt_len: int, stop: StopOptions, limits: ModelLimits) -> int:
    """The number of tokens to generate at most; refuses a max_tokens that cannot fit."""
    room = limits.max_model_len - prompt_len
    if stop.max_tokens is None:
        return room
    if stop.max_tokens > room:
        raise InvalidRequest("max_tokens", f"{stop.max_tokens} plus the {prompt_len} prompt tokens "
                                           f"exceeds the maximum context of "
                                           f"{limits.max_model_len} tokens; use at most {room}")
    return stop.max_tokens


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    text: str = ""


@dataclass(frozen=True)
class TokenOutput:
    """One generated token. finish_reason and usage are set on the last one only."""

    request_id: str
    token_id: int
    index: int
    text: str = ""
    logprob: float | None = None
    top_logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None


@dataclass(frozen=True)
class DecodeJob:
    """A tokenized request as a decode worker receives it."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingOptions = SamplingOptions()
    stop: StopOptions = StopOptions()
    prefill_candidates: tuple[str, ...] = ()
    local_prefill_fallback: bool = False


@dataclass(frozen=True)
class PrefillJob:
    """A tokenized prompt as a prefill worker receives it."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingOptions = SamplingOptions()
    kv_token_start: int = 0
    head_start: int = 0
    head_end: int = 0  # 0 with head_start 0: all heads
    max_chunk_bytes: int = 0  # 0: the worker's bound
    accept_kv_socket: bool = False  # the caller can take the chunks on a KV socket
