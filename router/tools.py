"""Tool calling for ``/v1/chat/completions``: the request's ``tools`` and ``tool_choice``, the
prompt that shows the model its tools, the constraint that holds its answer to a call, and the
parser that finds the calls in what it wrote.

The model writes a call in the Hermes format (Qwen2.5 / Qwen3 / Hermes templates' own; the
format most open chat models were tuned on)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

or, where the chat template is Llama 3.1-3.3's (template_call_format; the router's
``--tool-call-parser`` overrides it), in Llama 3's JSON format: the whole answer is the calls,
JSON objects separated by "; ", optionally after ``<|python_tag|>``::

    {"name": "get_weather", "parameters": {"city": "Paris"}}

A request's ToolRequest carries the format (ModelFrontend.tools_for); its parser, constraint and
the fallback prompt below follow it.

- The prompt: a chat template that renders tools itself (its source mentions ``tools``) gets
  them as Hugging Face templates take them (``tools=``, assistant ``tool_calls`` with arguments
  as objects, ``tool`` messages with ``tool_call_id``). A template that does not (SmolLM2's) gets
  them written into the system message by :func:`render_fallback`, with the format above, and
  earlier calls and results written into the messages' text the same way.
- ``tool_choice``: ``"none"`` leaves the tools out of the prompt and never parses calls (as
  vLLM's ``--exclude-tools-when-tool-choice-none``). ``"auto"`` (the default when tools are given)
  generates freely and parses the calls out of the text; a call that is not valid JSON or names
  no known tool stays in ``content``. When a tool says ``"strict": true``, ``"auto"`` text stays
  free but whatever follows a ``<tool_call>`` tag is held to a call of one of the tools (with
  arguments valid for a strict tool's schema), as vLLM does. ``"required"`` and a named function hold the output to one
  or more calls (one, for a named function or ``parallel_tool_calls: false``) with a Lark grammar
  (llguidance, nxdi_common/serving/structured.py): the function's name is fixed or one of the
  tools', its arguments valid JSON of the function's ``parameters`` schema; nothing may come
  after the last call. The workers see an ordinary ``lark_grammar`` structured output.
- The answer: ``message.tool_calls`` (ids ``call_<hex>``; arguments as JSON text), ``content``
  what came outside the calls (its trailing whitespace dropped; null when nothing is left),
  ``finish_reason`` ``"tool_calls"`` when
  the model called a tool and was not cut off (``"length"`` stays). Streaming, text outside a call
  streams as content as it comes (a possible start of ``<tool_call>`` is held back until it is
  told apart, and whitespace until text follows it) and each call is sent as one ``tool_calls`` delta once its closing tag (or the end
  of the output) arrives.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, replace

from nxdi_common.serving.errors import InvalidRequest
from nxdi_common.serving.structured import JSON_DEFAULTS
from nxdi_common.serving.types import SamplingOptions, StructuredOutput

MAX_TOOLS = 128  # OpenAI's limit
NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_MODES = ("none", "auto", "required")
HERMES, LLAMA3_JSON = "hermes", "llama3_json"
CALL_FORMATS = (HERMES, LLAMA3_JSON)  # FORMATS (end of the module) holds what each one is
PYTHON_TAG = "<|python_tag|>"  # Llama 3.x: may open a call (its built-in tools' marker)


@dataclass(frozen=True)
class CallFormat:
    """How a model writes a tool call: ``opening`` {"name": ..., ``key``: {arguments}}
    ``closing``, calls ``separator`` apart; ``trigger`` starts a call inside free text (strict
    "auto"), ``parser`` finds calls in the output (CallParser / JsonCallParser), ``how`` tells
    the model the format in router/tools.py's own prompt."""

    opening: str
    closing: str
    key: str
    separator: str
    trigger: str
    parser: type
    how: str

    def ends(self, name: str) -> tuple[str, str]:
        """The text of a call of ``name`` before its arguments object, and after it."""
        return f'{self.opening}{{"name": {json.dumps(name)}, "{self.key}": ', "}" + self.closing

    def write(self, name: str, arguments) -> str:
        return f"{self.opening}{json.dumps({'name': name, self.key: arguments})}{self.closing}"


