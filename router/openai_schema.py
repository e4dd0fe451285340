"""OpenAI request bodies (``/v1/completions``, ``/v1/chat/completions``) and their conversion to
a :class:`~router.frontend.RoutedRequest`.

Parsing is pydantic (strict types: ``"5"`` is not a number); every refusal becomes an
``InvalidRequest`` naming the parameter as the client spelled it. Parameters OpenAI defines but
this server does not implement (``best_of``, ``suffix``, the deprecated ``functions``,
...) are refused by name unless they carry their no-op default; unknown parameters are refused
too, as OpenAI does. ``tools`` / ``tool_choice``: router/tools.py.
Prompt scores: vLLM's ``prompt_logprobs`` (both endpoints, not streamed) and the completions
``echo`` (the prompt's text, and with ``logprobs`` its tokens' log-probabilities, before the
completion's; with ``max_tokens`` 0 the prompt alone, which is what lm-evaluation-harness's
loglikelihood requests send) ask the workers to score the prompt (SamplingOptions.
prompt_logprobs); router/openai_format.py shapes the answer.
``n`` choices (at most MAX_CHOICES) are ``n`` requests the gateway sends and merges
(router/openai_api.py)."""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from nxdi_common.serving.errors import InvalidRequest
from nxdi_common.serving.types import (MAX_TOP_LOGPROBS, SamplingOptions, StopOptions,
                                       StructuredOutput)
from router.frontend import ChatOptions, ChatTurn, ModelFrontend, RoutedRequest
from router.tools import ToolRequest, parse_tools, with_tools

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions: logprobs is an integer in [0, 5]
MAX_CHOICES = 16  # n
MAX_PROMPTS = 64  # prompts in one /v1/completions request
# Parameter -> the values it may carry here (null is always allowed): anything else is refused.
NO_OP_VALUES: dict[str, tuple] = {
    "best_of": (1,), "suffix": ("",),
    "functions": ([],), "function_call": ("none",),
    "modalities": (["text"],), "audio": (),
    "prediction": (), "web_search_options": (), "reasoning_effort": (),
}
COMPLETIONS_EXTRAS = ("best_of", "suffix")
# structured_outputs (vLLM's extension): exactly one of these keys -> StructuredOutput kind
STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                   "grammar": "lark_grammar"}
CHAT_EXTRAS = tuple(k for k in NO_OP_VALUES if k not in ("best_of", "suffix"))


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _Common(_Strict):
    """Parameters both endpoints take (top_k, min_p, repetition_penalty, stop_token_ids,
    min_tokens and ignore_eos are vLLM's extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: Any = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's: keep only the prompt's last N tokens; special tokens' text in the output; the
    # stop string or stop token that ended the output kept at its end
    truncate_prompt_tokens: int | None = None
    priority: int | None = None  # vLLM's: lower first (--scheduling-policy priority)
    cache_salt: str | None = None  # vLLM's: cached blocks shared only with the same salt
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # OpenAI's text / json_object / json_schema, on both endpoints (as vLLM), and vLLM's
    # structured_outputs extension ({"json" | "regex" | "choice" | "grammar": ...})
    response_format: dict | None = None
    structured_outputs: dict | None = None
    # vLLM's: score the prompt with this many alternatives a position (module doc)
    prompt_logprobs: int | None = None
    user: str | None = None  # accepted and ignored
    # Accepted and ignored (OpenAI bookkeeping that changes nothing here):
    store: bool | None = None
    metadata: dict | None = None
    service_tier: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value):
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise ValueError("must be a string or a list of strings")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    """``POST /v1/completions``: prompt is a string, a list of token ids, or a batch of either
    (a list of strings or of token id lists, up to MAX_PROMPTS; ``prompts``)."""

    prompt: Any
    logprobs: int | None = None
    echo: bool | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value):
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]  # a batch of one
        if _one_prompt(value):
            return value
        if isinstance(value, list) and value and all(
                isinstance(p, (str, list)) and _one_prompt(p) for p in value):
            if len(value) > MAX_PROMPTS:
                raise ValueError(f"a batch holds at most {MAX_PROMPTS} prompts, got {len(value)}")
            return value
        raise ValueError("must be a string, a list of token ids, or a list of either (a batch "
                         "of prompts)")

    @property
    def prompts(self) -> list:
        """The prompts: one, or the batch's."""
        return [self.prompt] if _one_prompt(self.prompt) else list(self.prompt)


