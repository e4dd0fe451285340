"""The OpenAI-compatible HTTP gateway (FastAPI): ``POST /v1/completions``,
``POST /v1/chat/completions`` (JSON or SSE streaming), ``GET /v1/models``, vLLM's
``POST /tokenize`` and ``POST /detokenize``, ``GET /health`` and ``GET /metrics``.

Errors are OpenAI-shaped ``{"error": {"message", "type", "param", "code"}}``: malformed JSON and
every validation failure give 400 naming the parameter; a full pool 429; no healthy decode worker
503. When the client goes away, the request's decode call is cancelled (streaming: the event
stream is closed; non-streaming: the request's work is cancelled).

A completions batch of prompts is a request per prompt, its choices after the previous
prompt's (prompt i's are i * n .. i * n + n - 1). ``n`` choices are ``n`` requests through the
dispatcher (ids suffixed ``-0``..; a seeded request's choice i is seeded ``seed + i``, so the
choices differ and each replays). A prompt's choices share its prefill (router/dispatch.py,
SharedPrompt): the first runs at once, the others once its prompt's KV is on its decode worker.
All of a request's are merged: the response lists the choices by index, a stream interleaves
their chunks as tokens come (each carrying its choice's index; a stream starts once every
prompt's first choice has its first token), usage counts each prompt once and every choice's
tokens. The first failure of any of them fails the whole request (the others are cancelled);
the router's metrics count each as a request of its own."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from nxdi_common.serving.errors import InvalidRequest, ServingError
from router import openai_format as fmt
from router.dispatch import Dispatcher, SharedPrompt
from router.frontend import ModelFrontend, RoutedRequest
from router.openai_schema import (ChatRequest, CompletionRequest, DetokenizeRequest,
                                  TokenizeRequest, chat_to_routed, chat_tools, choices,
                                  completions_to_routed, detokenize, structured_field, tokenize)

log = logging.getLogger(__name__)
ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error",
               429: "rate_limit_error", 503: "service_unavailable_error", 504: "timeout_error"}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering
LATER = object()  # a choice's first token, not fetched before the stream starts (_first)


class ClientGone(Exception):
    """The HTTP client disconnected before the response was ready."""


# --- errors --------------------------------------------------------------------------------------


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    """An OpenAI-shaped error body."""
    body = {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
            "param": param, "code": code}
    return JSONResponse({"error": body}, status_code=status)


def serving_error_response(exc: ServingError) -> JSONResponse:
    if isinstance(exc, InvalidRequest):
        message = str(exc)
        return error_response(exc.http_status, message, exc.field)
    return error_response(exc.http_status, str(exc))


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    """Pydantic / JSON errors -> 400 naming the first offending parameter."""
    first = exc.errors()[0]
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return error_response(400, f"malformed JSON body: {first.get('msg')} "
                                   f"(at character {loc[0] if loc else '?'})")
    if not loc:
        return error_response(400, f"the request body must be a JSON object: {first.get('msg')}")
    param = _param_name(loc)
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return error_response(400, f"{param}: {msg}", param)


def _param_name(loc: list) -> str:
    """("messages", 0, "content") -> "messages[0].content"."""
    name = str(loc[0])
    for part in loc[1:]:
        name += f"[{part}]" if isinstance(part, int) else f".{part}"
    return name


# --- client disconnects --------------------------------------------------------------------------


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, awaitable):
    """Await ``awaitable`` unless the client disconnects first: then cancel it, raise ClientGone."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if work.cancelled():
        raise ClientGone()
    return work.result()


class EventStreamResponse(StreamingResponse):
    """SSE response that always watches for the client leaving, and always closes its body
    iterator (so the generator's cleanup, which cancels the decode call, runs right away)."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({stream, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, watch):
                task.cancel()
            await asyncio.gather(stream, watch, return_exceptions=True)
            await self.body_iterator.aclose()
        if stream.done() and not stream.cancelled():
            exc = stream.exception()
            if exc is not None and not isinstance(exc, OSError):
                raise exc


# --- generation ----------------------------------------------------------------------------------


async def _collect(events) -> list:
    async with contextlib.aclosing(events):
        return [out async for out in events]


async def _all_or_none(coros) -> list:
    """The results of all of ``coros``, run at once; the first failure cancels the rest."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()  # no-op for the finished ones
        await asyncio.gather(*tasks, return_exceptions=True)


def _choice_requests(routed: RoutedRequest, n: int) -> list[RoutedRequest]:
    """The requests of ``n`` choices (module doc)."""
    if n == 1:
        return [routed]
    seed = routed.sampling.seed
    return [dataclasses.replace(
        routed, request_id=f"{routed.request_id}-{i}",
        sampling=routed.sampling if seed is None
        else dataclasses.replace(routed.sampling, seed=(seed + i) % 2 ** 64)) for i in range(n)]


