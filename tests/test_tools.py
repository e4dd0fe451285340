"""Tool calling pieces (router/tools.py, the chat formatter's tool mode): the call parser, whole
and fed in every split; the grammar that holds "required" and named answers to calls, against
llguidance with the bundled tokenizer; the prompt with and without a tool-aware template; the
stream's chunks. The HTTP path on real processes: tests/test_openai_extras.py."""
import dataclasses
import json
import random

import pytest

from nxdi_common.serving import types as t
from nxdi_common.serving.structured import GrammarCompiler
from nxdi_common.serving.types import TokenOutput
from router.frontend import ChatTurn, ModelFrontend
from router.openai_format import ChatFormatter
from router.openai_schema import ChatRequest, chat_to_routed, chat_tools
from router.tools import (CallParser, Content, JsonCallParser, ToolCall, parse_tools,
                          split_output, template_call_format, template_renders_tools)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}
NAMES = {"get_weather", "add"}
CALL_W = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n' \
         '</tool_call>'
CALL_A = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


# --- the parser ----------------------------------------------------------------------------------

CASES = [
    # output -> (content, [(name, arguments)])
    ("Just text.", ("Just text.", [])),
    (CALL_W, (None, [("get_weather", {"city": "Paris", "unit": "c"})])),
    (f"Let me check.\n{CALL_W}\n{CALL_A}", ("Let me check.",
                                             [("get_weather", {"city": "Paris", "unit": "c"}),
                                              ("add", {"a": 1, "b": 2})])),
    (f"{CALL_A}\nDone.", ("\nDone.", [("add", {"a": 1, "b": 2})])),
    # not JSON, or a function that is not a tool: text, as written
    ("<tool_call>\n{oops}\n</tool_call>", ("<tool_call>\n{oops}\n</tool_call>", [])),
    ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
     ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', [])),
    ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>',
     ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', [])),
    # the model stopped after the JSON, before the closing tag
    ('<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 6}}',
     (None, [("add", {"a": 5, "b": 6})])),
    # cut off inside a call, and a tag's start at the very end: text
    ('<tool_call>\n{"name": "add", "argu', ('<tool_call>\n{"name": "add", "argu', [])),
    ("a < b and <tool_c", ("a < b and <tool_c", [])),
    # arguments as JSON text are taken when they hold an object
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 4, \\"b\\": 1}"}</tool_call>',
     (None, [("add", {"a": 4, "b": 1})])),
    ('<tool_call>{"name": "add", "arguments": "[4]"}</tool_call>',
     ('<tool_call>{"name": "add", "arguments": "[4]"}</tool_call>', [])),
    # "parameters" is accepted for "arguments" (some models write it)
    ('<tool_call>{"name": "add", "parameters": {"a": 0, "b": 0}}</tool_call>',
     (None, [("add", {"a": 0, "b": 0})])),
]


def _summary(content, calls):
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("text,expected", CASES)
def test_split_output_finds_the_calls(text, expected):
    assert _summary(*split_output(text, NAMES)) == expected


def _check_fed_in_splits(text, expected, make_parser, rounds=20):
    """Every split of ``text`` (one character at a time, and ``rounds`` random cuts) fed to a
    fresh parser settles ``expected``."""
    rng = random.Random(len(text))
    splits = [[text[i:i + 1] for i in range(len(text))]]  # one character at a time
    for _ in range(rounds):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
        splits.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    for parts in splits:
        parser = make_parser()
        pieces = [p for part in parts for p in parser.feed(part)] + parser.finish()
        content = "".join(p.text for p in pieces if isinstance(p, Content))
        calls = [p for p in pieces if isinstance(p, ToolCall)]
        got = _summary((content.rstrip() or None) if calls else content, calls)
        assert got == expected, parts


@pytest.mark.parametrize("text,expected", CASES)
def test_the_parser_fed_in_any_split_settles_the_same_pieces(text, expected):
    _check_fed_in_splits(text, expected, lambda: CallParser(NAMES))


