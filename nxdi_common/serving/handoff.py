"""Items from an engine thread to an asyncio loop, one wake-up a burst.

``loop.call_soon_threadsafe`` writes a byte to the loop's self-pipe on every call, and the woken
loop thread then contends for the GIL with the engine thread that is still finishing the step.
A decode step emits one token event per running sequence, so a handoff per event woke the loop
once per token (py-spy of a decode worker at 4 streams: ~4% of its samples in ``_write_to_self``).
:class:`LoopHandoff` queues the items and schedules one drain for all that arrive before it runs:
the events of a step reach their streams in one wake-up, in the order they were posted."""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class LoopHandoff:
    """``post(fn, item)`` from any thread runs ``fn(item)`` on ``loop``, in posting order."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable, object]] = []
        self._scheduled = False  # a drain is scheduled and has not taken the pending items yet
        self.wakeups = 0  # drains scheduled (tests)

    def post(self, fn: Callable, item) -> None:
        with self._lock:
            self._pending.append((fn, item))
            if self._scheduled:
                return
            self._scheduled = True
            self.wakeups += 1
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            log.debug("dropped %d items: event loop closed", len(self._pending))

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending, self._scheduled = self._pending, [], False
        for fn, item in batch:
            fn(item)
