"""The router's memory of which prompt blocks each worker holds in its prefix cache.

A worker's prefix cache keys each full block of a prompt by a hash chained over the blocks before
it (nxdi_common.block_manager.chain_hash), so a prompt's cached prefix is its leading blocks
whose chained hashes the worker holds. The router does not ask the workers (that would be a
round trip per request, or a stream of cache events); it remembers the chains it has sent to
each worker, most recently used last, and forgets the oldest past the worker's cache size, as
the worker's own least-recently-used eviction would. Approximate, as vLLM's production-stack
and llm-d's approximate prefix-cache scorers are: a worker restarted or under memory pressure
may have dropped blocks the index still lists, and the cost of such a miss is one prefill.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from nxdi_common.block_manager import chain_hash

# Blocks an index keeps for a worker that does not report its cache size: the prefill worker's
# default --prefix-cache-blocks.
DEFAULT_CAPACITY_BLOCKS = 1024


def block_hashes(prompt_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of the prompt's full blocks of ``block_size`` tokens, in order."""
    hashes: list[int] = []
    parent = None
    for start in range(0, len(prompt_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, prompt_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """Per worker address, the block hashes sent to it, least recently used first."""

    def __init__(self):
        self._held: dict[str, OrderedDict[int, None]] = {}

    def matched_blocks(self, address: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` the worker is believed to hold."""
        held = self._held.get(address)
        if not held:
            return 0
        count = 0
        for h in hashes:
            if h not in held:
                break
            count += 1
        return count

    def record(self, address: str, hashes: Sequence[int], capacity_blocks: int) -> None:
        """The worker now holds ``hashes`` (just used); keep at most ``capacity_blocks`` of its
        blocks, forgetting the least recently used. A prefix's head is marked most recent and
        its deepest block least, so a full index drops tails first, as the worker's cache
        evicts them (its head is shared by more prompts than its tail)."""
        held = self._held.setdefault(address, OrderedDict())
        for h in reversed(hashes):
            held[h] = None
            held.move_to_end(h)
        while len(held) > max(capacity_blocks, 0):
            held.popitem(last=False)

    def forget(self, keep: set[str]) -> None:
        """Drop the workers whose addresses are not in ``keep`` (gone from discovery)."""
        for address in [a for a in self._held if a not in keep]:
            del self._held[address]

    def blocks_held(self, address: str) -> int:
        return len(self._held.get(address, ()))