def test_content_streams_before_the_call_closes_and_a_tag_start_is_held_back():
    parser = CallParser(NAMES)
    assert parser.feed("Hello <tool") == [Content("Hello ")]
    assert parser.feed("_call>\n") == []
    assert parser.feed('{"name": "add", "arguments": {"a": 1, "b": 2}}\n') == []
    (call,) = parser.feed("</tool_call> ok")[:1]
    assert (call.name, json.loads(call.arguments)) == ("add", {"a": 1, "b": 2})
    assert call.id.startswith("call_") and len(call.id) > 10


def test_first_only_keeps_one_call():
    content, calls = split_output(f"{CALL_A}\n{CALL_W}", NAMES, first_only=True)
    assert [c.name for c in calls] == ["add"] and content is None


# --- the grammar ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(bundled_model_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(bundled_model_path)


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return GrammarCompiler(lambda: tokenizer, 49152, [tokenizer.eos_token_id])


def _feeds(grammars, tokenizer, tools, text) -> bool:
    """Whether the tools' constraint takes ``text`` token by token."""
    constraint = grammars.compile(tools.constraint())
    try:
        for token in tokenizer.encode(text, add_special_tokens=False):
            constraint.accept(token)
    except RuntimeError:
        return False
    return True


def test_required_takes_calls_of_the_tools_with_arguments_of_their_schemas(grammars, tokenizer):
    tools = parse_tools([WEATHER, ADD], "required", None)
    assert _feeds(grammars, tokenizer, tools, f"{CALL_W}\n{CALL_A}")
    assert not _feeds(grammars, tokenizer, tools, "Sure! " + CALL_A)  # nothing before a call
    assert not _feeds(grammars, tokenizer, tools, CALL_A.replace('"add"', '"sub"'))
    assert not _feeds(grammars, tokenizer, tools, CALL_A.replace("1", '"1"'))  # an integer
    assert not _feeds(grammars, tokenizer, tools, CALL_W.replace('"c"', '"k"'))  # the enum
    assert not _feeds(grammars, tokenizer, tools, CALL_W.replace(', "unit": "c"', ""))


def test_one_call_then_only_the_end(grammars, tokenizer):
    for tools in (parse_tools([WEATHER, ADD], "required", False),
                  parse_tools([WEATHER, ADD], {"type": "function", "function": {"name": "add"}},
                              None)):
        constraint = grammars.compile(tools.constraint())
        for token in tokenizer.encode(CALL_A, add_special_tokens=False):
            constraint.accept(token)
        allowed = constraint.allowed()
        assert constraint.done or allowed.nonzero().flatten().tolist() == [
            tokenizer.eos_token_id]
    named = parse_tools([WEATHER, ADD], {"type": "function", "function": {"name": "add"}}, None)
    assert not _feeds(grammars, tokenizer, named, CALL_W)


def test_auto_with_a_strict_tool_leaves_text_free_and_holds_the_calls(grammars, tokenizer):
    strict = {**ADD, "function": {**ADD["function"], "strict": True}}
    tools = parse_tools([WEATHER, strict], "auto", None)
    assert _feeds(grammars, tokenizer, tools, "Any text at all, <b>even tags</b>.")
    assert _feeds(grammars, tokenizer, tools, f"Let me add. {CALL_A}\n{CALL_W} Done.")
    assert not _feeds(grammars, tokenizer, tools, CALL_A.replace("1", '"1"'))  # strict: schema
    assert _feeds(grammars, tokenizer, tools, CALL_W.replace('"c"', '"k"'))  # not strict
    assert not _feeds(grammars, tokenizer, tools, CALL_A.replace('"add"', '"sub"'))


def test_auto_and_none_hold_nothing():
    assert parse_tools([WEATHER], "auto", None).constraint() is None
    assert parse_tools([WEATHER], None, None).mode == "auto"
    assert parse_tools([WEATHER], "none", None).constraint() is None
    assert parse_tools([], None, None) is None


