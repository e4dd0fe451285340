"""The served model as the router sees it: its name, tokenizer and limits, and the one validation
path every entry point (HTTP and gRPC) goes through to turn a client's request into a
:class:`RoutedRequest` (tokenized, checked, with max_tokens resolved).

No protobuf here and no HTTP: the OpenAI gateway and the gRPC servicer each parse their own wire
format into text / token ids / chat messages plus SamplingOptions and StopOptions, then call
:meth:`ModelFrontend.prepare_*`, so both refuse exactly the same inputs with the same messages."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from nxdi_common.serving.errors import InvalidRequest, ModelNotFound
from nxdi_common.serving.structured import GrammarCompiler
from nxdi_common.serving.types import (ModelLimits, SamplingOptions, StopOptions,
                                       check_cache_salt, check_priority, check_prompt,
                                       check_sampling, resolve_max_tokens)
from router.tools import ToolCall, ToolRequest, message_tool_calls, render_fallback, \
    render_native, template_call_format, template_renders_tools

log = logging.getLogger(__name__)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatTurn:
    """One chat message (role and text) before the chat template is applied; an assistant
    message may carry the tool calls it made, a tool message the id of the call it answers."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""

    @classmethod
    def checked(cls, role: str, content: str, tool_calls, tool_call_id: str,
                where: str) -> ChatTurn:
        """A turn from a request's message ``where`` (both APIs): ``tool_calls`` in OpenAI's
        shape (None: none) only on an assistant message, a tool message's call id required."""
        calls = ()
        if tool_calls is not None:
            if role != "assistant":
                raise InvalidRequest(f"{where}.tool_calls", "only an assistant message carries "
                                                            "tool_calls")
            calls = message_tool_calls(tool_calls, f"{where}.tool_calls")
        if role == "tool" and not tool_call_id:
            raise InvalidRequest(f"{where}.tool_call_id", "a tool message needs the id of the "
                                                          "call it answers")
        return cls(role, content, calls, tool_call_id or "")


