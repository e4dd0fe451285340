"""The router's memory of which prompt blocks each worker holds in its prefix cache.

A worker's prefix cache keys each full block of a prompt by a hash chained over the blocks before
it (nxdi_common.block_manager.chain_hash), so a prompt's cached prefix is its leading blocks
whose chained hashes the worker holds. Two sources:

* The worker's own account (:class:`ReportedCache`): each load poll asks for its prefix-cache
  journal's changes since the last one (nxdi_common.cache_journal), so the router knows what the
  worker stored and what it evicted, and that a restarted worker holds nothing. Exact up to one
  poll interval, as Dynamo's KV-event router and llm-d's precise prefix-cache scorer are.
* What this router sent it (:class:`PrefixIndex`): the chains routed to each worker, most
  recently used last, the oldest forgotten past the worker's cache size, as its own
  least-recently-used eviction would. It covers the time between a route and the next report;
  for a worker that reports, a route counts only until a report asked for after it (which then
  says whether the worker kept the blocks). For a worker that does not report (a router run
  with --no-cache-reports, or a worker of an older version) it is the only source, and
  approximate: a restarted worker or one under memory pressure may have dropped blocks it
  lists; the cost of such a miss is one prefill.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from nxdi_common.block_manager import chain_hash, salt_root
from nxdi_common.cache_journal import MASK64, CacheReport

# Blocks an index keeps for a worker that does not report its cache size: the prefill worker's
# default --prefix-cache-blocks.
DEFAULT_CAPACITY_BLOCKS = 1024


def block_hashes(prompt_ids: Sequence[int], block_size: int, salt: str = "") -> list[int]:
    """The chained hashes of the prompt's full blocks of ``block_size`` tokens, in order (the
    chain rooted at the request's cache salt, as the workers root it)."""
    hashes: list[int] = []
    parent = salt_root(salt)
    for start in range(0, len(prompt_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, prompt_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


@dataclass
class ReportedCache:
    """The blocks a worker says its prefix cache holds (low 64 bits of their chained hashes),
    kept current by applying its load reports' prefix_cache in turn."""

    instance: int = 0  # the worker's journal (0: nothing applied yet)
    seq: int = 0  # the journal's last change applied
    blocks: set[int] = field(default_factory=set)
    asked_ns: int = 0  # time.monotonic_ns() when the report applied last was asked for

    @property
    def cursor(self) -> tuple[int, int]:
        """(instance, seq) to ask the worker's next report from."""
        return self.instance, self.seq

    def apply(self, report: CacheReport, asked_ns: int) -> None:
        """Bring the view up to ``report``, which was asked for at ``asked_ns``."""
        if report.snapshot or report.instance != self.instance:
            self.blocks = set(report.stored)
        else:
            self.blocks.difference_update(report.removed)
            self.blocks.update(report.stored)
        self.instance, self.seq, self.asked_ns = report.instance, report.seq, asked_ns

    def holds(self, block_hash: int) -> bool:
        return block_hash & MASK64 in self.blocks


class PrefixIndex:
    """Per worker address, the block hashes sent to it (with when), least recently used first."""

    def __init__(self):
        self._held: dict[str, OrderedDict[int, int]] = {}

    def matched_blocks(self, address: str, hashes: Sequence[int],
                       reported: ReportedCache | None = None) -> int:
        """How many leading blocks of ``hashes`` the worker is believed to hold: ones its report
        lists, or (only those sent after that report was asked for, when it reports) ones this
        router sent it."""
        held = self._held.get(address) or {}
        after = reported.asked_ns if reported is not None else -1
        count = 0
        for h in hashes:
            if reported is None or not reported.holds(h):
                sent = held.get(h)
                if sent is None or sent <= after:
                    break
            count += 1
        return count

    def record(self, address: str, hashes: Sequence[int], capacity_blocks: int) -> None:
        """The worker now holds ``hashes`` (just used); keep at most ``capacity_blocks`` of its
        blocks, forgetting the least recently used. A prefix's head is marked most recent and
        its deepest block least, so a full index drops tails first, as the worker's cache
        evicts them (its head is shared by more prompts than its tail)."""
        held = self._held.setdefault(address, OrderedDict())
        now = time.monotonic_ns()
        for h in reversed(hashes):
            held[h] = now
            held.move_to_end(h)
        while len(held) > max(capacity_blocks, 0):
            held.popitem(last=False)

    def forget(self, keep: set[str]) -> None:
        """Drop the workers whose addresses are not in ``keep`` (gone from discovery)."""
        for address in [a for a in self._held if a not in keep]:
            del self._held[address]

    def blocks_held(self, address: str) -> int:
        return len(self._held.get(address, ()))