# --- the prompt ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def frontend(tiny_chat_model):
    from nxdi_common.serving.worker import ModelOptions
    return ModelFrontend.from_options(ModelOptions(model=str(tiny_chat_model), max_model_len=2048))


HISTORY = [ChatTurn("user", "Weather in Paris?"),
           ChatTurn("assistant", "", (ToolCall("get_weather", '{"city": "Paris", "unit": "c"}',
                                               "call_1"),)),
           ChatTurn("tool", '{"temp": 21}', tool_call_id="call_1")]


def test_a_template_without_tools_gets_them_in_the_system_message(frontend):
    assert not frontend.native_tools  # SmolLM2's template
    text = frontend.tokenizer.decode(frontend.encode_chat(
        HISTORY, tools=parse_tools([WEATHER, ADD], None, None)))
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n") and "<tools>" in system
    for tool in (WEATHER, ADD):
        assert json.dumps(tool) in system
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "c"}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>tool\n<tool_response>\n{\"temp\": 21}\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # tool_choice "none": the tools stay out; a user's system message keeps its text first
    text = frontend.tokenizer.decode(frontend.encode_chat(
        [ChatTurn("system", "Be brief."), *HISTORY], tools=parse_tools([WEATHER], "none", None)))
    assert "<tools>" not in text and text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    text = frontend.tokenizer.decode(frontend.encode_chat(
        [ChatTurn("system", "Be brief."), *HISTORY], tools=parse_tools([WEATHER], None, None)))
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions.")


def test_a_template_that_renders_tools_gets_them_as_hugging_face_passes_them(frontend):
    from copy import copy
    tokenizer = copy(frontend.tokenizer)
    tokenizer.chat_template = (
        "{% if tools %}TOOLS{{ tools | tojson }}\n{% endif %}{% for m in messages %}"
        "[{{ m.role }}]{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}"
        "CALL {{ c.id }} {{ c.function.name }} {{ c.function.arguments.city }}{% endfor %}"
        "{% endif %}{% if m.tool_call_id %} FOR {{ m.tool_call_id }}{% endif %}\n{% endfor %}")
    assert template_renders_tools(tokenizer)
    native = ModelFrontend("m", tokenizer, frontend.limits)
    text = tokenizer.decode(native.encode_chat(HISTORY, tools=parse_tools([ADD], None, None)))
    assert text.startswith("TOOLS" + json.dumps([ADD])[:20])
    # arguments reach the template as an object (its .city), the result with its call's id
    assert "[assistant]CALL call_1 get_weather Paris" in text
    assert '[tool]{"temp": 21} FOR call_1' in text


def test_the_request_carries_the_grammar_and_refuses_a_schema_that_does_not_compile(frontend):
    import asyncio
    body = ChatRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
        "tool_choice": "required"})
    routed = chat_to_routed(body, frontend, tools=chat_tools(body))
    assert routed.sampling.structured.kind == "lark_grammar"
    assert '"name\\": \\"get_weather\\"' in routed.sampling.structured.spec
    for tool, held in ((WEATHER, False), ({**WEATHER, "function": {**WEATHER["function"],
                                                                    "strict": True}}, True)):
        body = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                           "tools": [tool]})
        routed = chat_to_routed(body, frontend, tools=chat_tools(body))
        assert (routed.sampling.structured is not None) == held
    bad = {**WEATHER, "function": {**WEATHER["function"], "parameters": {"type": "integer",
                                                                          "minimum": "x"}}}
    body = ChatRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "tools": [bad],
        "tool_choice": "required"})
    routed = chat_to_routed(body, frontend, tools=chat_tools(body))
    from nxdi_common.serving.errors import InvalidRequest
    with pytest.raises(InvalidRequest) as info:
        asyncio.run(frontend.check_structured(routed.sampling, "tools"))
    assert info.value.field == "tools"


# --- the stream ----------------------------------------------------------------------------------


