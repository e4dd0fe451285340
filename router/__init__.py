"""The router: the front door of the serving system.

An OpenAI-compatible HTTP gateway and the gRPC ``Router`` service, in one process and one asyncio
loop. It validates and tokenizes requests (:mod:`router.frontend`), picks a decode worker and
ranked prefill candidates from polled load reports (:mod:`router.registry`,
:mod:`router.policies`), and streams the decode worker's tokens back (:mod:`router.dispatch`).
Start it with ``python -m router`` or :class:`router.server.RunningRouter`."""
