"""Items from an engine thread to an asyncio loop, one wake-up a burst.

``loop.call_soon_threadsafe`` writes a byte to the loop's self-pipe on every call, and the woken
loop thread then contends for the GIL with the engine thread that is still finishing the step.
A decode step emits one token event per running sequence, so a handoff per event woke the loop
once per token (py-spy of a decode worker at 4 streams: ~4% of its samples in ``_write_to_self``).
:class:`LoopHandoff` queues the items and schedules one drain for all that arrive before it runs:
the events of a step reach their streams in one wake-up, in the order they were posted.

A drain scheduled at a step's first event still ran while the engine thread was posting the
rest: the woken loop thread took the GIL, drained what was there, and the next post woke it
again, a GIL handoff per token on a one-core worker. So a thread that posts a burst does it
inside :func:`deferred_wakeups`: its posts wake their loops once, when the block ends. A decode
worker at 3 req/s on `mixed` (10-30 streams, session 58): host work a step 3.22 -> 2.75 ms. The
one wake-up left still shows in py-spy (5.2% of the engine thread in ``_write_to_self``, 5.5%
before): on one core the woken loop thread drains the whole step's events while the engine
thread waits for the GIL, so what is left is the events' own cost (gRPC's per-message send)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)
_deferring = threading.local()  # .handoffs: the set of handoffs to wake at the block's end


@contextlib.contextmanager
def deferred_wakeups():
    """Posts this thread makes inside the block (to any LoopHandoff) wake their loops once, at
    its end, instead of at the first post; nested blocks wake at the outermost one's end."""
    if getattr(_deferring, "handoffs", None) is not None:
        yield
        return
    _deferring.handoffs = set()
    try:
        yield
    finally:
        handoffs, _deferring.handoffs = _deferring.handoffs, None
        for handoff in handoffs:
            handoff.wake()


class LoopHandoff:
    """``post(fn, item)`` from any thread runs ``fn(item)`` on ``loop``, in posting order."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable, object]] = []
        self._scheduled = False  # a drain is scheduled and has not taken the pending items yet
        self.wakeups = 0  # drains scheduled (tests)

    def post(self, fn: Callable, item) -> None:
        deferring = getattr(_deferring, "handoffs", None)
        with self._lock:
            self._pending.append((fn, item))
            if self._scheduled:
                return
            if deferring is not None:  # woken at the block's end (deferred_wakeups)
                deferring.add(self)
                return
            self._scheduled = True
            self.wakeups += 1
        self._call_drain()

    def wake(self) -> None:
        """Schedule a drain of the pending items unless one is scheduled or none wait."""
        with self._lock:
            if self._scheduled or not self._pending:
                return
            self._scheduled = True
            self.wakeups += 1
        self._call_drain()

    def _call_drain(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            log.debug("dropped %d items: event loop closed", len(self._pending))

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending, self._scheduled = self._pending, [], False
        for fn, item in batch:
            fn(item)