@dataclass(frozen=True)
class RoutedRequest:
    """A validated, tokenized request ready to send to a decode worker.

    ``stop.max_tokens`` is always set (resolved against the context length)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingOptions
    stop: StopOptions
    priority: int = 0  # lower is served first where requests wait (types.check_priority)
    cache_salt: str = ""  # shares cached blocks only with its own salt (types.check_cache_salt)


# apply_chat_template arguments the server sets itself: a request's chat_template_kwargs may not
# name them (messages, tools and the generation prompt have request fields of their own)
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "return_dict", "return_tensors", "padding",
    "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"})


@dataclass(frozen=True)
class ChatOptions:
    """How a conversation is rendered (vLLM's chat parameters): the assistant generation prompt
    after the last message, or (``continue_final_message``) the last message, an assistant's,
    left open for the answer to continue; ``template_kwargs`` are extra variables for the chat
    template (e.g. Qwen3's ``enable_thinking``)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: tuple[tuple[str, object], ...] = ()

    @classmethod
    def checked(cls, add_generation_prompt: bool | None, continue_final_message: bool | None,
                template_kwargs, kwargs_field: str = "chat_template_kwargs") -> ChatOptions:
        """From a request's fields (None: the default); raises InvalidRequest naming the field."""
        cont = bool(continue_final_message)
        gen = (not cont) if add_generation_prompt is None else add_generation_prompt
        if cont and gen:
            raise InvalidRequest("continue_final_message", "cannot be true with "
                                 "add_generation_prompt true (set add_generation_prompt false)")
        if template_kwargs is None:
            template_kwargs = {}
        if not isinstance(template_kwargs, dict):
            raise InvalidRequest(kwargs_field, "must be an object of template variables")
        for key in template_kwargs:
            if key in RESERVED_TEMPLATE_KWARGS:
                raise InvalidRequest(f"{kwargs_field}.{key}", "is set by the server, not by "
                                     "chat_template_kwargs (use the request's own field)")
        return cls(gen, cont, tuple(sorted(template_kwargs.items())))


def new_request_id() -> str:
    """A fresh unique request id (uuid4, hex)."""
    return uuid.uuid4().hex


class ModelFrontend:
    """Tokenizer plus limits of the one model this router serves."""

    def __init__(self, name: str, tokenizer, limits: ModelLimits, created: int | None = None):
        if not name:
            raise ValueError("model name must be non-empty")
        self.name = name
        self.tokenizer = tokenizer
        self.limits = limits
        self.created = int(time.time()) if created is None else created
        # --scheduling-policy priority: requests may carry a priority (else only 0, as vLLM)
        self.priority_scheduling = False
        self.native_tools = template_renders_tools(tokenizer)  # else router/tools.py's prompt
        # how the model writes tool calls (router/tools.py CALL_FORMATS; --tool-call-parser)
        self.tool_call_format = template_call_format(tokenizer)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.grammars = GrammarCompiler(lambda: self.tokenizer, limits.vocab_size,
                                        [] if eos is None else [eos])

    @classmethod
    def from_options(cls, opts, name: str | None = None) -> ModelFrontend:
        """Load the tokenizer of ``opts`` (a worker.ModelOptions); the vocabulary size comes from
        the checkpoint's config.json (the embedding rows), else the tokenizer's length."""
        from nxdi_common.serving.worker import load_tokenizer
        model_dir = opts.model_dir()
        tokenizer = load_tokenizer(opts)
        vocab = _config_vocab_size(model_dir) or len(tokenizer)
        limits = ModelLimits(max_model_len=opts.max_model_len, vocab_size=vocab)
        return cls(name or model_dir.name, tokenizer, limits)

    # --- checks --------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        """Empty or missing means this router's model; anything else must be its name."""
        if model and model != self.name:
            raise ModelNotFound("model", f"model {model!r} is not served here; "
                                         f"available: [{self.name!r}]")

    def tools_for(self, tools: ToolRequest | None) -> ToolRequest | None:
        """A request's tools with this model's call format (parser, constraint)."""
        return None if tools is None else dataclasses.replace(
            tools, call_format=self.tool_call_format)

    # --- tokenization --------------------------------------------------------------------

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a raw prompt (the tokenizer's own special tokens added, no template)."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def encode_chat(self, turns: list[ChatTurn], field_name: str = "messages",
                    tools: ToolRequest | None = None,
                    options: ChatOptions = ChatOptions()) -> list[int]:
        """Apply the model's chat template as ``options`` say (by default with the assistant
        generation prompt), tokenize; with ``tools`` (and in any case for earlier tool calls
        and results) as router/tools.py says: through the template where it renders tools,
        else written into the messages."""
        if not turns:
            raise InvalidRequest(field_name, "must contain at least one message")
        if options.continue_final_message and turns[-1].role != "assistant":
            raise InvalidRequest("continue_final_message", f"needs an assistant message last "
                                 f"in {field_name} (the one to continue), got "
                                 f"{turns[-1].role!r}")
        for i, turn in enumerate(turns):
            if turn.role not in CHAT_ROLES:
                raise InvalidRequest(f"{field_name}[{i}].role",
                                     f"must be one of {list(CHAT_ROLES)}, got {turn.role!r}")
        messages = [{"role": "system" if t.role == "developer" else t.role, "content": t.content}
                    for t in turns]
        extra = dict(options.template_kwargs)
        if options.continue_final_message:
            extra["continue_final_message"] = True
        if self.native_tools:
            messages = render_native(messages, turns)
            if tools is not None and tools.in_prompt:
                extra["tools"] = [t.as_openai() for t in tools.tools]
        else:
            messages = render_fallback(messages, turns, tools, self.tool_call_format)
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=options.add_generation_prompt,
                **extra)
        except Exception as exc:  # noqa: BLE001 - a template refusing the conversation
            raise InvalidRequest(field_name, f"the chat template refused it: {exc}") from exc
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def token_text(self, token_id: int) -> str:
        """The decoded text of one token (for logprob listings)."""
        return self.tokenizer.decode([token_id])

    # --- the one validation path ---------------------------------------------------------

    def prepare(self, prompt_ids: list[int], sampling: SamplingOptions, stop: StopOptions,
                prompt_field: str = "prompt", request_id: str = "",
                truncate_prompt_tokens: int | None = None, priority: int = 0,
                cache_salt: str = "") -> RoutedRequest:
        """Validate everything and resolve max_tokens; raises InvalidRequest naming the field.
        ``truncate_prompt_tokens`` (vLLM's): keep only the prompt's last that many tokens (-1:
        the context length's worth); ``priority``: non-zero only with priority scheduling."""
        check_priority(priority)
        check_cache_salt(cache_salt)
        if priority and not self.priority_scheduling:
            raise InvalidRequest("priority", f"must be 0 on this router (got {priority}): "
                                 f"priority scheduling is off (--scheduling-policy priority)")
        if truncate_prompt_tokens is not None:
            prompt_ids = self.truncated(prompt_ids, truncate_prompt_tokens)
        sampling.validate()
        stop.validate()
        _check_stop_ids(stop, self.limits)
        check_sampling(sampling, self.limits)
        check_prompt(prompt_ids, self.limits, prompt_field)
        max_tokens = resolve_max_tokens(len(prompt_ids), stop, self.limits)
        stop = replace(stop, max_tokens=max_tokens).validate()  # min_tokens within what is left
        return RoutedRequest(request_id or new_request_id(), tuple(prompt_ids), sampling, stop,
                             priority, cache_salt)


    def truncated(self, prompt_ids: list[int], keep: int) -> list[int]:
        """The last ``keep`` tokens of the prompt (-1: max_model_len)."""
        limit = self.limits.max_model_len
        if isinstance(keep, bool) or not isinstance(keep, int) or not (
                keep == -1 or 1 <= keep <= limit):
            raise InvalidRequest("truncate_prompt_tokens", f"must be -1 (the context length) or "
                                 f"an integer in [1, {limit}], got {keep!r}")
        keep = limit if keep == -1 else keep
        return list(prompt_ids[-keep:])

    async def check_structured(self, sampling: SamplingOptions, field_name: str) -> None:
        """Refuse (InvalidRequest naming field_name) a structured output that does not compile,
        before any worker is asked (off the event loop; workers compile it again for use)."""
        if sampling.structured is not None:
            await asyncio.to_thread(self.grammars.compile, sampling.structured, field_name)


def _check_stop_ids(stop: StopOptions, limits: ModelLimits) -> None:
    for t in stop.stop_token_ids:
        if not isinstance(t, int) or not 0 <= t < limits.vocab_size:
            raise InvalidRequest("stop_token_ids", f"token id {t!r} is outside "
                                                   f"[0, {limits.vocab_size})")


def _config_vocab_size(model_dir: Path) -> int | None:
    path = Path(model_dir) / "config.json"
    try:
        value = json.loads(path.read_text()).get("vocab_size")
    except (OSError, ValueError) as exc:
        log.warning("cannot read vocab_size from %s (%s); using the tokenizer's length", path, exc)
        return None
    return value if isinstance(value, int) and value > 0 else None
