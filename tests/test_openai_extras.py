"""OpenAI parameters beyond one plain choice, on real processes (tiny model, eager; router,
prefill and decode worker on loopback): n choices and batches of prompts, merged in the response
and interleaved in a stream by index; presence and frequency penalties reaching the decode
worker."""
import json

import httpx
import pytest

PROMPT = [1, 504, 3458, 282, 4649, 314]
MAX_LEN = 1024


@pytest.fixture(scope="module")
def router(spawn_module, tiny_chat_model):
    common = ("--model", tiny_chat_model, "--dtype", "float32", "--backend", "eager",
              "--threads", "1", "--max-model-len", MAX_LEN)
    decode = spawn_module("decode_service", *common, "--kv-blocks", 512)
    prefill = spawn_module("prefill_service", *common)
    router = spawn_module("router", "--model", tiny_chat_model, "--max-model-len", MAX_LEN,
                          "--model-name", "tiny", "--http-port", 0, "--grpc-port", 0,
                          "--decode", decode.grpc, "--prefill", prefill.grpc)
    router.decode, router.prefill = decode, prefill
    return router


@pytest.fixture(scope="module")
def http(router):
    return router.info["http"]


def post(http, path="/v1/completions", **body):
    r = httpx.post(f"http://{http}{path}", timeout=60,
                   json={"model": "tiny", "prompt": PROMPT, "max_tokens": 12,
                         "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream(http, **body):
    """Each choice's text from the SSE chunks, and the usage chunk."""
    texts, usage = {}, None
    with httpx.stream("POST", f"http://{http}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            usage = chunk.get("usage") or usage
    return texts, usage


def test_n_greedy_choices_are_indexed_and_equal(http):
    one = post(http, temperature=0)
    three = post(http, temperature=0, n=3)
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert {c["text"] for c in three["choices"]} == {one["choices"][0]["text"]}
    assert three["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 36,
                              "total_tokens": len(PROMPT) + 36}


def test_n_choices_stream_interleaved_by_index(http):
    texts, usage = stream(http, temperature=0, n=2)
    full = post(http, temperature=0)["choices"][0]["text"]
    assert texts == {0: full, 1: full}
    assert usage["completion_tokens"] == 24


def test_seeded_choices_differ_and_replay(http):
    body = dict(temperature=1.0, seed=11, n=3, max_tokens=16)
    first = [c["text"] for c in post(http, **body)["choices"]]
    assert [c["text"] for c in post(http, **body)["choices"]] == first
    assert len(set(first)) > 1  # choice i is seeded seed + i
    assert post(http, **{**body, "n": 1})["choices"][0]["text"] == first[0]


def test_a_batch_of_prompts_gives_each_prompts_choices_in_order(http):
    other = [1, 330, 2113, 451, 89]
    a = post(http, temperature=0)["choices"][0]["text"]
    b = post(http, temperature=0, prompt=other)["choices"][0]["text"]
    batch = post(http, temperature=0, prompt=[PROMPT, other], n=2)
    assert [(c["index"], c["text"]) for c in batch["choices"]] == [(0, a), (1, a), (2, b), (3, b)]
    assert batch["usage"]["prompt_tokens"] == len(PROMPT) + len(other)
    assert batch["usage"]["completion_tokens"] == 4 * 12
    texts, usage = stream(http, temperature=0, prompt=[PROMPT, other])
    assert texts == {0: a, 1: b} and usage["prompt_tokens"] == len(PROMPT) + len(other)


def test_chat_n_choices(http):
    r = httpx.post(f"http://{http}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
        "n": 2, "temperature": 0})
    assert r.status_code == 200
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    bad = httpx.post(f"http://{http}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 17})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"


def test_penalties_through_the_openai_api(http):
    """Greedy: the penalized tokens are not the plain ones, the plain ones the same twice."""
    def tokens(**extra):
        return post(http, temperature=0, max_tokens=24, logprobs=0,
                    **extra)["choices"][0]["logprobs"]["tokens"]

    plain = tokens()
    assert tokens() == plain
    assert tokens(frequency_penalty=1.5, presence_penalty=0.5) != plain
    r = httpx.post(f"http://{http}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": "hi", "presence_penalty": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "presence_penalty"


def test_logit_bias_reaches_the_first_token_and_the_rest(http, tiny_chat_model):
    """+100 on one token forces it from the first token (the prefill worker's) on; -100 on the
    plain greedy first token moves the first token elsewhere."""
    import torch
    from transformers import AutoTokenizer

    import hf_reference
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)

    def greedy(**extra):
        return post(http, temperature=0, max_tokens=4, logprobs=0,
                    **extra)["choices"][0]["logprobs"]["tokens"]

    plain = greedy()
    assert greedy(logit_bias={"4649": 100}) == [tokenizer.decode([4649])] * 4 != plain
    with torch.no_grad():
        first = int(hf_reference.load(tiny_chat_model)(torch.tensor([PROMPT])).logits[0, -1]
                    .argmax())
    assert tokenizer.decode([first]) == plain[0]
    assert greedy(logit_bias={str(first): -100})[0] != plain[0]
    bad = httpx.post(f"http://{http}/v1/completions", timeout=60,
                     json={"model": "tiny", "prompt": "hi", "logit_bias": {"49152": 5}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


SCHEMA = {"type": "object", "properties": {
    "answer": {"enum": ["yes", "no"]}, "count": {"type": "integer"}},
    "required": ["answer", "count"], "additionalProperties": False}


def test_chat_response_format_json_schema_gives_json_of_the_schema(http):
    for seed in range(3):
        r = httpx.post(f"http://{http}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
            "seed": seed, "response_format": {"type": "json_schema", "json_schema": {
                "name": "answer", "schema": SCHEMA, "strict": True}}})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice  # the object closed before 200 tokens
        value = json.loads(choice["message"]["content"])
        assert set(value) == {"answer", "count"} and value["answer"] in ("yes", "no")
        assert isinstance(value["count"], int)


def test_structured_outputs_choice_and_regex_in_completions_and_streams(http):
    choices = ["red", "green", "blue sky"]
    got = {post(http, seed=s, max_tokens=20, structured_outputs={"choice": choices})
           ["choices"][0]["text"] for s in range(6)}
    assert got <= set(choices) and len(got) > 1
    texts, usage = stream(http, seed=3, max_tokens=30, structured_outputs={"regex": "[0-9]{4}"})
    assert len(texts[0]) == 4 and texts[0].isdigit() and usage["completion_tokens"] <= 4
    bad = httpx.post(f"http://{http}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "hi", "structured_outputs": {"regex": "[0-"}})
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "structured_outputs"
    assert "does not compile" in bad.json()["error"]["message"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["city", "days"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}},
    "required": ["a"], "additionalProperties": False}}}


def chat(http, **body):
    r = httpx.post(f"http://{http}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "weather?"}],
        "max_tokens": 200, **body})
    return r


def check_call(call):
    """A call of one of the tools, its arguments valid for that tool's schema."""
    assert call["type"] == "function" and call["id"].startswith("call_")
    args = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "get_weather":
        assert set(args) == {"city", "days"} and args["city"] in ("Paris", "Rome")
        assert isinstance(args["days"], int) and 1 <= args["days"] <= 14
    else:
        assert call["function"]["name"] == "add" and set(args) == {"a"}
        assert isinstance(args["a"], int)
    return call["function"]["name"], args


def test_named_and_required_tool_choice_answer_with_valid_calls(http):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        r = chat(http, tools=[ADD, WEATHER], tool_choice=named, seed=seed)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert check_call(call)[0] == "get_weather"
    r = chat(http, tools=[ADD, WEATHER], tool_choice="required", parallel_tool_calls=False,
             n=4, seed=1)
    assert r.status_code == 200, r.text
    names = set()
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]  # exactly one: parallel_tool_calls false
        names.add(check_call(call)[0])
    assert names <= {"add", "get_weather"}


def test_a_streamed_tool_call_is_the_non_streamed_one(http):
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "weather?"}],
            "max_tokens": 200, "tools": [WEATHER], "tool_choice": named, "temperature": 0}
    full = chat(http, **body).json()["choices"][0]
    calls, reasons = [], []
    with httpx.stream("POST", f"http://{http}/v1/chat/completions", timeout=60,
                      json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                calls += choice["delta"].get("tool_calls", [])
                reasons.append(choice["finish_reason"])
    assert [c["index"] for c in calls] == [0], (full, reasons)
    assert calls[0]["function"] == full["message"]["tool_calls"][0]["function"]
    assert [r for r in reasons if r] == ["tool_calls"]


def test_auto_tools_and_tool_history_reach_the_prompt(http, tiny_chat_model):
    """tool_choice auto: the prompt carries the tools (and earlier calls and results); the tiny
    model's answer comes back as text (no call in it)."""
    from nxdi_common.serving.worker import ModelOptions
    from router.frontend import ModelFrontend
    from router.openai_schema import ChatRequest, chat_tools, chat_turns
    frontend = ModelFrontend.from_options(ModelOptions(model=str(tiny_chat_model),
                                                       max_model_len=MAX_LEN))
    messages = [{"role": "user", "content": "weather in Rome?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_7", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"city": "Rome", "days": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_7", "content": "sunny"}]
    for extra in ({}, {"tool_choice": "none"}):
        body = {"messages": messages, "tools": [WEATHER], "max_tokens": 8, **extra}
        r = chat(http, **body)
        assert r.status_code == 200, r.text
        expected = frontend.encode_chat(chat_turns(ChatRequest.model_validate(body)),
                                        tools=chat_tools(ChatRequest.model_validate(body)))
        assert r.json()["usage"]["prompt_tokens"] == len(expected)
        message = r.json()["choices"][0]["message"]
        assert isinstance(message["content"], str) and "tool_calls" not in message
    with_tools = chat(http, messages=messages, tools=[WEATHER], max_tokens=1).json()
    without = chat(http, messages=messages, tools=[WEATHER], tool_choice="none",
                   max_tokens=1).json()
    assert with_tools["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"] + 40
    bad = chat(http, tools=[WEATHER], tool_choice={"type": "function",
                                                    "function": {"name": "get_time"}})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "tool_choice.function.name"


def test_repetition_penalty_through_the_prefill_worker_is_transformers_generate(
        http, tiny_chat_model):
    """Greedy with repetition_penalty over HTTP (the prefill worker samples the first token on
    the host, the decode worker the rest) gives transformers' generate() tokens."""
    import torch
    from transformers import AutoTokenizer

    import hf_reference
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    with torch.no_grad():
        want = hf_reference.load(tiny_chat_model).generate(
            torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, repetition_penalty=1.5,
            min_new_tokens=12, pad_token_id=2)[0, len(PROMPT):].tolist()
    got = post(http, temperature=0, logprobs=0, repetition_penalty=1.5)
    assert got["choices"][0]["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in want]
    plain = post(http, temperature=0, logprobs=0)["choices"][0]["logprobs"]["tokens"]
    assert plain != got["choices"][0]["logprobs"]["tokens"]
    # min_p: seeded answers replay, and 1.0 is greedy
    assert post(http, temperature=1.0, min_p=1.0, seed=3)["choices"][0]["text"] == \
        post(http, temperature=0)["choices"][0]["text"]
    bad = httpx.post(f"http://{http}/v1/completions", timeout=60,
                     json={"model": "tiny", "prompt": "hi", "repetition_penalty": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "repetition_penalty"


def test_min_tokens_holds_off_eos_at_the_prefill_worker_and_the_decode_worker(http):
    """logit_bias +100 on EOS ends a plain answer at its first token; with min_tokens 4 the
    prefill worker's first token and the decode worker's next three are not EOS, the 5th is."""
    body = dict(temperature=0, max_tokens=20, ignore_eos=False, logit_bias={"2": 100})
    assert post(http, **body)["usage"]["completion_tokens"] == 1
    reply = post(http, **body, min_tokens=4)
    assert reply["usage"]["completion_tokens"] == 5
    assert reply["choices"][0]["finish_reason"] == "stop"
    bad = httpx.post(f"http://{http}/v1/completions", timeout=60,
                     json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "min_tokens": 3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "min_tokens"


def test_the_openai_sdk_reads_our_tool_calls_whole_and_streamed(http):
    import openai
    client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="none")
    body = dict(model="tiny", messages=[{"role": "user", "content": "weather?"}], max_tokens=200,
                tools=[ADD, WEATHER], temperature=0,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    reply = client.chat.completions.create(**body)
    (call,) = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    with client.chat.completions.stream(**body) as stream:
        final = stream.get_final_completion()
    (streamed,) = final.choices[0].message.tool_calls
    assert (streamed.function.name, json.loads(streamed.function.arguments)) == (
        "get_weather", json.loads(call.function.arguments))


def grpc_chat(router, **fields):
    """Router.Generate over gRPC with a chat input: its events."""
    import grpc

    from protos.nxdi.serving.v1 import serving_pb2 as pb
    from protos.nxdi.serving.v1 import serving_pb2_grpc as pb_grpc
    messages = fields.pop("messages", [pb.ChatMessage(role="user", content="weather?")])
    fields.setdefault("stop", pb.StopCriteria(max_tokens=200))
    req = pb.GenerateRequest(chat=pb.ChatMessages(messages=messages), **fields)
    with grpc.insecure_channel(router.grpc) as channel:
        return list(pb_grpc.RouterStub(channel).Generate(req, timeout=60))


def test_grpc_router_tools_named_and_required_give_valid_calls_on_the_last_event(router, http):
    """The gRPC Router takes tools as the HTTP API does: a named function's answer is one valid
    call of it, parsed onto the last event (the events' text is the answer as written), the
    same call the HTTP API gives for the same greedy request; tool history reaches the
    prompt; bad tools are refused naming the field."""
    import grpc

    from protos.nxdi.serving.v1 import serving_pb2 as pb

    def tool(spec):
        fn = spec["function"]
        return pb.Tool(name=fn["name"], description=fn.get("description", ""),
                       parameters_json=json.dumps(fn["parameters"]))
    tools = [tool(ADD), tool(WEATHER)]
    greedy = pb.SamplingParams(temperature=0)
    events = grpc_chat(router, tools=tools, sampling=greedy,
                       tool_choice=pb.ToolChoice(function="get_weather"))
    assert all(not e.tool_calls for e in events[:-1])
    (call,) = events[-1].tool_calls
    assert "<tool_call>" in "".join(e.text for e in events)
    as_openai = {"type": "function", "id": call.id,
                 "function": {"name": call.name, "arguments": call.arguments_json}}
    assert check_call(as_openai)[0] == "get_weather"
    over_http = chat(http, tools=[ADD, WEATHER], temperature=0, tool_choice={
        "type": "function", "function": {"name": "get_weather"}}).json()
    assert over_http["choices"][0]["message"]["tool_calls"][0]["function"] == \
        as_openai["function"]
    required = grpc_chat(router, tools=tools, tool_choice=pb.ToolChoice(mode="required"),
                         parallel_tool_calls=False, sampling=pb.SamplingParams(seed=3))
    (call,) = required[-1].tool_calls
    assert check_call({"type": "function", "id": call.id, "function": {
        "name": call.name, "arguments": call.arguments_json}})[0] in ("add", "get_weather")
    # history: an earlier call and its answer make the prompt longer than the question alone
    history = [pb.ChatMessage(role="user", content="weather?"),
               pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(
                   id="call_1", name="get_weather", arguments_json='{"city": "Rome"}')]),
               pb.ChatMessage(role="tool", tool_call_id="call_1", content="sunny, 24 C")]
    plain = grpc_chat(router, tools=tools, messages=history[:1],
                      stop=pb.StopCriteria(max_tokens=1))
    longer = grpc_chat(router, tools=tools, messages=history, stop=pb.StopCriteria(max_tokens=1))
    assert longer[-1].usage.prompt_tokens > plain[-1].usage.prompt_tokens + 10
    for fields, param in ((dict(tools=[pb.Tool(name="bad name")]), "tools[0].name"),
                          (dict(tools=[pb.Tool(name="f", parameters_json="{")]),
                           "tools[0].parameters_json"),
                          (dict(tools=tools, tool_choice=pb.ToolChoice(function="nope")),
                           "tool_choice.function"),
                          (dict(messages=[pb.ChatMessage(role="tool", content="x")]),
                           "chat.messages[0].tool_call_id")):
        with pytest.raises(grpc.RpcError) as info:
            grpc_chat(router, **fields)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert param in info.value.details(), info.value.details()


def metric(service, name: str) -> float:
    """One sample of a worker's /metrics (labels as Prometheus writes them), 0 when absent."""
    text = httpx.get(f"http://{service.info['metrics']}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


PREFILLS = 'nxdi_requests_total{outcome="ok",role="prefill"}'
LOCAL = 'nxdi_local_prefills_total{role="decode"}'


def test_n_choices_share_one_prefill(router, http):
    """n choices of a 300-token prompt: the prefill worker encodes it once; the other choices
    wait for the first's prompt KV on the decode worker, which finds its full blocks cached
    and computes the last few tokens itself. Greedy choices equal the single answer; a stream
    of them gets every choice (the others' first tokens come after the stream starts)."""
    ids = [(i * 97 + 31) % 40000 + 100 for i in range(300)]
    prefills, local = metric(router.prefill, PREFILLS), metric(router.decode, LOCAL)
    body = post(http, prompt=ids, n=4, max_tokens=6, temperature=0)
    assert metric(router.prefill, PREFILLS) - prefills == 1
    assert metric(router.decode, LOCAL) - local == 3
    texts = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]
    assert len(texts) == 4 and len(set(texts)) == 1
    assert body["usage"]["completion_tokens"] == 24
    single = post(http, prompt=ids, max_tokens=6, temperature=0)["choices"][0]["text"]
    assert texts[0] == single
    streamed, usage = stream(http, prompt=ids, n=3, max_tokens=6, temperature=0)
    assert streamed == {0: single, 1: single, 2: single}
    assert usage["completion_tokens"] == 18


# --- vLLM's detokenization, truncation and chat-rendering parameters ---------------------------


def grpc_generate(router, **fields):
    """Router.Generate over gRPC with PROMPT's ids (unless given): its events."""
    import grpc

    from protos.nxdi.serving.v1 import serving_pb2 as pb
    from protos.nxdi.serving.v1 import serving_pb2_grpc as pb_grpc
    fields.setdefault("prompt_token_ids", pb.TokenIds(ids=PROMPT))
    with grpc.insecure_channel(router.grpc) as channel:
        return list(pb_grpc.RouterStub(channel).Generate(pb.GenerateRequest(**fields),
                                                         timeout=60))


def test_stop_strings_and_stop_tokens_leave_the_text_as_vllm_does(router, http):
    """A stop string ends the text before it, or with include_stop_str_in_output after it; a
    stop token (stop_token_ids) is the last token, its text left out unless
    include_stop_str_in_output (vLLM's rule); on HTTP and gRPC alike."""
    from protos.nxdi.serving.v1 import serving_pb2 as pb
    seeded = pb.SamplingParams(temperature=1.0, seed=11)  # the tiny model's greedy text repeats
    events = grpc_generate(router, sampling=seeded,
                           stop=pb.StopCriteria(max_tokens=12, ignore_eos=True))
    ids, texts = [e.token_id for e in events], [e.text for e in events]
    full = "".join(texts)
    assert full == post(http, temperature=1.0, seed=11)["choices"][0]["text"]
    # the first token id that does not occur before it, at least 3 tokens in
    at = next(i for i in range(3, 12) if ids[i] not in ids[:i] and texts[i])
    cut = post(http, temperature=1.0, seed=11, stop_token_ids=[ids[at]])
    assert cut["usage"]["completion_tokens"] == at + 1
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == "".join(texts[:at])
    kept = post(http, temperature=1.0, seed=11, stop_token_ids=[ids[at]], include_stop_str_in_output=True)
    assert kept["choices"][0]["text"] == "".join(texts[:at + 1])
    # a stop string: a piece of the answer's text after its first few characters
    start = len("".join(texts[:3]))
    stop = full[start:start + 3].strip() or full[start:start + 3]
    index = full.find(stop)
    assert post(http, temperature=1.0, seed=11, stop=[stop])["choices"][0]["text"] == full[:index]
    assert post(http, temperature=1.0, seed=11, stop=[stop], include_stop_str_in_output=True)[
        "choices"][0]["text"] == full[:index + len(stop)]
    over_grpc = grpc_generate(router, sampling=seeded, stop=pb.StopCriteria(
        max_tokens=12, ignore_eos=True, stop_strings=[stop], include_stop_str_in_output=True))
    assert "".join(e.text for e in over_grpc) == full[:index + len(stop)]


def test_skip_special_tokens_false_shows_special_tokens_but_not_the_eos_that_ends(http):
    """logit_bias forces <|im_start|> (id 1): its text is left out by default and shown with
    skip_special_tokens false; an answer ended by EOS (<|im_end|>, id 2) leaves the EOS out
    even then, and keeps it with include_stop_str_in_output."""
    forced = dict(temperature=0, max_tokens=3, logit_bias={"1": 100})
    assert post(http, **forced)["choices"][0]["text"] == ""
    assert post(http, **forced, skip_special_tokens=False)["choices"][0]["text"] == \
        "<|im_start|>" * 3
    eos = dict(temperature=0, max_tokens=5, ignore_eos=False, logit_bias={"2": 100},
               skip_special_tokens=False)
    ended = post(http, **eos)
    assert ended["usage"]["completion_tokens"] == 1 and ended["choices"][0]["text"] == ""
    assert post(http, **eos, include_stop_str_in_output=True)["choices"][0]["text"] == \
        "<|im_end|>"
    bad = httpx.post(f"http://{http}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "hi", "skip_special_tokens": "no"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "skip_special_tokens"


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(router, http):
    """truncate_prompt_tokens 3: the prompt's last 3 tokens are what is prefilled (usage, and
    the same greedy answer as those 3 tokens sent alone); out of range is refused by name."""
    import grpc

    from protos.nxdi.serving.v1 import serving_pb2 as pb
    cut = post(http, temperature=0, truncate_prompt_tokens=3)
    assert cut["usage"]["prompt_tokens"] == 3
    assert cut["choices"][0]["text"] == post(http, temperature=0, prompt=PROMPT[-3:])[
        "choices"][0]["text"] != post(http, temperature=0)["choices"][0]["text"]
    assert post(http, temperature=0, truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] == \
        len(PROMPT)
    reply = chat(http, messages=[{"role": "user", "content": "hello there"}], max_tokens=2,
                 truncate_prompt_tokens=4).json()
    assert reply["usage"]["prompt_tokens"] == 4
    events = grpc_generate(router, truncate_prompt_tokens=2, stop=pb.StopCriteria(max_tokens=2))
    assert events[-1].usage.prompt_tokens == 2
    for value in (0, -2, MAX_LEN + 1, True):
        bad = httpx.post(f"http://{http}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "hi", "truncate_prompt_tokens": value})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == \
            "truncate_prompt_tokens", (value, bad.text)
    with pytest.raises(grpc.RpcError) as info:
        grpc_generate(router, truncate_prompt_tokens=0)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "truncate_prompt_tokens" in info.value.details()


def tokenize(http, **body):
    return httpx.post(f"http://{http}/tokenize", timeout=60, json={"model": "tiny", **body})


def test_continue_final_message_leaves_the_assistant_message_open(router, http, tiny_chat_model):
    """continue_final_message: the prompt ends with the last assistant message's text (no
    end-of-turn after it, no new generation prompt), on /tokenize, chat completions and gRPC
    alike; conflicting or impossible settings are refused by name."""
    from transformers import AutoTokenizer

    from protos.nxdi.serving.v1 import serving_pb2 as pb
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    messages = [{"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "The colour is"}]
    open_ids = tokenize(http, messages=messages, continue_final_message=True).json()["tokens"]
    closed_ids = tokenize(http, messages=messages, add_generation_prompt=False).json()["tokens"]
    assert tokenizer.decode(open_ids).endswith("The colour is")
    assert tokenizer.decode(closed_ids).endswith("The colour is<|im_end|>\n")
    assert closed_ids[:len(open_ids)] == open_ids
    reply = chat(http, messages=messages, continue_final_message=True,
                 add_generation_prompt=False, max_tokens=2).json()
    assert reply["usage"]["prompt_tokens"] == len(open_ids)
    events = grpc_chat(router, messages=[pb.ChatMessage(**m) for m in messages],
                       continue_final_message=True, stop=pb.StopCriteria(max_tokens=2))
    assert events[-1].usage.prompt_tokens == len(open_ids)
    both = chat(http, messages=messages, continue_final_message=True, add_generation_prompt=True)
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    user_last = chat(http, messages=messages[:1], continue_final_message=True)
    assert user_last.status_code == 400
    assert user_last.json()["error"]["param"] == "continue_final_message"
    assert tokenize(http, prompt="hi", continue_final_message=True).json()["error"][
        "param"] == "continue_final_message"


def test_chat_template_kwargs_reach_the_template(router, http, tiny_chat_model):
    """chat_template_kwargs are variables of the chat template (a Qwen3-like enable_thinking
    switch in a template of our own); the router's own arguments cannot be set through them;
    over HTTP (the bundled template ignores unknown variables) and gRPC they are checked."""
    import grpc

    from nxdi_common.serving.worker import ModelOptions
    from protos.nxdi.serving.v1 import serving_pb2 as pb
    from router.frontend import ChatOptions, ChatTurn, ModelFrontend
    frontend = ModelFrontend.from_options(ModelOptions(model=str(tiny_chat_model),
                                                       max_model_len=MAX_LEN))
    frontend.tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
        "{% if enable_thinking is defined and not enable_thinking %}<no_think>{% endif %}")
    turns = [ChatTurn("user", "hi")]
    plain = frontend.tokenizer.decode(frontend.encode_chat(turns))
    off = frontend.tokenizer.decode(frontend.encode_chat(turns, options=ChatOptions.checked(
        None, None, {"enable_thinking": False})))
    assert plain == "<user>hi<assistant>" and off == "<user>hi<assistant><no_think>"
    messages = [{"role": "user", "content": "hi"}]
    ok = chat(http, messages=messages, max_tokens=1, chat_template_kwargs={"enable_thinking": 0})
    assert ok.status_code == 200, ok.text
    for kwargs, param in (({"add_generation_prompt": False},
                           "chat_template_kwargs.add_generation_prompt"),
                          ({"tools": []}, "chat_template_kwargs.tools"),
                          ([1], "chat_template_kwargs")):
        bad = chat(http, messages=messages, chat_template_kwargs=kwargs)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    for text, param in (("{", "chat_template_kwargs_json"),
                        ('{"tokenize": true}', "chat_template_kwargs_json.tokenize")):
        with pytest.raises(grpc.RpcError) as info:
            grpc_chat(router, chat_template_kwargs_json=text)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert param in info.value.details(), info.value.details()
    assert grpc_chat(router, chat_template_kwargs_json='{"enable_thinking": false}',
                     stop=pb.StopCriteria(max_tokens=1))[-1].usage.prompt_tokens > 0


def test_cache_salt_keeps_cached_prompts_apart(router, http):
    """A prompt sent again under its cache_salt finds its blocks cached (usage's cached_tokens,
    at the decode worker); under another salt, or none, it finds nothing of them; the gRPC
    field does the same; a bad salt is refused by name."""
    import grpc

    from protos.nxdi.serving.v1 import serving_pb2 as pb
    prompt = list(range(2000, 2100))  # 100 tokens: 6 full blocks of 16

    def cached(**extra):
        reply = post(http, prompt=prompt, max_tokens=2, **extra)
        return reply["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)

    cached(cache_salt="tenant-a")
    assert cached(cache_salt="tenant-a") == 96
    assert cached(cache_salt="tenant-b") == 0
    assert cached() == 0
    assert cached(cache_salt="tenant-a") == 96
    events = grpc_generate(router, prompt_token_ids=pb.TokenIds(ids=prompt),
                           stop=pb.StopCriteria(max_tokens=2), cache_salt="tenant-b")
    assert events[-1].usage.cached_prompt_tokens == 96  # tenant-b's first visit was over HTTP
    bad = httpx.post(f"http://{http}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "hi", "cache_salt": "x" * 2000})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
    with pytest.raises(grpc.RpcError) as info:
        grpc_generate(router, cache_salt="x" * 2000)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_router_counts_the_cached_tokens_it_expected_and_got(http):
    """The cache-aware router's view against the decode worker's usage: a prompt sent twice is
    expected cached the second time (its 6 whole blocks, short of the last token) and is."""
    def counters():
        text = httpx.get(f"http://{http}/metrics", timeout=10).text
        values = {}
        for name in ("nxdi_expected_cached_tokens_total", "nxdi_cached_prompt_tokens_total"):
            line = next(x for x in text.splitlines() if x.startswith(name + "{"))
            values[name] = float(line.split()[-1])
        return values

    prompt = list(range(3000, 3100))
    before = counters()
    post(http, prompt=prompt, max_tokens=2)
    first = counters()
    assert first == before  # nothing expected, nothing cached
    post(http, prompt=prompt, max_tokens=2)
    second = counters()
    assert {k: second[k] - first[k] for k in second} == {
        "nxdi_expected_cached_tokens_total": 96, "nxdi_cached_prompt_tokens_total": 96}
