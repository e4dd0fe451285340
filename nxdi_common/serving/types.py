"""Internal request and output types shared by the router and the workers, with their validation.

The services' convert modules turn protobuf messages into these (and back); the HTTP gateway turns
OpenAI JSON into these. Validation lives here once, so every entry point refuses the same inputs
with the same message, naming the field as the client spelled it."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from nxdi_common.serving.errors import InvalidRequest

MAX_TOP_LOGPROBS = 20
# Initial metadata a decode worker sends on Decode.Generate once it has reserved the request's
# KV blocks (before the prompt's KV arrives and its first token): the router's admission queue
# lets the next request try as soon as it sees it, not a time-to-first-token later.
ADMITTED_METADATA_KEY = "nxdi-admitted"
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
LOGIT_BIAS_RANGE = 100.0  # each bias in [-100, 100], as OpenAI's
MAX_STRUCTURED_SPEC_CHARS = 65536  # a schema, regex or grammar
MAX_CHOICES = 256  # alternatives of a choice constraint
STRUCTURED_KINDS = ("json_schema", "regex", "choice", "lark_grammar")

# Finish reasons (the FinishReason enum of the proto, lower-case, as OpenAI clients see them
# after the gateway maps eos_token/stop_token/stop_string to "stop").
LENGTH, EOS_TOKEN, STOP_TOKEN, STOP_STRING = "length", "eos_token", "stop_token", "stop_string"
CANCELLED, ERROR = "cancelled", "error"
FINISH_REASONS = (LENGTH, EOS_TOKEN, STOP_TOKEN, STOP_STRING, CANCELLED, ERROR)


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output's text (nxdi_common/serving/structured.py applies it).

    kind is one of STRUCTURED_KINDS: ``json_schema`` (spec: a JSON Schema as JSON text),
    ``regex`` (spec: a regular expression the whole output matches), ``choice`` (choices: the
    output is exactly one of them), ``lark_grammar`` (spec: a Lark grammar). ``validate`` checks
    the shape; whether a spec compiles is only known with the tokenizer (structured.compile)."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    def validate(self, field_name: str = "structured_output") -> StructuredOutput:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequest(field_name, f"kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                                             f"got {self.kind!r}")
        if self.kind == "choice":
            if not 0 < len(self.choices) <= MAX_CHOICES:
                raise InvalidRequest(field_name, f"choice needs 1..{MAX_CHOICES} alternatives, "
                                                 f"got {len(self.choices)}")
            if any(not isinstance(c, str) or not c for c in self.choices):
                raise InvalidRequest(field_name, "choice alternatives must be non-empty strings")
            size = sum(len(c) for c in self.choices)
        else:
            if not isinstance(self.spec, str) or not self.spec.strip():
                raise InvalidRequest(field_name, f"{self.kind} must not be empty")
            size = len(self.spec)
        if size > MAX_STRUCTURED_SPEC_CHARS:
            raise InvalidRequest(field_name, f"{self.kind} is {size} characters; at most "
                                             f"{MAX_STRUCTURED_SPEC_CHARS}")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except ValueError as exc:
                raise InvalidRequest(field_name, f"json_schema is not JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise InvalidRequest(field_name, "json_schema must be a JSON object (a schema), "
                                                 f"got {type(schema).__name__}")
        return self


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
    # OpenAI's logit_bias: (token id, bias) pairs added to those logits before every token is
    # sampled, the first included (on the host, like the penalties). Ids are checked against
    # the vocabulary where it is known (check_sampling).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # A constraint on the output (structured outputs); None: free text.
    structured: StructuredOutput | None = None
    # Hugging Face's / vLLM's repetition penalty: the logit of every token in the prompt or
    # generated so far is divided by it where positive, multiplied where negative (1: none;
    # > 1 discourages repeats); min_p: after temperature, tokens less likely than min_p x the
    # most likely one are dropped (0: none). Both on the host, every token the first included.
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    # Score the prompt (vLLM's prompt_logprobs): each prompt token after the first gets its
    # log-probability given the tokens before it under the raw distribution, its rank, and this
    # many alternatives (0: none); None: no prompt scores.
    prompt_logprobs: int | None = None

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
        if self.prompt_logprobs is not None and (
                not isinstance(self.prompt_logprobs, int) or isinstance(self.prompt_logprobs, bool)
                or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidRequest("prompt_logprobs", f"must be an integer in [0, "
                                                    f"{MAX_TOP_LOGPROBS}] (alternatives per "
                                                    f"prompt position), got "
                                                    f"{self.prompt_logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not -2 <= value <= 2:
                raise InvalidRequest(name, f"must be a number in [-2, 2], got {value!r}")
        r = self.repetition_penalty
        if not isinstance(r, (int, float)) or not math.isfinite(r) or not 0 < r <= 10:
            raise InvalidRequest("repetition_penalty", f"must be a number in (0, 10] (1 means "
                                                       f"none), got {r!r}")
        if not isinstance(self.min_p, (int, float)) or not math.isfinite(self.min_p) \
                or not 0 <= self.min_p <= 1:
            raise InvalidRequest("min_p", f"must be a number in [0, 1] (0 means none), "
                                          f"got {self.min_p!r}")
        self._validate_logit_bias()
        if self.structured is not None:
            self.structured.validate()
        return self

    def _validate_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, "
                                               f"got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or token < 0:
                raise InvalidRequest("logit_bias", f"keys must be token ids >= 0, got {token!r}")
            if not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                    or not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
                raise InvalidRequest("logit_bias", f"token {token}: bias must be a number in "
                                                   f"[-100, 100], got {bias!r}")

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
    # vLLM's min_tokens: the first min_tokens tokens are never EOS or a stop token (their logits
    # are masked), and stop strings count from the min_tokens-th token on
    min_tokens: int = 0
    # vLLM's: special tokens' text left out of the output; the stop string that ended it, and
    # the stop token's (EOS or stop_token_ids) text, kept at its end
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def validate(self) -> StopOptions:
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise InvalidRequest("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidRequest("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest("min_tokens", f"must be at most max_tokens ({self.max_tokens}), "
                                               f"got {self.min_tokens}")
        for name in ("skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(name, f"must be a boolean, got {getattr(self, name)!r}")
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


def check_sampling(sampling: SamplingOptions, limits: ModelLimits,
                   field_name: str = "logit_bias") -> None:
    """What validate() cannot check without the model: logit_bias ids index the vocab."""
    bad = [tok for tok, _ in sampling.logit_bias if tok >= limits.vocab_size]
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
class PromptLogprob:
    """The score of one prompt token (SamplingOptions.prompt_logprobs): its log-probability
    given the tokens before it, its rank (1 = the most likely), and the top alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class TokenOutput:
    """One generated token. finish_reason and usage are set on the last one only; the first
    carries the prompt's scores when the request asked for them."""

    request_id: str
    token_id: int
    index: int
    text: str = ""
    logprob: float | None = None
    top_logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None
    prompt_logprobs: tuple[PromptLogprob, ...] = ()


