"""The gRPC ``Router`` service: Generate (stream of TokenEvents) and ListModels.

Handlers raise; the shared StatusInterceptor turns InvalidRequest into INVALID_ARGUMENT (the
message names the field), Overloaded into RESOURCE_EXHAUSTED, Unavailable into UNAVAILABLE.
A client that cancels (or whose deadline passes) cancels the handler, which cancels the decode
call; the client's remaining deadline is the decode call's timeout."""
from __future__ import annotations

import contextlib
import time

import grpc

from router import convert
from router.dispatch import Dispatcher
from router.frontend import ModelFrontend, RoutedRequest
from router.policies import DECODE


def routed_from_proto(req, frontend: ModelFrontend) -> RoutedRequest:
    """Validate a GenerateRequest and tokenize its input (chat: through the chat template)."""
    frontend.check_model(req.model)
    kind, value = convert.generate_input(req)
    sampling, stop = convert.generate_options(req)
    if kind == "prompt":
        ids = frontend.encode_text(value)
    elif kind == "chat":
        ids = frontend.encode_chat(value, "chat")
    else:
        ids = value
    return frontend.prepare(ids, sampling, stop, kind, req.request_id)


class RouterServicer(convert.RouterServicerBase):
    """Serves one model through ``dispatcher``."""

    def __init__(self, frontend: ModelFrontend, dispatcher: Dispatcher):
        self.frontend, self.dispatcher = frontend, dispatcher

    async def Generate(self, request, context: grpc.aio.ServicerContext):  # noqa: N802
        started = time.monotonic()
        try:
            routed = routed_from_proto(request, self.frontend)
            await self.frontend.check_structured(routed.sampling, "sampling.structured_output")
        except ValueError:
            self.dispatcher.metrics.requests_total.inc("invalid")
            raise
        events = self.dispatcher.generate(routed, timeout=context.time_remaining(),
                                          started=started)
        async with contextlib.aclosing(events):
            async for out in events:
                yield convert.token_event(out)

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
