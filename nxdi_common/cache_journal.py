"""What a prefix cache holds, as a numbered journal a router can follow. Imports no torch.

A worker's prefix cache (:class:`~nxdi_common.block_manager.BlockManager`) keys each sealed
block by a hash chained over the blocks before it. A router that knows which of those hashes a
worker holds can send a prompt where its prefix is, and know when it is gone: evicted under
memory pressure, or lost with a restart. The journal records every block entering the hash
index (stored) and leaving it (removed, when allocation reuses the block), numbered from 1, in
a bounded log. A reader keeps a cursor (the journal's instance, the last number it saw) and
asks what changed since; the answer is the net change for each block touched since the cursor
(held now: stored; not held now: removed), or, when the cursor is from another instance (a
restarted worker) or older than the log goes back, every block held now (a snapshot). The
worker keeps no state per reader, so any number of routers can follow it.

Hashes are reported by their low 64 bits (protobuf has no 128-bit integer; a router compares
the same bits of its own chained hashes, and a collision between two live blocks, about one in
2^64 per pair, would cost one misrouted prompt, nothing more).

Written by the thread that owns the block manager, read by the serving thread: every method
takes the journal's lock."""
from __future__ import annotations

import secrets
import threading
from collections import deque
from dataclasses import dataclass, field
from itertools import islice

MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class CacheReport:
    """The journal's answer to a cursor: ``seq`` is the new cursor's number; with ``snapshot``
    ``stored`` is every block held (replace what you had), else ``stored`` and ``removed`` are
    the changes since the cursor (apply them)."""

    instance: int
    seq: int
    snapshot: bool
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()


@dataclass
class CacheJournal:
    """A bounded, numbered journal of the block hashes a prefix cache stores and removes.

    ``max_events``: how many changes the log keeps; a reader further behind gets a snapshot."""

    max_events: int = 8192
    instance: int = field(default_factory=lambda: secrets.randbits(63) | 1)  # never 0
    _held: set[int] = field(default_factory=set, init=False, repr=False)
    _log: deque[int] = field(default_factory=deque, init=False, repr=False)
    _first: int = field(default=1, init=False, repr=False)  # number of _log[0]
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self):
        if isinstance(self.max_events, bool) or not isinstance(self.max_events, int) \
                or self.max_events < 1:
            raise ValueError(f"max_events must be an integer >= 1, got {self.max_events!r}")

    @property
    def seq(self) -> int:
        """The number of the latest change (0 before any)."""
        with self._lock:
            return self._first + len(self._log) - 1

    def __len__(self) -> int:
        """Blocks held."""
        with self._lock:
            return len(self._held)

    def stored(self, block_hash: int) -> None:
        """A block with this chained hash entered the cache's hash index."""
        key = block_hash & MASK64
        with self._lock:
            self._held.add(key)
            self._append(key)

    def removed(self, block_hash: int) -> None:
        """The block with this chained hash left the index (its block was reused)."""
        key = block_hash & MASK64
        with self._lock:
            self._held.discard(key)
            self._append(key)

    def _append(self, key: int) -> None:
        self._log.append(key)
        if len(self._log) > self.max_events:
            self._log.popleft()
            self._first += 1

    def since(self, instance: int, seq: int) -> CacheReport:
        """What changed after change ``seq`` of journal ``instance`` (a reader's cursor; (0, 0)
        for a reader that has seen nothing): the net changes, or a snapshot when the cursor is
        not this journal's or the log no longer reaches back to it."""
        with self._lock:
            last = self._first + len(self._log) - 1
            if instance != self.instance or not self._first - 1 <= seq <= last:
                return CacheReport(self.instance, last, True, tuple(sorted(self._held)))
            touched = set(islice(self._log, seq - self._first + 1, None))
            stored = tuple(sorted(h for h in touched if h in self._held))
            removed = tuple(sorted(h for h in touched if h not in self._held))
            return CacheReport(self.instance, last, False, stored, removed)
