"""The prefill worker: runs context encoding over prompts, samples the first token and streams the
prompt's KV cache to a decode worker (``nxdi.serving.v1.Prefill``).

Modules: ``server`` (the gRPC servicer, the app around it and the command line), ``scheduler``
(batching by context-encoding bucket and the torch work on one worker thread) and ``convert`` (the
one module that touches protobuf messages)."""