def _outs(tokenizer, text, reason=t.EOS_TOKEN):
    ids = tokenizer.encode(text, add_special_tokens=False)
    outs = [TokenOutput("r", i, n, tokenizer.decode([i])) for n, i in enumerate(ids)]
    outs[-1] = dataclasses.replace(outs[-1], finish_reason=reason)
    return outs


def _formatter(frontend, tools, **extra):
    body = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                       "tools": tools, **extra})
    tools = frontend.tools_for(chat_tools(body))  # as router/openai_api.py does
    routed = chat_to_routed(body, frontend, tools=tools)
    return ChatFormatter(frontend, routed, body, tools=tools)


def test_stream_chunks_carry_content_then_each_call_once_and_the_finish(frontend):
    f = _formatter(frontend, [WEATHER, ADD], logprobs=True)
    outs = [dataclasses.replace(o, logprob=-0.5)
            for o in _outs(frontend.tokenizer, f"Checking.\n{CALL_W}\n{CALL_A}")]
    chunks = [c for o in outs for c in f.token_chunks(o)]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content", "") for d in deltas)
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert content == "Checking."
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in calls] == [(0, "get_weather", {"city": "Paris", "unit": "c"}),
                                (1, "add", {"a": 1, "b": 2})]
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("tool_calls") == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # every token's logprob is sent once
    assert sum(1 for c in chunks if c["choices"][0]["logprobs"]) == len(outs)
    # the non-streaming answer says the same
    full = f.response([outs])["choices"][0]
    assert full["finish_reason"] == "tool_calls" and full["message"]["content"] == content
    assert [c["function"] for c in full["message"]["tool_calls"]] == [c["function"] for c in calls]


def test_stream_of_calls_only_sends_no_blank_content_and_text_only_is_plain(frontend):
    f = _formatter(frontend, [WEATHER, ADD])
    chunks = [c for o in _outs(frontend.tokenizer, f"{CALL_A}\n\n{CALL_A}")
              for c in f.token_chunks(o)]
    assert not any("content" in c["choices"][0]["delta"] for c in chunks)
    f = _formatter(frontend, [WEATHER])
    outs = _outs(frontend.tokenizer, "No need for tools here.", reason=t.LENGTH)
    chunks = [c for o in outs for c in f.token_chunks(o)]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        "No need for tools here."
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "tool_calls" not in f.response([outs])["choices"][0]["message"]


# --- Llama 3.x JSON calls ------------------------------------------------------------------------

L_W = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
L_A = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
LLAMA_CASES = [
    (L_W, (None, [("get_weather", {"city": "Paris", "unit": "c"})])),
    ("<|python_tag|>" + L_A, (None, [("add", {"a": 1, "b": 2})])),
    (f"\n {L_A}; {L_W}\n", (None, [("add", {"a": 1, "b": 2}),
                                   ("get_weather", {"city": "Paris", "unit": "c"})])),
    ('{"name": "add", "arguments": "{\\"a\\": 4, \\"b\\": 1}"}', (None, [("add", {"a": 4, "b": 1})])),
    # anything but calls alone is content, as written
    ("Just text.", ("Just text.", [])),
    ('The answer is {"a": 1}', ('The answer is {"a": 1}', [])),
    ('{"answer": 42}', ('{"answer": 42}', [])),
    ('{"name": "rm", "parameters": {}}', ('{"name": "rm", "parameters": {}}', [])),
    (f"{L_A} and then", (f"{L_A} and then", [])),
    (f"{L_A};", (f"{L_A};", [])),
    ('{"name": "add", "param', ('{"name": "add", "param', [])),
    ("<|python_t", ("<|python_t", [])),
]


@pytest.mark.parametrize("text,expected", LLAMA_CASES)
def test_llama3_json_calls_whole_and_fed_in_any_split(text, expected):
    assert _summary(*split_output(text, NAMES, call_format="llama3_json")) == expected
    _check_fed_in_splits(text, expected, lambda: JsonCallParser(NAMES), rounds=10)


