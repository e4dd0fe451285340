"""Continuous batching for token generation: which sequences run in the next TKG step.

A sequence whose prompt KV is in place waits in ``ready`` until a batch slot (a seq_id) is free,
then joins between two steps (the lowest priority value first, then in the order they became
ready); finished or cancelled sequences leave and free their slot. The running batch never waits
for a new sequence's prefill, and a running sequence keeps its slot whatever waits."""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from decode_service.sequence import Sequence
from nxdi_common.bucketing import select_bucket


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
            seq = min(self.ready, key=lambda s: s.priority)  # the first of the best priority
            self.ready.remove(seq)
            seq.slot = self._free_slots.pop()
            self.running[seq.slot] = seq
        return [self.running[s] for s in sorted(self.running)]

    @property
    def num_waiting(self) -> int:
        return len(self.ready)

    @property
    def num_running(self) -> int:
        return len(self.running)


def split_by_length(needed: list[int], length_buckets: list[int], batch_buckets: list[int],
                    call_cost_row_tokens: int) -> list[list[int]]:
    """Rows of one decode step, as one or two TKG calls (lists of row indices).

    A call attends every row over its longest row's length bucket, so one long sequence makes
    every short one pay for its length. Cost model, in row-tokens attended: (batch bucket) x
    (length bucket) per call plus ``call_cost_row_tokens`` per extra call (the fixed cost of a
    call: reading the weights once more). Returns the cheaper of one call and the best split
    of the rows, sorted by ``needed`` (cache length), into a short and a long group."""
    order = sorted(range(len(needed)), key=lambda i: needed[i])
    longest = select_bucket(needed[order[-1]], length_buckets)
    best_cost = select_bucket(len(order), batch_buckets) * longest
    best_k = 0
    for k in range(1, len(order)):
        short = select_bucket(needed[order[k - 1]], length_buckets)
        if short == longest:
            break
        cost = (select_bucket(k, batch_buckets) * short
                + select_bucket(len(order) - k, batch_buckets) * longest + call_cost_row_tokens)
        if cost < best_cost:
            best_cost, best_k = cost, k
    return [order] if best_k == 0 else [order[:best_k], order[best_k:]]


def piece_costs_a_tpot(running: Iterable[tuple[float, int, int]], piece_s: float, step_s: float,
                       target_s: float) -> bool:
    """Whether running a prefill piece now (delaying every running sequence's next token by
    ``piece_s``) would make some sequence miss a time-per-output-token target it would meet
    without it (stall_budget_s: the piece is longer than the budget)."""
    budget = stall_budget_s(running, step_s, target_s)
    return budget is not None and piece_s > budget


def stall_budget_s(running: Iterable[tuple[float, int, int]], step_s: float, target_s: float,
                   share: float = 1.0) -> float | None:
    """The longest stall every running sequence can take now (all its tokens delayed by it)
    and still keep its time per output token within ``share`` of ``target_s``; None when no
    sequence limits it.

    ``running``: (seconds since the sequence's first token, tokens it has, tokens it may have:
    max_tokens) per sequence. A sequence's TPOT is (last token's time - first's) / (tokens - 1);
    projected with its remaining tokens at ``step_s`` each (to max_tokens: a sequence that stops
    earlier at EOS spreads the stall over fewer tokens). A sequence that misses the target even
    without a stall does not limit it (nothing saves it), nor does one with no gap left."""
    budget = None
    for elapsed, have, total in running:
        if have < 1 or total < 2 or have >= total:
            continue
        projected = elapsed + (total - have) * step_s
        if projected > target_s * (total - 1):
            continue
        left = share * target_s * (total - 1) - projected
        budget = left if budget is None else min(budget, left)
    return budget