def _one_prompt(value) -> bool:
    return isinstance(value, str) or (isinstance(value, list)
                                      and all(type(t) is int for t in value))


class ChatMessageIn(_Strict):
    """One message; content is a string or a list of {"type": "text", "text": ...} parts; an
    assistant message may carry its tool_calls, a tool message the tool_call_id it answers."""

    role: str
    content: Any = None
    name: str | None = None
    tool_calls: Any = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value):
        if value is None or isinstance(value, str):
            return value or ""
        if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                           and isinstance(p.get("text"), str) for p in value):
            return "".join(p["text"] for p in value)
        raise ValueError('must be a string or a list of {"type": "text", "text": ...} parts '
                         "(only text is supported)")


class ChatRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat parameters (router.frontend.ChatOptions)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict | None = None


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's): a prompt, or chat messages (with tools) through the chat
    template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    tools: Any = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[int]


def tokenize(body: TokenizeRequest, frontend: ModelFrontend) -> dict:
    """The /tokenize answer: the ids, their count, the context limit (and each id's text)."""
    frontend.check_model(body.model)
    check_extras(body, ())
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("prompt", "give exactly one of prompt or messages")
    if body.prompt is not None:
        for name in ("tools", "add_generation_prompt", "continue_final_message",
                     "chat_template_kwargs"):
            if getattr(body, name) is not None:
                raise InvalidRequest(name, "only with messages")
        ids = frontend.encode_text(body.prompt, body.add_special_tokens is not False)
    else:
        if body.add_special_tokens:
            raise InvalidRequest("add_special_tokens", "only with prompt (the chat template "
                                                       "writes a conversation's special tokens)")
        tools = parse_tools(body.tools, None, None)
        ids = frontend.encode_chat(chat_turns(body), "messages", tools, chat_options(body))
    reply = {"count": len(ids), "max_model_len": frontend.limits.max_model_len, "tokens": ids}
    if body.return_token_strs:
        reply["token_strs"] = frontend.tokenizer.convert_ids_to_tokens(ids)
    return reply


def detokenize(body: DetokenizeRequest, frontend: ModelFrontend) -> dict:
    frontend.check_model(body.model)
    check_extras(body, ())
    bad = [t for t in body.tokens if not 0 <= t < frontend.limits.vocab_size]
    if bad:
        raise InvalidRequest("tokens", f"token id {bad[0]} is outside "
                                       f"[0, {frontend.limits.vocab_size})")
    return {"prompt": frontend.tokenizer.decode(body.tokens)}


# --- checks ------------------------------------------------------------------------------------


def check_extras(body: _Strict, allowed_extras: tuple[str, ...]) -> None:
    """Refuse unimplemented OpenAI parameters unless they hold their no-op value, and refuse
    unknown parameters, naming the parameter."""
    for name, value in (body.model_extra or {}).items():
        if name not in allowed_extras:
            raise InvalidRequest(name, f"unrecognized request argument {name!r}")
        if value is None or _is_no_op(value, NO_OP_VALUES[name]):
            continue
        hint = f" (only {NO_OP_VALUES[name][0]!r})" if NO_OP_VALUES[name] else ""
        raise InvalidRequest(name, f"is not supported by this server{hint}, got {value!r}")


def _is_no_op(value, allowed: tuple) -> bool:
    return any(type(value) is type(a) and value == a for a in allowed) or (
        type(value) is float and any(type(a) is int and value == a for a in allowed))


def _check_stream_options(body: _Common) -> None:
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest("stream_options", "is only allowed when stream is true")


def _stop_options(body: _Common, max_tokens: int | None) -> StopOptions:
    stop = body.stop
    strings = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    return StopOptions(max_tokens=max_tokens, stop_token_ids=tuple(body.stop_token_ids or ()),
                       stop_strings=strings, ignore_eos=bool(body.ignore_eos),
                       min_tokens=body.min_tokens or 0,
                       skip_special_tokens=body.skip_special_tokens is not False,
                       include_stop_str_in_output=bool(body.include_stop_str_in_output))


def _prompt_logprobs(body: _Common, implied: int | None = None) -> int | None:
    """The prompt scores asked for: prompt_logprobs, else ``implied`` (echo with logprobs);
    refused with a stream (the scores come whole, as vLLM's)."""
    if body.prompt_logprobs is None:
        return implied
    if type(body.prompt_logprobs) is not int or not 0 <= body.prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest("prompt_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}] "
                                                f"(alternatives per prompt position), got "
                                                f"{body.prompt_logprobs!r}")
    if body.stream:
        raise InvalidRequest("prompt_logprobs", "is not available when stream is true")
    return body.prompt_logprobs


