"""Continuous batching for token generation: which sequences run in the next TKG step.

A sequence whose prompt KV is in place waits in ``ready`` until a batch slot (a seq_id) is free,
then joins between two steps; finished or cancelled sequences leave and free their slot. The
running batch never waits for a new sequence's prefill."""
from __future__ import annotations

from collections import deque

from decode_service.sequence import Sequence


class DecodeScheduler:
    """Slots 0..max_batch_size-1 and the sequences holding them."""

    def __init__(self, max_batch_size: int):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.ready: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self._free_slots = list(range(max_batch_size - 1, -1, -1))  # pop() gives the lowest

    def add_ready(self, seq: Sequence) -> None:
        self.ready.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or cancelled), wherever it is."""
        if seq.slot >= 0 and self.running.get(seq.slot) is seq:
            del self.running[seq.slot]
            self._free_slots.append(seq.slot)
            self._free_slots.sort(reverse=True)
            seq.slot = -1
        elif seq in self.ready:
            self.ready.remove(seq)

    def next_batch(self) -> list[Sequence]:
        """Join waiting sequences into free slots, then return the running batch by slot."""
        while self.ready and self._free_slots:
            seq = self.ready.popleft()
            seq.slot = self._free_slots.pop()
            self.running[seq.slot] = seq
        return [self.running[s] for s in sorted(self.running)]

    @property
    def num_waiting(self) -> int:
        return len(self.ready)

    @property
    def num_running(self) -> int:
        return len(self.running)
