"""The gRPC ``Router`` service: Generate (stream of TokenEvents) and ListModels.

Handlers raise; the shared StatusInterceptor turns InvalidRequest into INVALID_ARGUMENT (the
message names the field), Overloaded into RESOURCE_EXHAUSTED, Unavailable into UNAVAILABLE.
A client that cancels (or whose deadline passes) cancels the handler, which cancels the decode
call; the client's remaining deadline is the decode call's timeout.

Tools (chat input only) work as on the HTTP API (router/tools.py: the prompt, the constraint of
"required" and a named function); the events stream the answer's text as written, and the last
one carries the calls parsed out of it (TokenEvent.tool_calls)."""
from __future__ import annotations

import contextlib
import time

import grpc

from nxdi_common.serving.errors import InvalidRequest
from router import convert
from router.dispatch import Dispatcher
from router.frontend import ChatOptions, ModelFrontend, RoutedRequest
from router.policies import DECODE
from router.tools import ToolRequest, with_tools


def routed_from_proto(req, frontend: ModelFrontend,
                      tools: ToolRequest | None = None) -> RoutedRequest:
    """Validate a GenerateRequest and tokenize its input (chat: through the chat template, with
    ``tools``, convert.generate_tools' answer for it)."""
    frontend.check_model(req.model)
    kind, value = convert.generate_input(req)
    sampling, stop = convert.generate_options(req)
    if tools is not None and kind != "chat":
        raise InvalidRequest("tools", "only with chat input")
    options = convert.chat_options(req)
    if kind != "chat" and options != ChatOptions():
        raise InvalidRequest("continue_final_message" if req.continue_final_message else
                             "add_generation_prompt" if req.HasField("add_generation_prompt")
                             else "chat_template_kwargs_json", "only with chat input")
    sampling = with_tools(sampling, tools, "sampling.structured_output")
    if kind == "prompt":
        ids = frontend.encode_text(value)
    elif kind == "chat":
        ids = frontend.encode_chat(value, "chat", tools, options)
    else:
        ids = value
    truncate = req.truncate_prompt_tokens if req.HasField("truncate_prompt_tokens") else None
    return frontend.prepare(ids, sampling, stop, kind, req.request_id, truncate, req.priority,
                            req.cache_salt)


class RouterServicer(convert.RouterServicerBase):
    """Serves one model through ``dispatcher``."""

    def __init__(self, frontend: ModelFrontend, dispatcher: Dispatcher):
        self.frontend, self.dispatcher = frontend, dispatcher

    async def Generate(self, request, context: grpc.aio.ServicerContext):  # noqa: N802
        started = time.monotonic()
        try:
            tools = self.frontend.tools_for(convert.generate_tools(request))
            routed = routed_from_proto(request, self.frontend, tools)
            await self.frontend.check_structured(routed.sampling, "sampling.structured_output")
        except ValueError:
            self.dispatcher.metrics.requests_total.inc("invalid")
            raise
        parses = tools is not None and tools.parses_calls
        text = []
        events = self.dispatcher.generate(routed, timeout=context.time_remaining(),
                                          started=started)
        async with contextlib.aclosing(events):
            async for out in events:
                calls = []
                if parses:
                    text.append(out.text)
                    if out.finish_reason is not None:
                        calls = tools.split("".join(text))[1]
                yield convert.token_event(out, calls)

    async def ListModels(self, request, context: grpc.aio.ServicerContext):  # noqa: N802
        f = self.frontend
        return convert.list_models(f.name, f.created, f.limits.max_model_len,
                                   self._fingerprint())

    def _fingerprint(self):
        """A healthy decode worker's model fingerprint, when one has reported it."""
        for w in self.dispatcher.registry.healthy(DECODE):
            if w.load is not None and w.load.fingerprint is not None:
                return w.load.fingerprint
        return None