@dataclass(frozen=True)
class DecodeJob:
    """A tokenized request as a decode worker receives it."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingOptions = SamplingOptions()
    stop: StopOptions = StopOptions()
    prefill_candidates: tuple[str, ...] = ()
    local_prefill_fallback: bool = False
    priority: int = 0  # lower runs first where requests wait (check_priority)
    cache_salt: str = ""  # only requests with the same salt share cached blocks (check_cache_salt)
    # prefilled locally with the decode steps held while it runs (DecodeRequest's field)
    hold_steps_for_prefill: bool = False


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
    banned_first: tuple[int, ...] = ()  # the first token may not be one of these (min_tokens)
    priority: int = 0  # lower goes first in the prefill queue (check_priority)
    cache_salt: str = ""  # the prefix cache's chain root (block_manager.salt_root)


PRIORITY_RANGE = (-(2 ** 31), 2 ** 31 - 1)  # int32 on the wire


def check_priority(priority, field_name: str = "priority") -> int:
    """vLLM's request priority: an integer, lower values served first where requests wait
    (the router's admission queue, a prefill worker's queue, a decode worker's batch slots,
    local prefills and preemptions); equal priorities keep their usual order."""
    low, high = PRIORITY_RANGE
    if isinstance(priority, bool) or not isinstance(priority, int) or not low <= priority <= high:
        raise InvalidRequest(field_name, f"must be an integer in [{low}, {high}], got "
                                         f"{priority!r}")
    return priority


MAX_CACHE_SALT_CHARS = 1024


def check_cache_salt(salt, field_name: str = "cache_salt") -> str:
    """vLLM's cache_salt: prompts share cached KV blocks only with prompts of the same salt
    (block_manager.salt_root); empty means the shared cache."""
    if not isinstance(salt, str) or len(salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequest(field_name, f"must be a string of at most {MAX_CACHE_SALT_CHARS} "
                                         f"characters, got {salt!r:.100}")
    return salt
