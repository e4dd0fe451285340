"""The router process over the wire: ``python -m router`` with the tiny chat model and a decode
address where nothing listens. Every bad input is refused with HTTP 400 / INVALID_ARGUMENT naming
the field; a valid request finds no healthy decode worker (503 / UNAVAILABLE); /v1/models,
/health, /metrics and ListModels answer in their documented shapes; SIGTERM stops it cleanly."""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from protos.nxdi.serving.v1 import serving_pb2 as pb
from protos.nxdi.serving.v1 import serving_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 512
VOCAB = 49152


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, timeout: float) -> dict:
    """Parse the NXDI_READY line (the process prints nothing else on stdout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        readable, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
        if not readable:
            break
        line = proc.stdout.readline()
        if line.startswith("NXDI_READY "):
            return json.loads(line.removeprefix("NXDI_READY "))
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"router did not get ready (rc={proc.poll()})")


@pytest.fixture(scope="module")
def router(tiny_chat_model, tmp_path_factory):
    """The router process; yields its NXDI_READY addresses plus the dead decode address."""
    dead_decode, dead_prefill = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    log = tmp_path_factory.mktemp("router") / "stderr.txt"
    cmd = [sys.executable, "-m", "router", "--host", "127.0.0.1", "--http-port", "0",
           "--grpc-port", "0", "--model", str(tiny_chat_model), "--max-model-len",
           str(MAX_MODEL_LEN), "--decode", dead_decode, "--prefill", dead_prefill,
           "--refresh-seconds", "0.5"]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        ready = wait_ready(proc, timeout=90)
        yield {**ready, "dead_decode": dead_decode, "proc": proc, "log": log}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def http(router):
    with httpx.Client(base_url=f"http://{router['http']}", timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def stub(router):
    with grpc.insecure_channel(router["grpc"]) as channel:
        yield pb_grpc.RouterStub(channel)


def assert_400(response: httpx.Response, param: str | None, message: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param,
                                                              None)
    assert message in error["message"], error["message"]


def test_ready_line_names_both_addresses(router):
    assert router["role"] == "router"
    assert router["http"].startswith("127.0.0.1:") and router["grpc"].startswith("127.0.0.1:")
    assert router["http"] != router["grpc"]


LONG_PROMPT = "word " * 600  # 600+ tokens: past the 512-token context
COMPLETION_ERRORS = [
    ({"prompt": ""}, "prompt", "prompt: must not be empty"),
    ({"prompt": LONG_PROMPT}, "prompt", "the maximum context is 512 tokens"),
    ({"prompt": [VOCAB]}, "prompt", f"token id {VOCAB} is outside [0, {VOCAB})"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens: must be an integer >= 1"),
    ({"prompt": "hi", "max_tokens": -3}, "max_tokens", "max_tokens: must be an integer >= 1"),
    ({"prompt": "hi", "max_tokens": 512}, "max_tokens", "exceeds the maximum context of 512"),
    ({"prompt": "hi", "top_p": 0}, "top_p", "top_p: must be in (0, 1]"),
    ({"prompt": "hi", "top_p": 1.01}, "top_p", "top_p: must be in (0, 1]"),
    ({"prompt": "hi", "temperature": -1}, "temperature", "temperature: must be a finite number"),
    ({"prompt": "hi", "top_k": -2}, "top_k", "top_k: must be an integer >= -1"),
    ({"prompt": "hi", "model": "nope"}, "model", "model 'nope' is not served here"),
    ({"prompt": "hi", "n": 17}, "n", "n: must be an integer in [1, 16], got 17"),
    ({"prompt": "hi", "best_of": 2}, "best_of", "best_of: is not supported"),
    ({"prompt": "hi", "echo": "yes"}, "echo", "echo: Input should be a valid boolean"),
    ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs", "must be an integer in [0, 20]"),
    ({"prompt": "hi", "suffix": "x"}, "suffix", "suffix: is not supported"),
    ({"prompt": "hi", "logprobs": 9}, "logprobs", "logprobs: must be an integer in [0, 5]"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature", "temperature: Input should be a"),
    ({"prompt": "hi", "max_tokens": "5"}, "max_tokens", "max_tokens: Input should be a valid"),
    ({"prompt": ["a", [1, "b"]]}, "prompt", "a list of either (a batch of prompts)"),
    ({"max_tokens": 5}, "prompt", "prompt: Field required"),
]


@pytest.mark.parametrize("body,param,message", COMPLETION_ERRORS)
def test_completions_refuses_bad_input_naming_the_field(http, body, param, message):
    assert_400(http.post("/v1/completions", json=body), param, message)
    assert_400(http.post("/v1/completions", json={**body, "stream": True}), param, message)


CHAT_ERRORS = [
    ({"messages": []}, "messages", "messages: must contain at least one message"),
    ({"messages": [{"role": "user", "content": LONG_PROMPT}]}, "messages",
     "the maximum context is 512 tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "must be an integer >= 1"),
    ({"top_p": 0}, "top_p", "top_p: must be in (0, 1]"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
    ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name",
     "must be 1-64 characters"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "valid boolean"),
    ({"messages": [{"role": "user"}, {"role": "user", "content": 5}]}, "messages[1].content",
     "must be a string or a list of"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", "Field required"),
]


@pytest.mark.parametrize("extra,param,message", CHAT_ERRORS)
def test_chat_refuses_bad_input_naming_the_field(http, extra, param, message):
    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    assert_400(http.post("/v1/chat/completions", json=body), param, message)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_malformed_json_is_400(http, path):
    response = http.post(path, content=b'{"prompt": "hi",',
                         headers={"content-type": "application/json"})
    assert_400(response, None, "malformed JSON body")
    assert_400(http.post(path, json=[1, 2]), None, "the request body must be a JSON object")


def test_openai_client_sees_the_error_fields(router, tiny_chat_model):
    client = openai.OpenAI(base_url=f"http://{router['http']}/v1", api_key="unused",
                           max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=tiny_chat_model.name, prompt="hi", max_tokens=0)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "max_tokens"
    models = client.models.list()
    assert [m.id for m in models.data] == [tiny_chat_model.name]


def test_models_lists_the_one_model(http, tiny_chat_model):
    body = http.get("/v1/models").json()
    assert body == {"object": "list", "data": [{
        "id": tiny_chat_model.name, "object": "model", "created": body["data"][0]["created"],
        "owned_by": "nxdi", "max_model_len": MAX_MODEL_LEN}]}
    assert abs(body["data"][0]["created"] - time.time()) < 600


def test_health_is_503_naming_the_unreachable_decode_worker(http, router):
    response = http.get("/health")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unavailable"
    assert body["reason"].startswith(f"no healthy decode worker: {router['dead_decode']} "
                                     f"(UNAVAILABLE: ")


def metric(http, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted({**labels, "role": "router"}.items()))
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(f"{name}{{{wanted}}} "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{wanted}}} not in /metrics")


@pytest.mark.parametrize("stream", [False, True])
def test_valid_request_without_a_healthy_decode_worker_is_503(http, router, stream):
    before = metric(http, "nxdi_requests_total", outcome="rejected")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 503
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("service_unavailable_error", None)
    assert error["message"].startswith(f"no healthy decode worker: {router['dead_decode']}")
    assert metric(http, "nxdi_requests_total", outcome="rejected") == before + 1


def test_metrics_count_invalid_requests(http):
    before = metric(http, "nxdi_requests_total", outcome="invalid")
    http.post("/v1/completions", json={"prompt": "hi", "top_k": -5})
    http.post("/v1/completions", content=b"{", headers={"content-type": "application/json"})
    assert metric(http, "nxdi_requests_total", outcome="invalid") == before + 2
    assert metric(http, "nxdi_queue_depth_requests") == 0


# --- gRPC Router -------------------------------------------------------------------------------


def text_request(**kwargs) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=kwargs.pop("prompt", "hi"), **kwargs)


GRPC_ERRORS = [
    (text_request(prompt=""), "prompt: must not be empty"),
    (text_request(prompt=LONG_PROMPT), "prompt: is "),
    (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, VOCAB])),
     f"prompt_token_ids: token id {VOCAB} is outside"),
    (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[])), "prompt_token_ids: must not be"),
    (pb.GenerateRequest(chat=pb.ChatMessages()), "chat: must contain at least one message"),
    (pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="x", content="a")])),
     "chat[0].role: must be one of"),
    (pb.GenerateRequest(), "input: set one of prompt, prompt_token_ids or chat"),
    (text_request(stop=pb.StopCriteria(max_tokens=0)), "max_tokens: must be an integer >= 1"),
    (text_request(stop=pb.StopCriteria(max_tokens=512)), "max_tokens: 512 plus the"),
    (text_request(sampling=pb.SamplingParams(top_p=0.0)), "top_p: must be in (0, 1]"),
    (text_request(sampling=pb.SamplingParams(top_p=1.5)), "top_p: must be in (0, 1]"),
    (text_request(sampling=pb.SamplingParams(temperature=-0.5)), "temperature: must be a"),
    (text_request(sampling=pb.SamplingParams(top_k=-2)), "top_k: must be an integer >= -1"),
    (text_request(sampling=pb.SamplingParams(top_logprobs=2)),
     "top_logprobs: requires logprobs to be true"),
    (text_request(model="other"), "model: model 'other' is not served here"),
]


@pytest.mark.parametrize("request_,message", GRPC_ERRORS)
def test_grpc_generate_refuses_bad_input_naming_the_field(stub, request_, message):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request_, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(message), info.value.details()


def test_grpc_generate_without_a_healthy_decode_worker_is_unavailable(stub, router):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(text_request(stop=pb.StopCriteria(max_tokens=3)), timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert info.value.details().startswith(f"no healthy decode worker: {router['dead_decode']}")


def test_grpc_list_models(stub, tiny_chat_model):
    reply = stub.ListModels(pb.ListModelsRequest(), timeout=10)
    assert len(reply.models) == 1
    model = reply.models[0]
    assert (model.id, model.owned_by, model.max_model_len) == (tiny_chat_model.name, "nxdi",
                                                               MAX_MODEL_LEN)
    assert abs(model.created_unix_seconds - time.time()) < 600
    assert not model.HasField("fingerprint")  # no worker has reported one


def test_tokenize_and_detokenize(http, tiny_chat_model):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    reply = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["tokens"] == tokenizer.encode("Hello world") and body["count"] == len(
        body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    messages = [{"role": "user", "content": "Hi there"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    template = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(template, add_special_tokens=False)
    bare = http.post("/tokenize", json={"messages": messages,
                                        "add_generation_prompt": False}).json()
    assert bare["tokens"] == chat["tokens"][:bare["count"]] and bare["count"] < chat["count"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert http.post("/tokenize", json={"messages": messages, "tools": tools}).json()[
        "count"] > chat["count"] + 20
    back = http.post("/detokenize", json={"tokens": chat["tokens"]}).json()
    assert back == {"prompt": template}
    assert_400(http.post("/detokenize", json={"tokens": [1, VOCAB]}), "tokens",
               f"token id {VOCAB} is outside")
    assert_400(http.post("/tokenize", json={"prompt": "a", "messages": messages}), "prompt",
               "exactly one of prompt or messages")
    assert_400(http.post("/tokenize", json={"prompt": "a", "echo": True}), "echo",
               "unrecognized request argument")
    assert_400(http.post("/tokenize", json={"prompt": "a", "model": "other"}), "model",
               "is not served here")


def test_sigterm_stops_the_router_cleanly(router, http):
    assert http.get("/v1/models").status_code == 200
    proc = router["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    assert "signal 15: stopping gracefully" in Path(router["log"]).read_text()

