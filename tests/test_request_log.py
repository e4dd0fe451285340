"""The router's request log (router/dispatch.py module doc), on real processes: one line per
finished request with its id, outcome, decode worker, where its prompt was prefilled, token
counts, finish reason and times, never the prompt's or the answer's text; a refused request's
line carries its error; with --no-request-log there are none."""
from __future__ import annotations

import re
import time

import httpx
import pytest

PROMPT = "A secret word: pumpernickel. Repeat it."


@pytest.fixture(scope="module")
def stack(spawn_module, tiny_chat_model):
    common = ("--model", tiny_chat_model, "--dtype", "float32", "--backend", "eager",
              "--threads", "1", "--max-model-len", 256)
    decode = spawn_module("decode_service", *common, "--kv-blocks", 8)  # 128 tokens
    prefill = spawn_module("prefill_service", *common)
    router = ("router", "--model", tiny_chat_model, "--max-model-len", 256, "--model-name",
              "tiny", "--http-port", 0, "--grpc-port", 0, "--decode", decode.grpc,
              "--prefill", prefill.grpc, "--queue-timeout-seconds", 0)
    return (decode, spawn_module(*router), spawn_module(*router, "--no-request-log"), prefill,
            spawn_module(*router, "--local-prefill-always-tokens", 64))


def lines_for(service, request_id: str, timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [line for line in service.output().splitlines() if f"request {request_id} " in line]
        if found:
            return found
        time.sleep(0.1)
    return []


def completion_line(router) -> tuple[dict, dict, str]:
    r = httpx.post(f"http://{router.info['http']}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200
    body = r.json()
    (line,) = lines_for(router, body["id"].removeprefix("cmpl-"))
    return body, dict(re.findall(r"(\w+)=(\S+)", line)), line


def test_each_request_ends_with_one_line_of_counts_and_times(stack):
    decode, router, _, prefill, _ = stack
    body, fields, line = completion_line(router)
    assert " ok " in line and fields["decode"] == decode.grpc
    assert fields["prefill"] == prefill.grpc  # disaggregated: the prefill worker offered
    assert int(fields["prompt"]) == body["usage"]["prompt_tokens"]
    assert int(fields["output"]) == 5 and fields["finish"] == "length"
    assert 0 < float(fields["ttft"].rstrip("s")) <= float(fields["e2e"].rstrip("s"))
    assert "pumpernickel" not in router.output()


def test_a_prompt_the_decode_worker_prefills_itself_logs_prefill_local(stack):
    decode, _, _, _, local_router = stack
    body, fields, line = completion_line(local_router)  # a prompt under 64 tokens: local
    assert " ok " in line and fields["decode"] == decode.grpc and fields["prefill"] == "local"
    assert int(fields["prompt"]) == body["usage"]["prompt_tokens"] <= 64


def test_a_refused_request_logs_its_error_and_the_flag_turns_lines_off(stack):
    _, router, quiet, _, _ = stack
    # more tokens than the decode worker's 8 blocks of 16 hold: refused before any token
    r = httpx.post(f"http://{router.info['http']}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": [1] * 200, "max_tokens": 50})
    assert r.status_code in (429, 503), r.text
    request_id = None
    deadline = time.monotonic() + 10.0  # the line may reach the log after the response
    while request_id is None and time.monotonic() < deadline:
        for line in router.output().splitlines()[::-1]:
            if " rejected " in line or " error " in line:
                request_id = line.split("request ", 1)[1].split()[0]
                break
        else:
            time.sleep(0.1)
    assert request_id is not None and "error=" in lines_for(router, request_id)[0]
    r = httpx.post(f"http://{quiet.info['http']}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200
    assert not lines_for(quiet, r.json()["id"].removeprefix("cmpl-"), timeout=1.0)
