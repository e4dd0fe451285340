"""The router's admission queue: a request that every decode worker refused for room
(RESOURCE_EXHAUSTED: not enough free KV blocks) waits here for its turn, first come first
served within a priority (a request's ``priority``, lower first; all 0 unless the router runs
with --scheduling-policy priority), instead of being shed at once with HTTP 429.

Only the request at the head of the queue tries the decode workers again, when room may have
come (a request this router sent finished, or ``retry_seconds`` passed: room freed by another
router's requests or by a preempted sequence's return shows up on the next try); a request that
arrives while others of its priority or a better one wait queues behind them without trying, so
a stream of small requests cannot starve a large one. A request leaves the queue when a decode
worker takes it (its ``nxdi-admitted`` initial metadata; until session 58 only at its first
token, a prefill later, which let one queued request in per time to first token), when
``timeout_seconds`` pass (then 429, as before the queue existed), or when its client goes away.
More than ``max_waiting`` waiting requests: the next is shed at once. A decode worker's own
admission (blocks for the prompt plus one spare per live sequence, decode_service/engine.py)
stays the one judge of room: the queue only decides who asks next."""
from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import time

from nxdi_common.serving.errors import Overloaded


class AdmissionQueue:
    def __init__(self, timeout_seconds: float = 60.0, max_waiting: int = 1024,
                 retry_seconds: float = 0.25):
        if timeout_seconds < 0:
            raise ValueError(f"queue timeout_seconds must be >= 0 (0: no queue), got "
                             f"{timeout_seconds}")
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        if retry_seconds <= 0:
            raise ValueError(f"retry_seconds must be > 0, got {retry_seconds}")
        self.timeout_seconds, self.max_waiting = timeout_seconds, max_waiting
        self.retry_seconds = retry_seconds
        self._tickets: list[tuple[int, int]] = []  # (priority, arrival number), in turn order
        self._numbers = itertools.count()
        self._room: asyncio.Event | None = None  # set (and replaced) by notify()

    @property
    def enabled(self) -> bool:
        return self.timeout_seconds > 0

    def __len__(self) -> int:
        return len(self._tickets)

    def ahead_of(self, priority: int = 0) -> int:
        """Requests waiting that a new one of ``priority`` would queue behind."""
        return bisect.bisect_right(self._tickets, (priority, float("inf")))

    def notify(self) -> None:
        """Room may have come (a request finished): wake the waiting requests."""
        if self._room is not None:
            self._room.set()
            self._room = None

    def leave(self, ticket) -> None:
        """``ticket`` leaves the queue now (a decode worker took its request; it is still in
        its ``place`` block, waiting for the first token): the next request's turn comes at once.
        Leaving twice, or leaving the block afterwards, is a no-op."""
        with contextlib.suppress(ValueError):
            self._tickets.remove(ticket)
            self.notify()

    def rejoin(self, ticket) -> None:
        """``ticket`` (which left) back in its turn: its request failed on the worker that took
        it before a first token, and waits for room again."""
        if ticket not in self._tickets:
            bisect.insort(self._tickets, ticket)

    @contextlib.asynccontextmanager
    async def place(self, priority: int = 0):
        """Join the queue behind every request of ``priority`` or a lower value (Overloaded when
        max_waiting wait already); leaving the block leaves the queue, and the next request's
        turn comes at once."""
        if len(self._tickets) >= self.max_waiting:
            raise Overloaded(f"every decode worker is full and {len(self._tickets)} requests "
                             f"already wait for room (--max-queued-requests)")
        ticket = (priority, next(self._numbers))
        bisect.insort(self._tickets, ticket)
        try:
            yield ticket
        finally:
            self.leave(ticket)

    async def turn(self, ticket, deadline: float) -> bool:
        """Wait until ``ticket`` heads the queue and room may have come since this was last
        called (notify(), or retry_seconds passed); False once ``deadline`` (time.monotonic())
        has passed."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._room is None:
                self._room = asyncio.Event()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._room.wait(), min(left, self.retry_seconds))
            if self._tickets and self._tickets[0] == ticket and time.monotonic() < deadline:
                return True
