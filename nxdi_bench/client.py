"""The load generator's client: streamed ``/v1/completions`` requests against any OpenAI-compatible
server, open loop (each request sent at its arrival time, whether or not earlier ones finished) or
closed loop (a fixed number of requests in flight), recording each token event's arrival time."""
from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable, Sequence

import httpx

from nxdi_bench.metrics import RequestRecord
from nxdi_bench.workloads import BenchRequest

__all__ = ["LoadTarget", "run_open_loop", "run_closed_loop", "Progress"]


class LoadTarget:
    """Where to send requests: the server's base URL, the model name, and extra JSON fields the
    server needs so outputs have exactly the requested length (``ignore_eos`` for ours and vLLM)."""

    def __init__(self, base_url: str, model: str, extra_body: dict | None = None,
                 usage_in_stream: bool = True, timeout_s: float = 600.0, api_key: str = ""):
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        self.extra_body = dict(extra_body or {})
        self.usage_in_stream = usage_in_stream
        self.timeout_s = timeout_s

    def body(self, req: BenchRequest) -> dict:
        body = {"model": self.model, "prompt": req.prompt, "max_tokens": req.output_tokens,
                "temperature": 0.0, "stream": True}
        if self.usage_in_stream:
            body["stream_options"] = {"include_usage": True}
        body.update(self.extra_body)
        return body


class Progress:
    """One status line, rewritten in place on a terminal, else printed every ``every_s``."""

    def __init__(self, label: str, total: int, stream=None, every_s: float = 5.0):
        self.label, self.total = label, total
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every_s = every_s if not self.tty else 0.2
        self.done = self.failed = 0
        self.start = time.monotonic()
        self._last = -1e9

    def update(self, record: RequestRecord) -> None:
        self.done += 1
        self.failed += record.error is not None
        self.show(final=self.done == self.total)

    def show(self, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self._last < self.every_s:
            return
        self._last = now
        line = (f"{self.label}: {self.done}/{self.total} done, {self.failed} failed, "
                f"{now - self.start:.0f} s")
        if self.tty:
            self.stream.write("\r\033[K" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


async def _stream_one(client: httpx.AsyncClient, target: LoadTarget, req: BenchRequest,
                      record: RequestRecord, t0: float) -> None:
    record.sent_s = time.perf_counter() - t0
    try:
        async with client.stream("POST", target.base_url + "/v1/completions",
                                 json=target.body(req)) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                record.error = f"HTTP {resp.status_code}: {text[:300]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - t0
                event = json.loads(data)
                if "error" in event:
                    record.error = f"stream error: {json.dumps(event['error'])[:300]}"
                    return
                if _carries_token(event):
                    record.token_times.append(now)
                if event.get("usage"):
                    record.output_tokens = event["usage"].get("completion_tokens")
                    record.prompt_tokens = event["usage"].get("prompt_tokens", record.prompt_tokens)
            if not record.token_times:
                record.error = "the stream ended without any token"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        record.end_s = time.perf_counter() - t0


def _carries_token(event: dict) -> bool:
    """Servers send one event per token; llama.cpp's server adds a last event with no text that
    only carries the finish reason, which is not a token."""
    choices = event.get("choices")
    if not choices:
        return False
    choice = choices[0]
    text = choice.get("text", (choice.get("delta") or {}).get("content"))
    return bool(text) or choice.get("finish_reason") is None


def _new_record(req: BenchRequest, due: float) -> RequestRecord:
    return RequestRecord(index=req.index, kind=req.kind, due_s=due, prompt_tokens=req.prompt_tokens,
                         expected_output_tokens=req.output_tokens)


def _client(target: LoadTarget) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(target.timeout_s, connect=30.0),
                             headers=target.headers,
                             limits=httpx.Limits(max_connections=None,
                                                 max_keepalive_connections=64))


async def run_open_loop(target: LoadTarget, requests: Sequence[BenchRequest],
                        arrivals: Sequence[float],
                        on_done: Callable[[RequestRecord], object] | None = None,
                        ) -> list[RequestRecord]:
    """Send request i at ``arrivals[i]`` seconds after the start; wait for all of them."""
    if len(arrivals) != len(requests):
        raise ValueError(f"arrivals: {len(arrivals)} times for {len(requests)} requests")
    records = [_new_record(r, float(a)) for r, a in zip(requests, arrivals)]
    async with _client(target) as client:
        t0 = time.perf_counter()

        async def one(req: BenchRequest, record: RequestRecord) -> None:
            delay = record.due_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            await _stream_one(client, target, req, record, t0)
            if on_done:
                on_done(record)

        await asyncio.gather(*(one(r, rec) for r, rec in zip(requests, records)))
    return records


async def run_closed_loop(target: LoadTarget, requests: Sequence[BenchRequest], concurrency: int,
                          on_done: Callable[[RequestRecord], object] | None = None,
                          ) -> list[RequestRecord]:
    """Keep ``concurrency`` requests in flight until every request has been sent and answered."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    records: list[RequestRecord | None] = [None] * len(requests)
    queue = list(enumerate(requests))[::-1]
    async with _client(target) as client:
        t0 = time.perf_counter()

        async def slot() -> None:
            while queue:
                i, req = queue.pop()
                record = records[i] = _new_record(req, time.perf_counter() - t0)
                await _stream_one(client, target, req, record, t0)
                if on_done:
                    on_done(record)

        await asyncio.gather(*(slot() for _ in range(min(concurrency, len(requests)))))
    return records