def test_llama3_json_text_streams_at_once_and_a_call_is_held_to_the_end():
    parser = JsonCallParser(NAMES)
    assert parser.feed(" ") == [] and parser.feed("Hel") == [Content(" Hel")]
    assert parser.feed("lo") == [Content("lo")]
    parser = JsonCallParser(NAMES, first_only=True)
    assert parser.feed("<|python") == [] and parser.feed("_tag|>{") == []
    assert parser.feed(L_A[1:] + "; " + L_W) == []
    assert [c.name for c in parser.finish()] == ["add"]  # parallel_tool_calls false: the first


def test_llama3_json_required_and_strict_auto_grammars(grammars, tokenizer):
    tools = dataclasses.replace(parse_tools([WEATHER, ADD], "required", None),
                                call_format="llama3_json")
    assert _feeds(grammars, tokenizer, tools, f"{L_W}; {L_A}")
    assert not _feeds(grammars, tokenizer, tools, CALL_A)  # the Hermes form is not taken
    assert not _feeds(grammars, tokenizer, tools,
                      '{"name": "get_weather", "parameters": {"city": "Paris"}}')  # no unit
    one = dataclasses.replace(tools, parallel=False)
    assert _feeds(grammars, tokenizer, one, L_A) and not _feeds(grammars, tokenizer, one,
                                                                f"{L_A}; {L_A}")
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    auto = dataclasses.replace(parse_tools([strict], None, None), call_format="llama3_json")
    assert _feeds(grammars, tokenizer, auto, "Let me look that up. " + L_W)
    assert not _feeds(grammars, tokenizer, auto, '{"name": "get_weather", "parameters": {"x": 1')


LLAMA_TEMPLATE = (  # the parts of Llama 3.1's template that tell its format apart
    "{% if tools %}Given the following functions, please respond with a JSON for a function "
    "call with its proper arguments.\nRespond in the format {\"name\": function name, "
    "\"parameters\": dictionary of argument name and its value}.{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<|python_tag|>{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}")


def test_a_llama3_template_makes_its_json_calls_the_format(frontend):
    from copy import copy
    assert frontend.tool_call_format == "hermes"  # SmolLM2: the router's own (Hermes) prompt
    tokenizer = copy(frontend.tokenizer)
    tokenizer.chat_template = LLAMA_TEMPLATE
    assert template_call_format(tokenizer) == "llama3_json"
    llama = ModelFrontend("m", tokenizer, frontend.limits)
    text = tokenizer.decode(llama.encode_chat(HISTORY, tools=parse_tools([WEATHER], None, None)))
    assert '[assistant]<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"' in text
    f = _formatter(llama, [WEATHER, ADD])
    assert f.tools.call_format == "llama3_json"
    chunks = [c for o in _outs(tokenizer, f"{L_W}; {L_A}") for c in f.token_chunks(o)]
    calls = [d["tool_calls"][0]["function"] for c in chunks
             if "tool_calls" in (d := c["choices"][0]["delta"])]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": 2})]
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    body = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                       "tools": [WEATHER], "tool_choice": "required"})
    routed = chat_to_routed(body, llama, tools=llama.tools_for(chat_tools(body)))
    assert '"parameters\\": ' in routed.sampling.structured.spec


def test_a_forced_llama3_format_on_a_template_without_tools_teaches_it(frontend):
    from copy import copy
    forced = copy(frontend)
    forced.tool_call_format = "llama3_json"
    text = forced.tokenizer.decode(forced.encode_chat(
        HISTORY, tools=parse_tools([WEATHER], None, None)))
    assert '{"name": <function-name>, "parameters": <args-json-object>}' in text
    assert '<|im_start|>assistant\n{"name": "get_weather", "parameters": {"city": "Paris", ' \
           '"unit": "c"}}<|im_end|>' in text
    from router.server import build_parser
    assert build_parser().parse_args(["--tool-call-parser", "llama3_json"]).tool_call_parser == \
        "llama3_json"
