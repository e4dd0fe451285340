"""API keys: with keys set, every HTTP request but ``/health`` and ``/metrics`` (``/v1/...``,
``/tokenize``, ...) and every call of the gRPC ``Router`` service must carry one as
``Authorization: Bearer <key>`` (HTTP header / gRPC metadata); anything else is refused (HTTP
401 in OpenAI's error shape, gRPC UNAUTHENTICATED) before it is parsed. ``/health``, ``/metrics`` and the gRPC health and reflection services stay
open for probes and scrapers. Keys come from ``--api-key`` (repeatable) and the ``NXDI_API_KEY``
environment variable (comma-separated, so a key stays out of the process list); several keys
let a key be rotated without a restart of the clients. Keys are compared in constant time.
The workers' own gRPC ports are not covered: they belong on a private network (deploy/)."""
from __future__ import annotations

import hmac
import os

import grpc
from fastapi.responses import JSONResponse

ENV_VAR = "NXDI_API_KEY"
OPEN_HTTP_PATHS = ("/health", "/metrics")  # probes and scrapers
MISSING = "missing API key: send it as 'Authorization: Bearer <key>'"
WRONG = "incorrect API key"


def keys_from(cli_keys, environ=None) -> tuple[str, ...]:
    """The accepted keys: ``--api-key`` values and NXDI_API_KEY's, empties dropped."""
    environ = os.environ if environ is None else environ
    keys = [k.strip() for k in environ.get(ENV_VAR, "").split(",")]
    keys += [k.strip() for k in cli_keys or ()]
    return tuple(dict.fromkeys(k for k in keys if k))


class ApiKeys:
    """The keys a router accepts; ``check`` returns None when a request may pass, else why not."""

    def __init__(self, keys: tuple[str, ...]):
        self._keys = [k.encode() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> str | None:
        if not self._keys:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return MISSING
        given = token.strip().encode()
        # every key compared (no early exit), each in constant time
        ok = [hmac.compare_digest(given, key) for key in self._keys]
        return None if any(ok) else WRONG


class HttpAuth:
    """ASGI middleware: requests need a key, but for OPEN_HTTP_PATHS (module doc)."""

    def __init__(self, app, keys: ApiKeys):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_HTTP_PATHS:
            header = next((v.decode("latin-1") for k, v in scope["headers"]
                           if k == b"authorization"), None)
            reason = self.keys.check(header)
            if reason is not None:
                body = {"error": {"message": reason, "type": "invalid_request_error",
                                  "param": None, "code": "invalid_api_key"}}
                response = JSONResponse(body, status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class GrpcAuth(grpc.aio.ServerInterceptor):
    """Calls of ``service`` need a key in their ``authorization`` metadata (module doc)."""

    def __init__(self, keys: ApiKeys, service: str):
        self.keys, self._prefix = keys, f"/{service}/"

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self._prefix):
            return handler
        metadata = dict(details.invocation_metadata or ())
        reason = self.keys.check(metadata.get("authorization"))
        if reason is None:
            return handler
        return _refusing(handler, reason)


def _refusing(handler, reason: str):
    """A handler of the same kind as ``handler`` that answers UNAUTHENTICATED."""
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        yield  # pragma: no cover - makes this an async generator

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(streaming if handler.response_streaming else unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
