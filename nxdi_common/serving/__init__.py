"""What the prefill, decode and router services share: request types and their validation,
errors with their gRPC status codes, the gRPC server scaffolding (interceptor, health, reflection),
metrics, model loading for workers, incremental detokenization, and the local launcher.

Nothing here imports torch at module import time except `worker` (which builds models)."""