async def _sse(firsts: list, streams: list, formatter: fmt.Formatter):
    """The SSE body: one chunk per token of any choice as it comes, the usage chunk if asked,
    then [DONE]. An error after the stream started is sent as an error event."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, out, events) -> None:
        try:
            if out is LATER:
                out = await anext(events, None)
            while out is not None:
                queue.put_nowait((index, out))
                out = await anext(events, None)
        except ServingError as exc:
            queue.put_nowait((index, exc))
            return
        queue.put_nowait((index, None))

    tasks = []
    try:
        for chunk in formatter.start_chunks():
            yield fmt.sse(chunk)
        tasks = [asyncio.ensure_future(pump(i, first, events))
                 for i, (first, events) in enumerate(zip(firsts, streams))]
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, ServingError):
                raise item
            else:
                for chunk in formatter.token_chunks(item, index):
                    yield fmt.sse(chunk)
        for chunk in formatter.end_chunks():
            yield fmt.sse(chunk)
    except ServingError as exc:
        log.info("stream %s failed: %s", formatter.response_id, exc)
        yield fmt.sse(json.loads(serving_error_response(exc).body))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for events in streams:
            await events.aclose()
    yield fmt.SSE_DONE


async def _first(events, index: int, per_prompt: int):
    """A stream's first token before the SSE response starts: a prompt's first choice's; its
    other choices' wait for it (SharedPrompt), so theirs come later (LATER)."""
    return await anext(events, None) if index % per_prompt == 0 else LATER


async def _respond(request: Request, dispatcher: Dispatcher, formatter: fmt.Formatter,
                   stream: bool, started: float) -> Response:
    per_prompt = formatter.n // len(formatter.prompts)
    streams = []
    for routed in formatter.prompts:
        shared = SharedPrompt() if per_prompt > 1 else None
        streams += [dispatcher.generate(r, started=started, shared=shared)
                    for r in _choice_requests(routed, per_prompt)]
    if not stream:
        outs = await until_disconnect(request, _all_or_none(_collect(e) for e in streams))
        return JSONResponse(formatter.response(outs))
    try:
        firsts = await until_disconnect(request, _all_or_none(
            _first(e, i, per_prompt) for i, e in enumerate(streams)))
    except BaseException:
        for events in streams:
            await events.aclose()
        raise
    return EventStreamResponse(_sse(firsts, streams, formatter), headers=SSE_HEADERS)


# --- the app -------------------------------------------------------------------------------------


def create_app(frontend: ModelFrontend, dispatcher: Dispatcher) -> FastAPI:
    """The gateway for one model, routing through ``dispatcher``."""
    app = FastAPI(title="nxdi router", docs_url=None, redoc_url=None)
    metrics = dispatcher.metrics

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        metrics.requests_total.inc("invalid")
        return validation_error_response(exc)

    @app.exception_handler(ServingError)
    async def on_serving_error(request: Request, exc: ServingError):
        if isinstance(exc, InvalidRequest):
            metrics.requests_total.inc("invalid")
        return serving_error_response(exc)

    @app.exception_handler(ClientGone)
    async def on_client_gone(request: Request, exc: ClientGone):
        return Response(status_code=499)

    _add_generation_routes(app, frontend, dispatcher)
    _add_info_routes(app, frontend, dispatcher)
    return app


def _add_generation_routes(app: FastAPI, frontend: ModelFrontend, dispatcher: Dispatcher):
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        started = time.monotonic()
        prompts = completions_to_routed(body, frontend)
        await frontend.check_structured(prompts[0].sampling, structured_field(body))
        formatter = fmt.CompletionFormatter(frontend, prompts[0], body, choices(body), prompts)
        return await _respond(request, dispatcher, formatter, bool(body.stream), started)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        started = time.monotonic()
        tools = frontend.tools_for(chat_tools(body))
        routed = chat_to_routed(body, frontend, tools=tools)
        await frontend.check_structured(routed.sampling, structured_field(body))
        formatter = fmt.ChatFormatter(frontend, routed, body, choices(body), tools=tools)
        return await _respond(request, dispatcher, formatter, bool(body.stream), started)


def _add_info_routes(app: FastAPI, frontend: ModelFrontend, dispatcher: Dispatcher):
    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest):
        return tokenize(body, frontend)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest):
        return detokenize(body, frontend)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [fmt.model_card(frontend)]}

    @app.get("/health")
    async def health():
        reason = dispatcher.unhealthy_reason()
        if reason:
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        registry = dispatcher.registry
        return {"status": "ok", "decode_workers": len(registry.healthy("decode")),
                "prefill_workers": len(registry.healthy("prefill"))}

    @app.get("/metrics")
    async def metrics():
        return Response(dispatcher.metrics.render(), media_type=CONTENT_TYPE_LATEST)