@dataclass(frozen=True)
class Tool:
    """One function the model may call."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object"}'  # its JSON Schema, as JSON text
    strict: bool = False  # hold "auto" calls of it to its schema too

    def as_openai(self) -> dict:
        """The tool as Hugging Face chat templates and the fallback prompt show it."""
        function = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = json.loads(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: the function's name and its arguments (a JSON object, as text)."""

    name: str
    arguments: str
    id: str = ""

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id or new_call_id(), "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools and what it asked of them."""

    tools: tuple[Tool, ...]
    mode: str = "auto"  # "none" | "auto" | "required" | "named"
    name: str = ""  # the function, when mode == "named"
    parallel: bool = True  # more than one call allowed (parallel_tool_calls)
    call_format: str = HERMES  # how the model writes calls (the frontend's, CALL_FORMATS)

    @property
    def in_prompt(self) -> bool:
        return self.mode != "none"

    @property
    def parses_calls(self) -> bool:
        return self.mode != "none"

    def names(self) -> set[str]:
        return {t.name for t in self.tools}

    @property
    def fmt(self) -> CallFormat:
        return FORMATS[self.call_format]

    def parser(self) -> CallParser | JsonCallParser:
        """A streaming parser of this request's calls in its format."""
        return self.fmt.parser(self.names(), not self.parallel)

    def split(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output as (content, calls) (split_output in this request's format)."""
        return split_output(text, self.names(), not self.parallel, self.call_format)

    def constraint(self) -> StructuredOutput | None:
        """The Lark grammar that holds a "required" or named answer to calls, or an "auto"
        answer's calls when a tool is strict (None otherwise)."""
        if self.mode == "auto" and any(t.strict for t in self.tools):
            return self._strict_auto()
        if self.mode not in ("required", "named"):
            return None
        tools = [t for t in self.tools if self.mode == "required" or t.name == self.name]
        lines = ["start: " + ("call" if self.mode == "named" or not self.parallel
                              else f"call ({json.dumps(self.fmt.separator)} call)*"),
                 "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
        for i, tool in enumerate(tools):
            # bounded JSON whitespace as response_format's (a schema's own x-guidance wins)
            schema = {"x-guidance": JSON_DEFAULTS, **json.loads(tool.parameters)}
            begin, end = self.fmt.ends(tool.name)
            lines += [f"call_{i}: {json.dumps(begin)} args_{i} {json.dumps(end)}",
                      f"args_{i}: %json {json.dumps(schema)}"]
        return StructuredOutput("lark_grammar", "\n".join(lines) + "\n")

    def _strict_auto(self) -> StructuredOutput:
        """Free text, but what follows a ``<tool_call>`` tag (Llama 3.x: ``{"name": ``) is a
        call of one of the tools with arguments valid for its schema (a strict tool's; any
        object for the others): llguidance's structural tags (a lazy trigger, then the call's
        grammar)."""
        from llguidance import StructTag
        tags = []
        for t in self.tools:
            begin, end = self.fmt.ends(t.name)
            tags.append(StructTag(
                trigger=self.fmt.trigger, begin=begin, end=end,
                grammar={"x-guidance": JSON_DEFAULTS,
                         **(json.loads(t.parameters) if t.strict else {"type": "object"})}))
        return StructuredOutput("lark_grammar", StructTag.to_grammar(tags, assume_special=False))


def with_tools(sampling: SamplingOptions, tools: ToolRequest | None,
               structured_field: str) -> SamplingOptions:
    """``sampling`` with the tools' constraint (ToolRequest.constraint); a structured output
    of the request's own (``structured_field`` names where it came from) is refused beside
    tools in effect: a tool call is not the format asked for."""
    if tools is None or not tools.parses_calls:
        return sampling
    if sampling.structured is not None:
        raise InvalidRequest(structured_field, "cannot be combined with tools unless "
                                               "tool_choice is 'none' (a tool call is not the "
                                               "format asked for)")
    constraint = tools.constraint()
    return sampling if constraint is None else replace(sampling, structured=constraint)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# --- the request -------------------------------------------------------------------------------


def parse_tools(tools, tool_choice, parallel_tool_calls) -> ToolRequest | None:
    """The request's tools and tool_choice, checked (InvalidRequest naming the parameter); None
    when it gave no tools (tool_choice then may only be "none")."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise InvalidRequest("tool_choice", "needs tools: give the functions in 'tools'")
        return None
    if not isinstance(tools, list):
        raise InvalidRequest("tools", "must be a list of {\"type\": \"function\", "
                                      "\"function\": {...}} objects")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    parsed = tuple(_tool(spec, f"tools[{i}]") for i, spec in enumerate(tools))
    seen: set[str] = set()
    for i, tool in enumerate(parsed):
        if tool.name in seen:
            raise InvalidRequest(f"tools[{i}].function.name",
                                 f"function {tool.name!r} is given twice")
        seen.add(tool.name)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequest("parallel_tool_calls", "must be true or false")
    mode, name = _choice(tool_choice, seen)
    return ToolRequest(parsed, mode, name, parallel_tool_calls is not False)


def _tool(spec, where: str) -> Tool:
    if not isinstance(spec, dict) or spec.get("type") != "function":
        raise InvalidRequest(f"{where}.type", "must be 'function' (the only tool type served)")
    _only_keys(spec, ("type", "function"), where)
    fn = spec.get("function")
    if not isinstance(fn, dict):
        raise InvalidRequest(f"{where}.function", "must be an object with a 'name'")
    _only_keys(fn, ("name", "description", "parameters", "strict"), f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise InvalidRequest(f"{where}.function.name", "must be 1-64 characters of a-z, A-Z, "
                                                       f"0-9, _ and -, got {name!r:.100}")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise InvalidRequest(f"{where}.function.description", "must be a string")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise InvalidRequest(f"{where}.function.parameters", "must be a JSON Schema object")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest(f"{where}.function.strict", "must be true or false")
    return Tool(name, description, json.dumps(params), bool(strict))


def _choice(choice, names: set[str]) -> tuple[str, str]:
    if choice is None:
        return "auto", ""
    if isinstance(choice, str):
        if choice not in TOOL_MODES:
            raise InvalidRequest("tool_choice", f"must be one of {list(TOOL_MODES)} or "
                                                f"{{\"type\": \"function\", \"function\": "
                                                f"{{\"name\": ...}}}}, got {choice!r:.100}")
        return choice, ""
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" \
            or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequest("tool_choice", "a named tool choice is {\"type\": \"function\", "
                                            "\"function\": {\"name\": ...}}")
    if fn["name"] not in names:
        raise InvalidRequest("tool_choice.function.name",
                             f"{fn['name']!r:.100} is not one of the tools: {sorted(names)}")
    return "named", fn["name"]


def _only_keys(obj: dict, allowed: tuple[str, ...], where: str) -> None:
    extra = [k for k in obj if k not in allowed]
    if extra:
        raise InvalidRequest(where, f"unsupported key {extra[0]!r:.100}")


def message_tool_calls(calls, where: str) -> tuple[ToolCall, ...]:
    """An assistant message's earlier ``tool_calls``, checked."""
    if not isinstance(calls, list):
        raise InvalidRequest(where, "must be a list of tool calls")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments", ""), str):
            raise InvalidRequest(f"{where}[{i}]", "must be {\"id\": ..., \"type\": \"function\","
                                                  " \"function\": {\"name\": ..., "
                                                  "\"arguments\": \"<JSON text>\"}}")
        call_id = call.get("id", "")
        if not isinstance(call_id, str):
            raise InvalidRequest(f"{where}[{i}].id", "must be a string")
        out.append(ToolCall(fn["name"], fn.get("arguments", "") or "{}", call_id))
    return tuple(out)


# --- the prompt --------------------------------------------------------------------------------


def _tools_template(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the "tool_use" one, else the default
        template = template.get("tool_use") or template.get("default")
    return template if isinstance(template, str) else ""


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template shows the model its tools itself."""
    return "tools" in _tools_template(tokenizer)


def template_call_format(tokenizer) -> str:
    """The call format the model's chat template teaches it: LLAMA3_JSON for Llama 3.1-3.3's
    (which ask for a JSON object {"name": ..., "parameters": ...}, built-in tools after
    <|python_tag|>), else HERMES (also what router/tools.py's own prompt teaches, for a template
    that does not render tools)."""
    template = _tools_template(tokenizer)
    if "tools" in template and (PYTHON_TAG in template
                                or '"parameters": dictionary of argument name' in template):
        return LLAMA3_JSON
    return HERMES


def _arguments_object(text: str):
    """Arguments as Hugging Face templates expect them: an object where the text is JSON."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value


def render_native(messages: list[dict], turns) -> list[dict]:
    """``messages`` (role and content) with the turns' tool calls and tool call ids, for a
    template that renders tools."""
    out = []
    for message, turn in zip(messages, turns):
        message = dict(message)
        if turn.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": _arguments_object(c.arguments)}}
                for c in turn.tool_calls]
        if turn.tool_call_id:
            message["tool_call_id"] = turn.tool_call_id
        out.append(message)
    return out


def format_call(call: ToolCall, call_format: str = HERMES) -> str:
    """A call in the format the model writes it."""
    return FORMATS[call_format].write(call.name, _arguments_object(call.arguments))


def tools_system_text(tools: tuple[Tool, ...], call_format: str = HERMES) -> str:
    listing = "\n".join(json.dumps(t.as_openai()) for t in tools)
    fmt = FORMATS[call_format]
    example = f'{fmt.opening}{{"name": <function-name>, "{fmt.key}": <args-json-object>}}' \
              f"{fmt.closing}"
    return ("You can call functions. Their signatures, as JSON Schema, are inside <tools></tools>:"
            f"\n<tools>\n{listing}\n</tools>\nTo call a function, answer with {fmt.how}:\n"
            f"{example}\n"
            "A function's result comes back inside <tool_response></tool_response> tags.")


def render_fallback(messages: list[dict], turns, tools: ToolRequest | None,
                    call_format: str = HERMES) -> list[dict]:
    """``messages`` with the tools in the (first) system message, earlier calls written into
    the assistant messages and tool results inside <tool_response> tags, for a template that
    does not render tools; calls written in ``call_format``."""
    out = []
    for message, turn in zip(messages, turns):
        content = message["content"]
        if turn.tool_calls:
            calls = FORMATS[call_format].separator.join(format_call(c, call_format)
                                                         for c in turn.tool_calls)
            content = f"{content}\n{calls}" if content else calls
        if turn.role == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({**message, "content": content})
    if tools is not None and tools.in_prompt:
        text = tools_system_text(tools.tools, call_format)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


# --- the answer ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Content:
    text: str


class CallParser:
    """Finds Hermes-format calls in a model's output as it streams: :meth:`feed` the text of each
    token, :meth:`finish` at the end; each returns the Content and ToolCall pieces now settled,
    in order. Only calls of ``names`` count; a block that is not such a call stays Content."""

    def __init__(self, names: set[str], first_only: bool = False):
        self.names, self.first_only = names, first_only
        self._buf = ""
        self._in_call = False
        self.calls = 0

    def feed(self, text: str) -> list:
        self._buf += text
        out: list = []
        while True:
            if self._in_call:
                end = self._buf.find(CALL_CLOSE)
                if end < 0:
                    return out
                out.append(self._call(self._buf[:end], CALL_CLOSE))
                self._buf = self._buf[end + len(CALL_CLOSE):]
                self._in_call = False
            else:
                start = self._buf.find(CALL_OPEN)
                if start < 0:
                    keep = _partial_suffix(self._buf, CALL_OPEN)
                    if len(self._buf) > keep:
                        out.append(Content(self._buf[:len(self._buf) - keep]))
                        self._buf = self._buf[len(self._buf) - keep:]
                    return out
                if start:
                    out.append(Content(self._buf[:start]))
                self._buf = self._buf[start + len(CALL_OPEN):]
                self._in_call = True

    def finish(self) -> list:
        """What is left: an unclosed call that parses is a call (the model stopped right after
        its JSON), anything else content."""
        rest, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            return [self._call(rest, "")]
        return [Content(rest)] if rest else []

    def _call(self, body: str, close: str):
        call = _parse_call(body, self.names)
        if call is None or (self.first_only and self.calls):
            return Content(f"{CALL_OPEN}{body}{close}") if call is None else Content("")
        self.calls += 1
        return call


class JsonCallParser:
    """Finds Llama 3.x calls in a model's output as it streams (feed / finish as CallParser).
    An output that opens (after whitespace, and an optional <|python_tag|>) with "{" is held to
    the end, then taken as calls when it is JSON objects {"name": <one of ``names``>,
    "parameters" (or "arguments"): {...}} separated by ";" and nothing else, else as content
    (as vLLM's llama3_json parser does); an output that opens with anything else is content,
    streamed as it comes."""

    def __init__(self, names: set[str], first_only: bool = False):
        self.names, self.first_only = names, first_only
        self._buf = ""
        self._held: bool | None = None  # None: not told apart yet
        self.calls = 0

    def feed(self, text: str) -> list:
        self._buf += text
        if self._held is None:
            head = self._buf.lstrip()
            if not head or (len(head) < len(PYTHON_TAG) and PYTHON_TAG.startswith(head)):
                return []
            self._held = head.startswith(("{", PYTHON_TAG))
        if self._held:
            return []
        out, self._buf = [Content(self._buf)] if self._buf else [], ""
        return out

    def finish(self) -> list:
        rest, self._buf = self._buf, ""
        calls = _parse_json_calls(rest, self.names) if self._held else None
        if calls is None:
            return [Content(rest)] if rest else []
        calls = calls[:1] if self.first_only else calls
        self.calls += len(calls)
        return calls


def _parse_json_calls(text: str, names: set[str]) -> list[ToolCall] | None:
    """``text`` as Llama 3.x calls (JsonCallParser), None when it is not only calls."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):]
    decoder, calls, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(body) and body[i].isspace():
            i += 1
        try:
            obj, i = decoder.raw_decode(body, i)
        except ValueError:
            return None
        call = _call_from(obj, names)
        if call is None:
            return None
        calls.append(call)
        while i < len(body) and body[i].isspace():
            i += 1
        if i == len(body):
            return calls
        if body[i] != ";":
            return None
        i += 1


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _parse_call(body: str, names: set[str]) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return _call_from(obj, names)


def _call_from(obj, names: set[str]) -> ToolCall | None:
    """A decoded call object as a ToolCall; None unless it names one of ``names`` and carries
    an arguments object ("arguments" or "parameters", or JSON text of one)."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # arguments written as JSON text (some models do)
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), new_call_id())


def split_output(text: str, names: set[str], first_only: bool = False,
                 call_format: str = HERMES) -> tuple[str | None, list[ToolCall]]:
    """A whole output as (content, calls): with calls, content is the text outside them less
    its trailing whitespace, None when that leaves nothing."""
    parser = FORMATS[call_format].parser(names, first_only)
    pieces = parser.feed(text) + parser.finish()
    content = "".join(p.text for p in pieces if isinstance(p, Content))
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    if calls:  # whitespace after the last text is the calls' layout, not content
        return content.rstrip() or None, calls
    return content, calls


FORMATS = {
    HERMES: CallFormat(f"{CALL_OPEN}\n", f"\n{CALL_CLOSE}", "arguments", "\n", CALL_OPEN,
                       CallParser, "a JSON object of its name and arguments inside "
                                   "<tool_call></tool_call> tags, one block for each call"),
    LLAMA3_JSON: CallFormat("", "", "parameters", "; ", '{"name": ', JsonCallParser,
                            'only a JSON object of its name and arguments, several separated '
                            'by "; "'),
}
