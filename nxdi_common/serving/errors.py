"""Errors the services raise, each tied to the gRPC status code it is reported with.

Handlers raise these (or plain ValueError / KVChunkError); the one server interceptor
(grpc_server.StatusInterceptor) turns them into a status code and message, so handlers stay plain.
The HTTP gateway maps the same classes to HTTP statuses (400, 404, 429, 503)."""
from __future__ import annotations

import grpc


class ServingError(Exception):
    """Base class: ``code`` is the gRPC status code, ``http_status`` the HTTP one."""

    code = grpc.StatusCode.INTERNAL
    http_status = 500


class InvalidRequest(ServingError, ValueError):
    """The request is malformed; ``field`` names the offending field (as the client spelled it)."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class ModelNotFound(InvalidRequest):
    """The requested model is not served here (HTTP 400 naming "model", as the API promises;
    OpenAI itself answers 404)."""


class Overloaded(ServingError):
    """The worker cannot take the request now (no free KV blocks, queue full); try another."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429


class Unavailable(ServingError):
    """Shutting down, no healthy worker, or every prefill candidate failed."""

    code = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class FailedPrecondition(ServingError):
    """Model fingerprints disagree, or a KV chunk failed validation."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 500