def _sampling(body: _Common, logprobs: bool, top_logprobs: int,
              prompt_logprobs: int | None = None) -> SamplingOptions:
    return SamplingOptions(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=-1 if body.top_k is None else body.top_k,
        top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed, logprobs=logprobs,
        top_logprobs=top_logprobs,
        presence_penalty=0.0 if body.presence_penalty is None else body.presence_penalty,
        frequency_penalty=0.0 if body.frequency_penalty is None else body.frequency_penalty,
        logit_bias=_logit_bias(body.logit_bias), structured=structured_output(body),
        min_p=0.0 if body.min_p is None else body.min_p,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        prompt_logprobs=prompt_logprobs)


def _logit_bias(value: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as sorted (id, bias) pairs (ranges: SamplingOptions)."""
    pairs = []
    for key, bias in (value or {}).items():
        if not key.isdigit() or not key.isascii():
            raise InvalidRequest("logit_bias", f"keys must be token ids (decimal integers), "
                                               f"got {key!r:.100}")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def structured_field(body: _Common) -> str:
    """The parameter a request's structured output came from (for error messages)."""
    if body.structured_outputs is not None:
        return "structured_outputs"
    return "response_format" if body.response_format is not None else "tools"


def structured_output(body: _Common) -> StructuredOutput | None:
    """The request's constraint from response_format or structured_outputs (one of them)."""
    if body.response_format is not None and body.structured_outputs is not None:
        raise InvalidRequest("structured_outputs", "give response_format or structured_outputs, "
                                                   "not both")
    if body.structured_outputs is not None:
        return _from_structured_outputs(body.structured_outputs)
    if body.response_format is not None:
        return _from_response_format(body.response_format)
    return None


def _from_response_format(rf: dict) -> StructuredOutput | None:
    kind = rf.get("type")
    if kind == "text":
        _only_keys(rf, ("type",), "response_format")
        return None
    if kind == "json_object":
        _only_keys(rf, ("type",), "response_format")
        return StructuredOutput("json_schema", '{"type": "object"}').validate("response_format")
    if kind == "json_schema":
        _only_keys(rf, ("type", "json_schema"), "response_format")
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequest("response_format.json_schema", "must be an object with a "
                                                                "'schema'")
        _only_keys(spec, ("name", "description", "schema", "strict"),
                   "response_format.json_schema")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequest("response_format.json_schema.schema",
                                 "must be a JSON Schema object")
        return StructuredOutput("json_schema", json.dumps(schema)).validate("response_format")
    raise InvalidRequest("response_format.type", f"must be 'text', 'json_object' or "
                                                 f"'json_schema', got {kind!r:.100}")


def _from_structured_outputs(so: dict) -> StructuredOutput:
    given = [k for k, v in so.items() if v is not None]
    unknown = [k for k in given if k not in STRUCTURED_KEYS]
    if unknown:
        raise InvalidRequest("structured_outputs", f"unsupported key {unknown[0]!r:.100}; one "
                                                   f"of {', '.join(STRUCTURED_KEYS)}")
    if len(given) != 1:
        raise InvalidRequest("structured_outputs", f"needs exactly one of "
                                                   f"{', '.join(STRUCTURED_KEYS)}, got {given}")
    key = given[0]
    value, kind = so[key], STRUCTURED_KEYS[key]
    if key == "json":  # a schema, or a schema as JSON text (validate parses and checks it)
        if not isinstance(value, (dict, str)):
            raise InvalidRequest("structured_outputs.json", "must be a JSON Schema object")
        out = StructuredOutput(kind, value if isinstance(value, str) else json.dumps(value))
    elif key == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise InvalidRequest("structured_outputs.choice", "must be a list of strings")
        out = StructuredOutput(kind, choices=tuple(value))
    else:
        if not isinstance(value, str):
            raise InvalidRequest(f"structured_outputs.{key}", "must be a string")
        out = StructuredOutput(kind, value)
    return out.validate(f"structured_outputs.{key}")


def _only_keys(obj: dict, allowed: tuple[str, ...], field_name: str) -> None:
    extra = [k for k in obj if k not in allowed]
    if extra:
        raise InvalidRequest(field_name, f"unsupported key {extra[0]!r:.100}")


# --- conversion --------------------------------------------------------------------------------


def choices(body: _Common) -> int:
    """The number of choices asked for (n), checked."""
    if body.n is None:
        return 1
    if not 1 <= body.n <= MAX_CHOICES:
        raise InvalidRequest("n", f"must be an integer in [1, {MAX_CHOICES}], got {body.n}")
    return body.n


def completions_to_routed(body: CompletionRequest, frontend: ModelFrontend) -> list[RoutedRequest]:
    """Validate a completions request and tokenize each of its prompts (errors name the
    batch's prompt as prompt[i])."""
    prompts = body.prompts
    if len(prompts) == 1:
        return [completion_to_routed(body, frontend)]
    return [completion_to_routed(body, frontend, prompt=p, field=f"prompt[{i}]")
            for i, p in enumerate(prompts)]


def completion_to_routed(body: CompletionRequest, frontend: ModelFrontend,
                         request_id: str = "", prompt=None, field: str = "prompt") -> RoutedRequest:
    """Validate a completions request and tokenize its prompt (``prompt``: one of a batch's)."""
    check_extras(body, COMPLETIONS_EXTRAS)
    choices(body)
    frontend.check_model(body.model)
    _check_stream_options(body)
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise InvalidRequest("logprobs", f"must be an integer in [0, {MAX_COMPLETION_LOGPROBS}],"
                                         f" got {body.logprobs!r}")
    implied = body.logprobs if body.echo else None  # echo's prompt tokens get logprobs too
    sampling = _sampling(body, body.logprobs is not None, body.logprobs or 0,
                         _prompt_logprobs(body, implied))
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    if max_tokens == 0:
        if not body.echo:
            raise InvalidRequest("max_tokens", "must be an integer >= 1, got 0 (0 only with "
                                               "echo: the prompt alone)")
        max_tokens = 1  # the prompt alone: one token is generated and not returned
    stop = _stop_options(body, max_tokens)
    sampling.validate()
    stop.validate()
    prompt = body.prompt if prompt is None else prompt
    ids = frontend.encode_text(prompt) if isinstance(prompt, str) else prompt
    return frontend.prepare(ids, sampling, stop, field, request_id, body.truncate_prompt_tokens,
                            body.priority or 0, body.cache_salt or "")


def chat_tools(body: ChatRequest) -> ToolRequest | None:
    """The request's tools and tool choice (router/tools.py), checked; None without tools."""
    return parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls)


