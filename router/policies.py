"""Routing policies: which decode worker and which prefill candidates, best first.

Plain classes over :class:`WorkerState` snapshots, no I/O. Every policy ranks only healthy
workers and returns the full ranking (the dispatcher tries decode workers in that order, and the
decode worker tries prefill candidates in that order)::

    rank_decode(prompt_ids, workers, salt="")  -> list[WorkerState]
    rank_prefill(prompt_ids, workers, salt="") -> list[WorkerState]
    note_routed(prompt_ids, decode, prefill, salt="")  # it went there (prefill None: local)
(salt: the request's cache salt, which roots the prompt's block hashes as the workers root
them)
"""
from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from nxdi_common.cache_journal import CacheReport
from router.prefix_index import DEFAULT_CAPACITY_BLOCKS, PrefixIndex, ReportedCache, block_hashes

PREFILL, DECODE = "prefill", "decode"
ROLES = (PREFILL, DECODE)
AFFINITY_MAX_TOKENS = 256  # prefix-affinity key: at most this many leading prompt tokens,
AFFINITY_BLOCK_TOKENS = 16  # rounded down to a multiple of this (KV block granularity)


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load report (the WorkerLoad message, minus the protobuf)."""

    queued_prompt_tokens: int = 0
    queued_requests: int = 0
    running_sequences: int = 0
    max_running_sequences: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_block_size: int = 0
    open_transfers: int = 0
    reported_at_unix_ns: int = 0
    running_prompt_tokens: int = 0
    role: str = ""  # PREFILL or DECODE, as the worker reported itself
    fingerprint: object = field(default=None, compare=False)  # opaque; router.convert reads it
    prefill_tokens_per_s: float = 0.0  # measured; 0 until the worker has prefilled something
    # decode workers with a local prefill thread: its rate with the core to itself (0: none)
    whole_core_prefill_tokens_per_s: float = 0.0
    # how long it could hold its steps now within its TPOT target (None: nothing limits it)
    hold_budget_s: float | None = None
    # when the router took this snapshot (time.monotonic_ns(); 0: unknown): the tokens ahead
    # are counted down from it at prefill_tokens_per_s, on the router's own clock
    received_ns: int = field(default=0, compare=False)
    # the prefix cache's changes since the poll's cursor (None: not asked, or not reported);
    # the registry applies it to WorkerState.cache and drops it from the kept load
    prefix_cache: CacheReport | None = field(default=None, compare=False, repr=False)


@dataclass
class WorkerState:
    """What the router knows about one worker address."""

    address: str
    role: str
    healthy: bool = False
    load: WorkerLoad | None = None
    reason: str = "not polled yet"  # why it is unhealthy (empty when healthy)
    cache: ReportedCache | None = None  # its prefix cache as it reports it (None: it does not)

    @property
    def current_load(self) -> WorkerLoad:
        return self.load if self.load is not None else WorkerLoad()


def _healthy(workers: Sequence[WorkerState]) -> list[WorkerState]:
    return sorted((w for w in workers if w.healthy), key=lambda w: w.address)


def decode_load_key(w: WorkerState) -> tuple:
    """Most free KV blocks first, then the fewest running plus queued sequences."""
    load = w.current_load
    return -load.kv_blocks_free, load.running_sequences + load.queued_requests, w.address


def prefill_load_key(prompt_len: int, workers: Sequence[WorkerState], cached=None):
    """The sort key of prefill workers for a prompt of ``prompt_len`` tokens: the soonest to
    have prefilled it first when every one of them reports a measured rate (prefill_eta_s: a
    faster worker with more ahead can finish first, as in a pool of mixed instance types), else
    the fewest prompt tokens ahead (queued or being encoded; seconds and tokens do not compare);
    then the fewest KV transfers in progress. ``cached(worker)``: the prompt's leading tokens
    that worker holds, which it need not compute (None: none anywhere)."""
    now = time.monotonic_ns()
    timed = all(w.current_load.prefill_tokens_per_s > 0 for w in workers)

    def key(w: WorkerState) -> tuple:
        load = w.current_load
        todo = prompt_len - (cached(w) if cached is not None else 0)
        first = (prefill_eta_s(load, todo, now) if timed else tokens_ahead_at(load, now) + todo)
        return first, load.open_transfers, w.address
    return key


def prompt_tokens_ahead(w: WorkerState, now_ns: int | None = None) -> float:
    """Prompt tokens a worker has to prefill before a prompt sent to it now (a prefill worker:
    its queue and the rest of its running batch; a decode worker: the rest of its local
    prefills): the reported ones less what it has prefilled since the report at its reported
    rate (the poll is up to a refresh interval old, and a long prompt's batch can end in it)."""
    return tokens_ahead_at(w.current_load, time.monotonic_ns() if now_ns is None else now_ns)


def tokens_ahead_at(load: WorkerLoad, now_ns: int) -> float:
    """The load's prompt tokens ahead, counted down to ``now_ns`` (see prompt_tokens_ahead)."""
    ahead = load.queued_prompt_tokens + load.running_prompt_tokens
    if ahead == 0 or load.prefill_tokens_per_s <= 0 or load.received_ns <= 0:
        return ahead
    age_s = max(now_ns - load.received_ns, 0) / 1e9
    return max(ahead - load.prefill_tokens_per_s * age_s, 0.0)


def prefill_eta_s(load: WorkerLoad, prompt_len: int, now_ns: int) -> float | None:
    """Seconds until a worker would have prefilled a prompt of ``prompt_len`` tokens sent to it
    now, at its measured rate; None before it has measured one."""
    if load.prefill_tokens_per_s <= 0:
        return None
    return (tokens_ahead_at(load, now_ns) + prompt_len) / load.prefill_tokens_per_s


@dataclass(frozen=True)
class LocalPrefillRule:
    """Conditional disaggregation: a prompt of at most ``max_tokens`` tokens is prefilled by its
    decode worker itself (no prefill candidates are sent) when every prefill candidate has at
    least ``queue_tokens`` prompt tokens ahead of it, and the decode worker would not finish it
    later than the soonest candidate. A short prompt then waits behind one decode step instead
    of behind the long prompts the prefill pool is busy with; while the pool keeps up, every
    prompt still goes to it. ``max_tokens`` 0 turns the rule off. Prompts of at most
    ``always_tokens`` are prefilled locally whatever the pool's queue (as Dynamo's
    max_local_prefill_length): cheap for the decode worker, and off the prefill worker's queue.

    When each side is later: the tokens ahead of the prompt (decode worker: the rest of its
    local prefills) plus the prompt, at the side's measured prefill rate (prefill_eta_s). A
    decode worker prefills in pieces between its decode steps, and with a TPOT target defers
    pieces while they would push a running sequence over it, so under load its rate is a
    fraction of a prefill worker's; without the comparison a long prompt went local behind
    another one while the prefill worker was about to be idle (a 7-8 s TTFT in session 19's
    runs where the prefill worker would have taken ~3 s). A side that has not measured a rate
    yet does not veto: the queue rule alone decides, as before; except a decode worker that
    already has local prompts to prefill and no rate yet, which gets no more: its first piece has
    not finished (its rate is measured from finished pieces), so nothing says its prefill moves
    at all. In a 4 req/s run on `mixed` (session 58) a decode worker whose prefill thread got no
    core beside back-to-back steps reported no rate for 50 s and took 30 000 prompt tokens of
    local prefills meanwhile: their blocks filled its cache and the run's throughput fell to a
    tenth while the prefill worker stood idle.

    With ``hold_ttft_s`` (0: off), a prompt this rule leaves to the prefill pool goes to the
    decode worker instead, to be prefilled with its decode steps held
    (DecodeRequest.hold_steps_for_prefill), when every candidate would finish it later than
    ``hold_ttft_s`` and the decode worker, at its whole core's rate
    (whole_core_prefill_tokens_per_s, its local prompts ahead first), would finish it within
    that and sooner: the second core takes a long prompt the busy prefill worker would make
    late, at the cost of one long gap in each running stream (BENCHMARKS.md, issue 4, session
    69: two long prompts a few seconds apart are what a one-core prefill pool misses). The
    steps are held only as long as the decode worker's reported hold_budget_s, the stall its
    running streams can take within their TPOT target (held prompts chained in a burst of
    long ones made six streams that had met their TTFT miss their TPOT in session 69); past
    it the prompt goes on at the worker's paced rate (held_eta_s)."""

    max_tokens: int = 0
    queue_tokens: int = 0
    always_tokens: int = 0
    hold_ttft_s: float = 0.0

    def __post_init__(self):
        for name in ("max_tokens", "queue_tokens", "always_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"local prefill {name} must be an integer >= 0, got {value!r}")
        if not (isinstance(self.hold_ttft_s, (int, float)) and self.hold_ttft_s >= 0):
            raise ValueError(f"local prefill hold_ttft_s must be a number of seconds >= 0 "
                             f"(0: off), got {self.hold_ttft_s!r}")

    def prefill_locally(self, prompt_len: int, prefills: Sequence[WorkerState],
                        decode: WorkerState | None = None, now_ns: int | None = None) -> bool:
        return self.choose(prompt_len, prefills, decode, now_ns).local

    def choose(self, prompt_len: int, prefills: Sequence[WorkerState],
               decode: WorkerState | None = None, now_ns: int | None = None) -> LocalChoice:
        """prefill_locally's answer, with the two sides' estimated finish times where the rule
        weighed them (the router's request line shows them: a local prompt whose first token
        came far later than its estimate says the decode worker's reported rate was wrong)."""
        if 0 < prompt_len <= self.always_tokens:
            return LocalChoice(True)
        now = time.monotonic_ns() if now_ns is None else now_ns
        choice = self._shared(prompt_len, prefills, decode, now)
        if choice.local or not self.hold_ttft_s or decode is None or prompt_len <= 0:
            return choice
        return self._held(prompt_len, prefills, decode, now)

    def _shared(self, prompt_len: int, prefills: Sequence[WorkerState],
                decode: WorkerState | None, now: int) -> LocalChoice:
        """The rule for prompts the decode worker prefills beside its steps (class doc)."""
        if not (0 < prompt_len <= self.max_tokens
                and all(prompt_tokens_ahead(w, now) >= self.queue_tokens for w in prefills)):
            return LocalChoice(False)
        local = prefill_eta_s(decode.current_load, prompt_len, now) if decode else None
        if local is None and decode is not None and tokens_ahead_at(decode.current_load, now):
            return LocalChoice(False)  # local prompts ahead and no rate yet: maybe not moving
        remote = _soonest(prefills, prompt_len, now)
        return LocalChoice(local is None or remote is None or local <= remote, local, remote)

    def _held(self, prompt_len: int, prefills: Sequence[WorkerState], decode: WorkerState,
              now: int) -> LocalChoice:
        """The rule for prompts the decode worker prefills with its steps held (hold_ttft_s)."""
        load = decode.current_load
        remote = _soonest(prefills, prompt_len, now)
        if load.whole_core_prefill_tokens_per_s <= 0 or remote is None \
                or remote <= self.hold_ttft_s:
            return LocalChoice(False, None, remote)
        local = held_eta_s(load, tokens_ahead_at(load, now) + prompt_len)
        held = local is not None and local <= self.hold_ttft_s and local < remote
        return LocalChoice(held, local, remote, hold_steps=held)


def held_eta_s(load: WorkerLoad, tokens: int) -> float | None:
    """Seconds a decode worker takes to prefill ``tokens`` with its steps held: at its whole
    core's rate while its hold_budget_s lasts, then at its paced local rate
    (prefill_tokens_per_s), as its engine steps again once the streams' TPOT budget is spent;
    None where that rate is needed and not known."""
    whole = load.whole_core_prefill_tokens_per_s
    if load.hold_budget_s is None:
        return tokens / whole
    budget = max(load.hold_budget_s, 0.0)
    if tokens <= budget * whole:
        return tokens / whole
    if load.prefill_tokens_per_s <= 0:
        return None
    return budget + (tokens - budget * whole) / load.prefill_tokens_per_s


def _soonest(prefills: Sequence[WorkerState], prompt_len: int, now: int) -> float | None:
    """The soonest prefill candidate's estimated seconds to finish the prompt (None: no
    candidate has measured a rate)."""
    return min((eta for w in prefills
                if (eta := prefill_eta_s(w.current_load, prompt_len, now)) is not None),
               default=None)


@dataclass(frozen=True)
class LocalChoice:
    """LocalPrefillRule's answer: ``local``, and the estimated seconds to finish the prompt
    on the decode worker and on the soonest prefill candidate (None: not weighed, or no rate
    measured on that side)."""

    local: bool
    local_eta_s: float | None = None
    remote_eta_s: float | None = None
    hold_steps: bool = False  # local, with the decode steps held (LocalPrefillRule.hold_ttft_s)

    def note(self) -> str:
        """The estimates as the request line shows them ("" when neither was weighed)."""
        if self.local_eta_s is None and self.remote_eta_s is None:
            return ""
        local, remote = ("-" if eta is None else f"{eta:.2f}s"
                         for eta in (self.local_eta_s, self.remote_eta_s))
        return f"local:{local},prefill:{remote}" + (",held" if self.hold_steps else "")


class _Policy:
    """What every policy does with a routed request by default: nothing."""

    def note_routed(self, prompt_ids: Sequence[int], decode: WorkerState,
                    prefill: WorkerState | None, salt: str = "") -> None:
        pass

    def expected_cached_tokens(self, prompt_ids: Sequence[int], decode: WorkerState,
                               salt: str = "") -> int | None:
        """Prompt tokens this policy believes ``decode``'s prefix cache holds (None: it keeps
        no such view)."""
        return None

    def forget_workers(self, addresses: set[str]) -> None:
        """Drop whatever is kept about workers not in ``addresses`` (gone from discovery)."""


class LeastLoaded(_Policy):
    """Rank by the load keys above."""

    name = "least-loaded"

    def rank_decode(self, prompt_ids: Sequence[int], workers: Sequence[WorkerState],
                    salt: str = ""):
        return sorted(_healthy(workers), key=decode_load_key)

    def rank_prefill(self, prompt_ids: Sequence[int], workers: Sequence[WorkerState],
                     salt: str = ""):
        healthy = _healthy(workers)
        return sorted(healthy, key=prefill_load_key(len(prompt_ids), healthy))


class RoundRobin(_Policy):
    """Rotate through the healthy workers (sorted by address), one step per request and role."""

    name = "round-robin"

    def __init__(self):
        self._next = {PREFILL: 0, DECODE: 0}

    def _rotate(self, role: str, workers: Sequence[WorkerState]) -> list[WorkerState]:
        ranked = _healthy(workers)
        if not ranked:
            return []
        start = self._next[role] % len(ranked)
        self._next[role] += 1
        return ranked[start:] + ranked[:start]

    def rank_decode(self, prompt_ids: Sequence[int], workers: Sequence[WorkerState],
                    salt: str = ""):
        return self._rotate(DECODE, workers)

    def rank_prefill(self, prompt_ids: Sequence[int], workers: Sequence[WorkerState],
                     salt: str = ""):
        return self._rotate(PREFILL, workers)


def affinity_key(prompt_ids: Sequence[int]) -> bytes:
    """Digest of the first block-aligned tokens (min(len, 256) rounded down to a multiple of
    16); b"" when the prompt is shorter than one block (no prefix worth keeping together)."""
    n = min(len(prompt_ids), AFFINITY_MAX_TOKENS) // AFFINITY_BLOCK_TOKENS * AFFINITY_BLOCK_TOKENS
    if n == 0:
        return b""
    data = struct.pack(f"<{n}I", *prompt_ids[:n])
    return hashlib.blake2b(data, digest_size=16).digest()


def rendezvous_order(key: bytes, workers: Sequence[WorkerState]) -> list[WorkerState]:
    """Highest-random-weight order: each worker's score is a hash of (key, address), so adding
    or removing a worker only moves the keys that scored highest on it."""
    def score(w: WorkerState) -> bytes:
        return hashlib.blake2b(key + w.address.encode(), digest_size=8).digest()
    return sorted(workers, key=score, reverse=True)


class PrefixAffinity(_Policy):
    """Requests sharing a prefix go to the same workers (so their prefix caches hit).

    The rendezvous winner over all known workers is taken first when it is healthy and (for
    decode) has free KV blocks; the rest follow least-loaded. When the winner is unhealthy or
    saturated, or the prompt is shorter than one block, the ranking is plain least-loaded."""

    name = "prefix-affinity"

    def _rank(self, prompt_ids, workers, load_key, saturated) -> list[WorkerState]:
        ranked = sorted(_healthy(workers), key=load_key)
        key = affinity_key(prompt_ids)
        if not key or not workers:
            return ranked
        winner = rendezvous_order(key, workers)[0]
        if not winner.healthy or saturated(winner):
            return ranked
        return [winner] + [w for w in ranked if w is not winner]

    def rank_decode(self, prompt_ids: Sequence[int], workers: Sequence[WorkerState],
                    salt: str = ""):
        return self._rank(prompt_ids, workers, decode_load_key,
                          lambda w: w.current_load.kv_blocks_free == 0)

    def rank_prefill(self, prompt_ids: Sequence[int], workers: Sequence[WorkerState],
                     salt: str = ""):
        return self._rank(prompt_ids, workers,
                          prefill_load_key(len(prompt_ids), _healthy(workers)), lambda w: False)


class CacheAware(_Policy):
    """Prefix-cache-aware and load-aware: each worker is ranked by the work a request would cost
    it, counting the prompt blocks it holds already (router.prefix_index: what its load reports
    say its prefix cache holds, and the chains of block hashes this router has sent it since) as
    work it need not do.

    Decode workers, in KV blocks: ``(1 + overlap_weight) * uncached + used``, where ``uncached``
    is the prompt's full blocks the worker does not hold (it must receive or compute them, and
    they become new blocks in its pool) and ``used`` is the blocks its running sequences hold
    (the load report's kv_blocks_used). A request goes where its prefix is unless that worker
    holds ``(1 + overlap_weight)`` times the prefix's blocks more than another: a hot prefix
    (a long system prompt every request shares) spreads over every worker, each of which then
    holds it, where prefix-affinity sends it all to one; a chat's next turn goes back to the
    worker holding its history, where least-loaded sends it wherever there is room. (Dynamo's
    KV router weighs the same two counts.) Workers without a free block go last.

    Prefill workers, in prompt tokens: the tokens ahead of the prompt plus the prompt's tokens
    the worker does not hold, divided by its measured rate when every candidate reports one
    (prefill_load_key with the cached tokens taken off).

    ``overlap_weight`` 0 counts a cached block as saving only its room in the pool; larger
    values trade more load for cache hits."""

    name = "cache-aware"

    def __init__(self, overlap_weight: float = 1.0):
        if isinstance(overlap_weight, bool) or not isinstance(overlap_weight, (int, float)) \
                or not overlap_weight >= 0:
            raise ValueError(f"cache overlap weight must be a number >= 0, got {overlap_weight!r}")
        self.overlap_weight = float(overlap_weight)
        self.index = PrefixIndex()
        self._hashes: tuple[Sequence[int] | None, int, str, list[int]] = (None, 0, "", [])

    def hashes(self, prompt_ids: Sequence[int], block_size: int, salt: str = "") -> list[int]:
        """block_hashes of the prompt, remembered for the request being routed (ranking both
        roles and noting the route hash one prompt three times)."""
        ids, size, key, hashes = self._hashes
        if ids is not prompt_ids or size != block_size or key != salt:
            hashes = block_hashes(prompt_ids, block_size, salt)
            self._hashes = (prompt_ids, block_size, salt, hashes)
        return hashes

    def matched_blocks(self, prompt_ids: Sequence[int], w: WorkerState, salt: str = "") -> int:
        """The prompt's leading blocks (of w's size) the worker holds: by its own report, and
        by what this router sent it since (router.prefix_index)."""
        return self.index.matched_blocks(
            w.address, self.hashes(prompt_ids, block_size_of(w), salt), w.cache)

    def rank_decode(self, prompt_ids: Sequence[int], workers: Sequence[WorkerState],
                    salt: str = ""):
        def key(w: WorkerState) -> tuple:
            load = w.current_load
            uncached = len(prompt_ids) // block_size_of(w) - self.matched_blocks(prompt_ids, w,
                                                                                 salt)
            cost = (1 + self.overlap_weight) * uncached + load.kv_blocks_used
            return (load.kv_blocks_free == 0, cost,
                    load.running_sequences + load.queued_requests, w.address)
        return sorted(_healthy(workers), key=key)

    def rank_prefill(self, prompt_ids: Sequence[int], workers: Sequence[WorkerState],
                     salt: str = ""):
        healthy = _healthy(workers)
        return sorted(healthy, key=prefill_load_key(
            len(prompt_ids), healthy,
            cached=lambda w: self.matched_blocks(prompt_ids, w, salt) * block_size_of(w)))

    def note_routed(self, prompt_ids: Sequence[int], decode: WorkerState,
                    prefill: WorkerState | None, salt: str = "") -> None:
        for w in (decode, prefill):
            if w is not None:
                load = w.current_load
                capacity = load.kv_blocks_used + load.kv_blocks_free or DEFAULT_CAPACITY_BLOCKS
                self.index.record(w.address, self.hashes(prompt_ids, block_size_of(w), salt),
                                  capacity)

    def expected_cached_tokens(self, prompt_ids: Sequence[int], decode: WorkerState,
                               salt: str = "") -> int | None:
        """Whole blocks the view holds, short of the prompt's last token (a worker computes
        that one whatever it holds)."""
        size = block_size_of(decode)
        return min(self.matched_blocks(prompt_ids, decode, salt),
                   (len(prompt_ids) - 1) // size) * size

    def forget_workers(self, addresses: set[str]) -> None:
        self.index.forget(addresses)


def block_size_of(w: WorkerState) -> int:
    """The worker's KV block size as it reports it (16, the default, before it has)."""
    return w.current_load.kv_block_size or AFFINITY_BLOCK_TOKENS


POLICIES = {p.name: p for p in (CacheAware, LeastLoaded, RoundRobin, PrefixAffinity)}


def make_policy(name: str, **options):
    """A fresh policy instance by its command-line name; ``options`` for CacheAware
    (overlap_weight)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}") from None
    return cls(**options) if cls is CacheAware else cls()