def chat_turns(body: ChatRequest | TokenizeRequest) -> list[ChatTurn]:
    """The messages as chat turns; tool_calls and tool_call_id checked."""
    return [ChatTurn.checked(m.role, m.content, m.tool_calls, m.tool_call_id, f"messages[{i}]")
            for i, m in enumerate(body.messages)]


def chat_options(body: ChatRequest | TokenizeRequest) -> ChatOptions:
    """How the request's messages are rendered (generation prompt, final message continued,
    template variables), checked."""
    return ChatOptions.checked(body.add_generation_prompt, body.continue_final_message,
                               body.chat_template_kwargs)


def chat_to_routed(body: ChatRequest, frontend: ModelFrontend, request_id: str = "",
                   tools: ToolRequest | None = None) -> RoutedRequest:
    """Validate a chat request, apply the chat template and tokenize (``tools``: chat_tools'
    answer for it)."""
    check_extras(body, CHAT_EXTRAS)
    choices(body)
    frontend.check_model(body.model)
    _check_stream_options(body)
    sampling = with_tools(_sampling(body, bool(body.logprobs), body.top_logprobs or 0,
                                    _prompt_logprobs(body)), tools, structured_field(body))
    field = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    max_tokens = body.max_tokens if body.max_completion_tokens is None \
        else body.max_completion_tokens
    try:
        stop = _stop_options(body, max_tokens)
        sampling.validate()
        stop.validate()
        ids = frontend.encode_chat(chat_turns(body), "messages", tools, chat_options(body))
        return frontend.prepare(ids, sampling, stop, "messages", request_id,
                                body.truncate_prompt_tokens, body.priority or 0,
                                body.cache_salt or "")
    except InvalidRequest as exc:
        if exc.field == "max_tokens" and field != exc.field:
            raise InvalidRequest(field, str(exc).split(": ", 1)[1]) from None
        raise
