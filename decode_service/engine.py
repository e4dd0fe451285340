"""The decode engine: one thread that owns the model and runs local prefills and TKG steps.

The asyncio side (gRPC handlers, KV pulls) admits sequences, writes pulled KV into their reserved
blocks, and posts commands; the engine thread turns commands into batch changes between steps:

    loop: apply commands -> one piece of a local prefill and a TKG step over the running batch,
          in one model call when there are both (forward_mixed) -> else the one there is

A local prefill runs in pieces of the model's prefill_chunk_size tokens, one piece a step, so a
long prompt delays the running sequences' next token by one piece, not by its whole prefill.
The step's decode rows ride in the piece's call (the mixed sub-model): the weights are read once
for both, where a piece then a TKG call read them twice. A piece with no running batch, or a
whole prompt shorter than a piece (context encoding pads it less), is a call of its own (the
first by context encoding, the rest by the chunked-prefill sub-model). Which
waiting local prefill goes next: one whose rest fits in one piece goes before any longer one (a
short chat prompt does not wait behind the rest of a long one), the one with the fewest tokens
left first; longer ones go first come first served, the one begun first. Shortest remaining first
among long prompts too let each newer, slightly shorter long prompt overtake a begun one (which
could wait indefinitely behind a stream of them); in a burst of five long prompts (BENCHMARKS.md,
session 14) their TTFTs were 2.2-6.1 s that way and 1.8-4.0 s this way. Positions
already in the cache (a shared prefix) are not computed again. Without prefill_chunk_size the
prompt is one context-encoding call.

With a TPOT target (``EngineConfig.tpot_target_s``, the worker's --tpot-target-ms) a piece waits
while it would make a running sequence miss that target: each piece delays every running
sequence's next token, and a sequence with few tokens to share the delay (a long prompt's short
answer) has little room for it, while a waiting prompt's first token is usually within its own
budget. Before each piece the engine projects every running sequence's time per output token
from its tokens so far, its remaining max_tokens at the measured decode step time, with and
without the measured cost of a piece (scheduler.piece_costs_a_tpot); while some sequence would
meet the target without the piece and miss it with, the step runs without the piece
(``nxdi_deferred_pieces_total``). Sequences that miss either way hold nothing back. The step
time is measured on steps without a piece; while pieces run back to back the running batch may
grow, so when that measurement is older than STEP_REMEASURE_S one step runs without a piece to
measure it again.

With an ITL target (``EngineConfig.itl_target_s``, the worker's --itl-target-ms) and a running
batch, a piece is sized so that the step it rides in stays within the target: the largest of the
mixed sub-model's chunk lengths (NeuronConfig.mixed_chunk_buckets) whose measured cost (the
seconds a piece of that length adds to a step), added to the measured decode step, fits; the
smallest when none fits, so a local prefill always advances. A fixed 256-token piece stalls
every running stream for ~0.35 s on one core of the Zen 4 VM (p99 ITL 0.4-0.5 s at 1 req/s,
BENCHMARKS.md session 20) where a step alone takes ~20 ms: the target trades local prefill
throughput (a piece shares each step with the batch) for even token gaps. With no running batch a
piece is a full prefill_chunk_size: there is no stream to stall. With a TTFT target as well
(``EngineConfig.ttft_target_s``, --ttft-target-ms) a piece is made larger where the waiting local
prefills need it: the smallest length from the ITL-sized one up whose rate (its tokens per step
with it) would finish every waiting prompt, in the order they run, within the target of its
arrival; the largest when none would. Without it, at 0.5 req/s on `mixed` long local prompts
missed a 4 s TTFT in 16-token pieces while the running streams' TPOT had 70% to spare.

With local prefill on its own thread (``EngineConfig.local_prefill_nice``, background_prefill)
the ITL target paces the steps instead (StepPacer: the time between them is the prefill's), and
a TTFT target stretches the paced gap where the local prompts need a larger share of the core to
finish within it, at most ``EngineConfig.pace_stretch`` (--pace-stretch, default 1.5) times
the ITL target or the step, whichever is longer,
and to that longest gap while a local prompt is late (_paced_gap_s). At 0.875 req/s on
`mixed` (BENCHMARKS.md, session 44) an 18 ms target alone made three short local prompts miss
a 4 s TTFT that 22 ms met; stretched for a 3.5 s target they met it, at a p99 gap of 22.6 ms
against 24.1-25.1 at 22 ms (at goodput in sweeps: 23.4-24.8 against 25.1, for a higher TTFT).
In session 61's single-rate runs at 0.875 req/s the stretched gaps were the p99 (27.1 ms against
22.0-23.2 held to the target, at equal attainment), yet a sweep held to the target lost 0.875
req/s (0.886) where one with the stretch kept it (0.932): --pace-stretch is there to choose.

A local prompt sent with ``DecodeJob.hold_steps_for_prefill`` (the router's
--local-prefill-hold-ttft-seconds: a long prompt the busy prefill pool would make late) holds
the steps instead while it waits or runs on the thread, at most HOLD_MAX_S after its arrival
(_held_s): the thread has the whole core, and each running stream sees one gap the prompt's
length rather than many stretched ones (a p99 gap counts the former once per stream). A
sequence ready to join meanwhile sends its held first token at once (its TTFT would otherwise
wait out the hold: session 69's first runs, 5-7 s for short prompts prefilled remotely). With
a TPOT target the steps are held only while every running stream can still end within it
(hold_budget_s, also in the load report for the router): in session 69's runs at 1 req/s a
burst of long prompts chained holds 5-9 s long, and six streams that had met their TTFT missed
the TPOT target by the stall alone.

With a held first token (``EngineConfig.hold_first_token``, the worker's --hold-first-token) a
prompt's first token is sent when its sequence joins the running batch, right before the step
that makes its second, instead of as soon as it is known (from the prefill worker's stream, or
at a local prefill's last piece). Sent at once, its gap to the second token holds the rest of
the KV transfer, the KV's write into the cache, the wait for the running step and a step: at 1
req/s on `mixed` the median first gap was 29 ms where the median gap was 17, and first gaps were
about half of the gaps over the p99 (BENCHMARKS.md, session 42). Held, that gap is one step, and
the time to first token grows by what it no longer holds: in session 43 the first gap's median
at 1 req/s went 30 -> 14 ms with TTFT's median unchanged, but the p99 gap at goodput stayed
25-27 ms (its tail is the steps themselves and the delivery) and the unloaded p99 fell with it.

KV blocks are taken on demand: admission reserves the prompt and its first generated token, and
before each step a running sequence whose next token's position lies past its blocks gets one
more. Reserving prompt + max_tokens up front (until 2026-11-26 the only rule, still
``EngineConfig.reserve_max_tokens``) never preempts, but a request without max_tokens reserves
up to the model's whole context: on the quickstart's 512 blocks of 16 tokens and 2048-token
context, 4 such chat requests ran and a 5th got HTTP 429 while most of the reserved blocks never
held a token. Admission leaves one free block per live sequence for that growth and admits
nothing while a preempted sequence waits. When a block is needed and none is free, the newest
running sequence of the worst priority (the highest ``priority`` value; maybe the one growing) is
preempted: its KV is copied out to host memory, its
blocks freed, and it waits (``nxdi_preemptions_total``); the first waiting one (best priority,
then oldest) is copied back
into new blocks, ahead of newer sequences, as soon as they are free with the same spare and a
batch slot is open. Its stream just pauses: the tokens are the ones it would have had (the KV is
the same bytes, a leading prompt block still cached is shared instead). A request that could not
fit in the whole pool is refused at admission. Every sequence's blocks are freed exactly once,
when it finishes, fails or is cancelled (``drop``)."""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from nxdi_common.application import CausalLMOutput
from nxdi_common.block_manager import BlockManager, OutOfBlocks
from nxdi_common.modules.kv_cache import SequenceKVWriter
from nxdi_common.serving.compute import run_loop
from nxdi_common.serving import types as t
from nxdi_common.serving.errors import Overloaded
from nxdi_common.serving.handoff import deferred_wakeups
from nxdi_common.serving.rates import PrefillRate, moving_average
from decode_service.background_prefill import BackgroundPrefill, StepPacer, check_nice
from decode_service.scheduler import (DecodeScheduler, piece_costs_a_tpot, split_by_length,
                                      stall_budget_s)
from decode_service.sequence import Sequence
from nxdi_common.serving.sampling import (host_logits, model_global_topk, request_generator,
                                          resample_on_host, sample_row, score_positions,
                                          token_logprobs)
from nxdi_common.serving.detokenize import OutputText

log = logging.getLogger(__name__)
step_log = logging.getLogger("decode_service.steps")  # EngineConfig.log_steps
K, V = 0, 1
STEP_REMEASURE_S = 1.0  # with a TPOT or ITL target: the oldest step time pieces are judged by
# with an ITL target and paced steps: the longest gap _paced_gap_s stretches to, as a multiple
# of the ITL target or of the step, whichever is longer
PACE_STRETCH = 1.5
# without a TTFT target: how long a local prompt waits before it is late (_paced_gap_s)
LOCAL_LATE_S = 5.0
PIECE_COST_DECAY = 0.8  # the weight of earlier pieces in the measured seconds per token
# the least share of the core _prior_local_rate counts on beside running streams
PRIOR_MIN_SHARE = 0.05
# a local prompt sent with hold_steps_for_prefill holds the decode steps at most this long
# after its arrival (past any TTFT budget: the streams go on), checking this often (_held_s)
HOLD_MAX_S = 10.0
HOLD_POLL_S = 0.05
# with a TPOT target the steps are held only while every running stream would still end within
# this share of it (hold_budget_s; the rest is room for the larger steps after a hold), and not
# for less than HOLD_MIN_S at a time
HOLD_TPOT_SHARE = 0.9
HOLD_MIN_S = 0.005


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 8
    num_blocks: int = 512
    block_size: int = 16
    enable_prefix_caching: bool = True
    # Fixed cost of one more TKG call, in row-tokens of attention (scheduler.split_by_length):
    # measured with the bundled model, 1 thread: ~37 ms per call vs ~5.4 us per row-token.
    split_call_cost_row_tokens: int = 6000
    # A running sequence's time per output token that local prefill pieces must not push it
    # over (module doc); None: a piece every step while a prompt waits.
    tpot_target_s: float | None = None
    # The inter-token gap a piece sized for the running batch keeps its step within, or with
    # local prefill on its own thread the gap the steps are paced to (module doc); None: every
    # piece is prefill_chunk_size tokens, and no pacing.
    itl_target_s: float | None = None
    # The time to first token the ITL-sized pieces, or the paced gaps, must not make a waiting
    # local prefill miss (module doc); None: they keep to the ITL target alone.
    ttft_target_s: float | None = None
    # Reserve blocks for prompt + max_tokens at admission (never preempts; fewer requests run
    # at once) instead of taking them as tokens come (module doc).
    reserve_max_tokens: bool = False
    # Run local prefills on a thread of their own at this nice value (or "idle": SCHED_IDLE),
    # beside the decode steps (decode_service/background_prefill.py); None: pieces between the
    # steps, on the compute thread (the targets above apply only then).
    local_prefill_nice: int | str | None = None
    # Send a prompt's first token when its sequence joins the running batch, right before the
    # step that makes its second token, instead of as soon as it is known (module doc).
    hold_first_token: bool = False
    # With local_prefill_nice, an ITL and a TTFT target: how far the paced gap may stretch for
    # the local prompts' deadlines, in multiples of the ITL target or the step, whichever is
    # longer (module doc); 1: never past it.
    pace_stretch: float = PACE_STRETCH
    # Log a line for every decode step (logger decode_service.steps, INFO): its wall-clock end,
    # its seconds, rows and calls, the pause before it, the local prompts waiting and the
    # prompt tokens of a piece computed in the same call (a mixed step; 0 for a plain one); to
    # line a client's inter-token gaps up with the steps that made them.
    log_steps: bool = False

    def __post_init__(self):
        check_nice(self.local_prefill_nice)
        for name in ("tpot_target_s", "itl_target_s", "ttft_target_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
        if isinstance(self.pace_stretch, bool) or not (isinstance(self.pace_stretch, (int, float))
                                                       and 1 <= self.pace_stretch <= 10):
            raise ValueError(f"pace_stretch must be a number from 1 to 10 (1: the paced gap "
                             f"never passes the ITL target), got {self.pace_stretch!r}")


class DecodeEngine:
    """Continuous batching over a block KV cache (see the module doc)."""

    def __init__(self, model, tokenizer, eos_ids, config: EngineConfig, metrics=None,
                 runner=None):
        """runner: the ComputeThread (nxdi_common.serving.compute) that loaded the model, to run
        the engine loop on; None: a thread of its own."""
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self._runner = runner
        self._done = None  # the engine loop's future (compute.run_loop), once started
        self.eos_ids = frozenset(eos_ids)
        self.metrics = metrics
        self.blocks = BlockManager(config.num_blocks, config.block_size,
                                   config.enable_prefix_caching)
        self._blocks_lock = threading.Lock()
        self.scheduler = DecodeScheduler(config.max_batch_size)
        self._commands: queue.Queue = queue.Queue()
        self._local: deque[Sequence] = deque()  # local prefills: the one begun, then by arrival
        self.chunk = model.neuron_config.prefill_chunk_size
        # the mixed sub-model's chunk lengths, ascending (a piece pads to the smallest that
        # holds it); none without the mixed sub-model
        self.sizes = sorted(getattr(model, "mixed_models", None) or ())
        self._mixed = bool(self.sizes)
        # admitted and not released, by request id: a command or release for a sequence acts
        # only while its id still maps to it (an id may be reused once its sequence finished)
        self._live: dict[str, Sequence] = {}
        # preempted sequences (their KV in Sequence.swapped_kv, no blocks held), oldest first;
        # changed under _blocks_lock (admission reads it)
        self._swapped: list[Sequence] = []
        self._stopping = False
        self.scratch_slot = model.scratch[1] * config.block_size
        self.global_topk = model_global_topk(model)  # what sample_row must match
        # measured: a decode-only step's seconds, and the seconds a piece adds per prompt token
        # to the running sequences' next token (moving averages; None until first measured)
        self.step_s: float | None = None
        self.piece_s_per_token: float | None = None
        self._piece_sums = (0.0, 0.0)  # decayed sums of the seconds pieces added, their tokens
        self.step_measured_ns = 0  # when step_s was last measured (monotonic)
        # local prefills submitted and not yet done, by id() (load(): their tokens left), and
        # the rate they go at: a piece's tokens over the wall time since the previous piece
        # ended or since a prompt arrived to an empty queue (_local_mark, engine thread)
        self._local_left: dict[int, Sequence] = {}
        self.local_rate = PrefillRate()
        self._local_mark: float | None = None
        self._background = (None if config.local_prefill_nice is None
                            else BackgroundPrefill(self, config.local_prefill_nice))
        self._pacer = (None if config.itl_target_s is None or self._background is None
                       else StepPacer(config.itl_target_s))  # _pace_s
        self._paused_s = 0.0  # paced pauses since the last step (EngineConfig.log_steps)
        # a local prompt asks for the steps held and the streams' TPOT budget is spent (_held_s)
        self._past_budget = False

    # ---- asyncio side ---------------------------------------------------------------------

    def start(self) -> None:
        if self._background is not None:
            self._background.start()
        self._done = run_loop(self._run, self._runner, "decode-engine")

    def stop(self) -> None:
        self._stopping = True
        self._commands.put(("stop", None))
        if self._background is not None:
            self._background.stop()
        if self._done is not None:
            concurrent.futures.wait([self._done], timeout=30)

    def command(self, kind: str, seq, arg=None) -> None:
        """Queue a command for the engine loop (from any thread)."""
        self._commands.put((kind, seq, arg))

    def admit(self, job, max_tokens: int, emit, constraint=None) -> Sequence:
        """Reserve blocks for the prompt and its first token (module doc; with
        reserve_max_tokens, for prompt + max_tokens) and return the new sequence, or raise
        Overloaded (the caller may try another worker). emit receives its TokenOutputs (and an
        exception if it fails), from whichever thread produces them. constraint: the job's
        compiled structured output (structured.TokenConstraint), if any."""
        rid, prompt = job.request_id, list(job.prompt_ids)
        on_demand = not self.config.reserve_max_tokens
        reserve = 1 if on_demand else max_tokens
        with self._blocks_lock:
            if rid in self._live:
                old = self._live[rid]
                if not old.finished:
                    raise Overloaded(f"request id {rid!r} is already running on this worker")
                # its last token is out (a client may reuse the id at once), its release by the
                # engine thread not yet in: release it here (that one then finds it gone)
                self._release_locked(old)
            most = self.blocks.blocks_needed(len(prompt) + max_tokens)
            if most > self.blocks.num_blocks:
                raise Overloaded(f"{len(prompt)} prompt tokens + max_tokens {max_tokens} need "
                                 f"{most} KV blocks, more than this worker's "
                                 f"{self.blocks.num_blocks}")
            if on_demand and self._swapped:
                raise Overloaded(f"{len(self._swapped)} preempted sequences wait for KV blocks")
            spare = len(self._live) if on_demand else 0
            if not self.blocks.can_allocate(prompt, reserve, spare, job.cache_salt):
                raise Overloaded(
                    f"not enough free KV blocks: need "
                    f"{self.blocks.blocks_needed(len(prompt) + reserve)}"
                    f"{f' + {spare} kept for running sequences' if spare else ''}, "
                    f"{self.blocks.num_free_blocks} free of {self.blocks.num_blocks}")
            alloc = self.blocks.allocate(rid, prompt, reserve, job.cache_salt)
            seq = Sequence(job, max_tokens, alloc.block_table, alloc.num_cached_tokens,
                           OutputText(self.tokenizer, job.stop.stop_strings,
                                      job.stop.skip_special_tokens,
                                      job.stop.include_stop_str_in_output), self.eos_ids, emit,
                           request_generator(job.sampling.seed), constraint=constraint,
                           hold_first=self.config.hold_first_token)
            self._live[rid] = seq
        if self.metrics is not None and not seq.scored:  # a prompt to score is computed whole
            self.metrics.prefix_cache_hit_tokens_total.inc(seq.num_cached_tokens)
        return seq

    def kv_writer(self, seq: Sequence):
        """A function storing validated chunks (kv_transfer.ChunkWrite) of ``seq``'s prompt in its
        blocks; make one per transfer (it holds the block table as a tensor)."""
        writer = SequenceKVWriter(self.model.kv_cache, seq.block_table)  # [L, 2, NB + 1, BS, H, D]
        dtype = writer.cache.dtype

        def write(chunk) -> None:
            k, v = chunk.k, chunk.v
            if chunk.k_scale != 1.0:
                k = k.float() * chunk.k_scale
            if chunk.v_scale != 1.0:
                v = v.float() * chunk.v_scale
            writer.write(chunk.layers, chunk.tokens.start, k.to(dtype), v.to(dtype), chunk.heads)
        return write

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs, table = self.config.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def mark_prompt_ready(self, seq: Sequence) -> None:
        """The prompt's KV is in place (pulled): seal its blocks for reuse and run it."""
        with self._blocks_lock:
            if self._is_live(seq):
                self.blocks.mark_computed(seq.request_id, seq.prompt_len)
        self._commands.put(("ready", seq))

    def submit_local_prefill(self, seq: Sequence) -> None:
        with self._blocks_lock:
            self._local_left[id(seq)] = seq
        self._commands.put(("local", seq))

    def drop(self, seq: Sequence) -> None:
        """Take the sequence out of the batch and free its blocks (idempotent)."""
        self._commands.put(("drop", seq))

    def release(self, seq: Sequence) -> None:
        """Free the sequence's blocks, once; nothing when its id now names a newer sequence."""
        with self._blocks_lock:
            self._release_locked(seq)

    def _release_locked(self, seq: Sequence) -> None:
        self._local_left.pop(id(seq), None)
        if self._is_live(seq):
            del self._live[seq.request_id]
            if seq in self._swapped:  # preempted: no blocks held
                self._swapped.remove(seq)
                seq.swapped_kv = None
            else:
                self._keep_generated(seq)
                self.blocks.free(seq.request_id)

    def _keep_generated(self, seq: Sequence) -> None:
        """A sequence that ended normally: the KV of the tokens it generated and fed back (all
        but the last) joins the prefix cache, so the next turn of its conversation finds it."""
        if seq.finish_reason not in (t.LENGTH, t.EOS_TOKEN, t.STOP_TOKEN, t.STOP_STRING) \
                or len(seq.generated) < 2 or not self.config.enable_prefix_caching:
            return
        if self.blocks.num_tokens(seq.request_id) != seq.prompt_len:
            return  # tokens were recorded some other way; leave them
        self.blocks.record_written(seq.request_id, seq.generated[:-1])

    def _is_live(self, seq: Sequence) -> bool:
        return self._live.get(seq.request_id) is seq

    def load(self) -> dict:
        """Counts for the load report; "local_prompt_tokens": prompt tokens the local prefills
        have still to compute, "prefill_tokens_per_s": the rate they can go at (_local_rate)."""
        with self._blocks_lock:
            used, free = self.blocks.num_used_blocks, self.blocks.num_free_blocks
            local = sum(self._prefill_left(s) for s in self._local_left.values())
        running = self.scheduler.num_running
        return {"running": running, "queued": max(len(self._live) - running, 0),
                "kv_blocks_used": used, "kv_blocks_free": free, "local_prompt_tokens": local,
                "prefill_tokens_per_s": self._local_rate(),
                "whole_core_prefill_tokens_per_s": self._whole_core_rate(),
                "hold_budget_s": self.hold_budget_s() if self._background is not None else None}

    def _whole_core_rate(self) -> float:
        """With a local prefill thread: the rate its pieces go at per second of its own CPU
        time (else the warm-up's), what a prompt whose steps are held gets; 0 without one."""
        if self._background is None:
            return 0.0
        return self._background.core_rate.tokens_per_s or self._warmup_rate()

    def _local_rate(self) -> float:
        """The local prefill rate a router weighs this worker by: the rate the local prefills
        have gone at lately; with a TTFT target at least what whole chunks beside the measured
        step would give, since pieces grow to that where waiting prompts need it (ITL-sized
        pieces alone would tell the router a rate the engine does not hold to under a
        deadline, and send it prompts the engine would have met). Before a local prefill has
        gone at all: _prior_local_rate. With paced steps at most what the gap at the ITL
        target leaves beside a step (_beside_streams_rate), streams running or not.

        That cap since session 65: a rate measured with the core to itself, or while the
        paced gap was stretched for a deadline, told the router a long prompt would finish
        sooner than it could at the ITL target, and the streams that joined meanwhile had
        their gaps stretched for it. It holds with no stream running too: the router's view is
        up to a poll old (a second by default), and a worker that looked idle had streams
        joining (BENCHMARKS.md, issue 4, session 65: a 1115-token prompt estimated at 1.42 s
        took 6.1 s to its first token; two sequences had been admitted since the poll)."""
        rate, per_token = self.local_rate.tokens_per_s, self.piece_s_per_token
        rate = rate or self._prior_local_rate()
        if (self.config.ttft_target_s is not None and self.chunk is not None
                and self.step_s is not None and per_token):
            return max(rate, self.chunk / (self.step_s + self.chunk * per_token))
        beside = self._beside_streams_rate()
        return min(rate, beside) if rate and beside else rate

    def _beside_streams_rate(self) -> float:
        """With local prefill on its own thread and paced steps: the rate it goes at beside
        running streams with the gap at the ITL target, its whole-core rate (the thread's
        measured one, else the warm-up's) times 1 - step / target, at least PRIOR_MIN_SHARE
        (slow, not unknown); 0 where not known (no step measured or warmed up, no rate)."""
        step = self._step_or_warmup()
        if self._pacer is None or step is None:
            return 0.0
        return self._whole_core_rate() * max(1.0 - step / self.config.itl_target_s,
                                             PRIOR_MIN_SHARE)

    def _step_or_warmup(self) -> float | None:
        """The measured decode step, else a token-generation call's time in the model's
        warm-up (None where neither is known)."""
        warm = getattr(self.model, "warmup_step_seconds", None)
        return self.step_s or (warm() if callable(warm) else None)

    def _warmup_rate(self) -> float:
        """The rate a prefill chunk went at in the model's warm-up (0 where not known)."""
        warm = getattr(self.model, "warmup_prefill_rate", None)
        return (warm(self.chunk) if self.chunk and callable(warm) else None) or 0.0

    def _prior_local_rate(self) -> float:
        """The local prefill rate before one is measured: the rate a chunk went at in the
        model's warm-up (the whole core's) times the share of the core local prefill would get:
        with paced steps what the paced gap leaves (_beside_streams_rate); else all of it with
        no stream running, and beside running streams a chunk a step on the compute thread. 0
        (not measured: the router's rule does not veto) without a warm-up rate or where the
        share is not known (unpaced steps beside the thread, no step measured yet).

        Before session 64 an unmeasured worker reported 0 until its first local prefill, and
        the router's rule lets an unmeasured side take a prompt of any length. Alone it did
        not change the case that prompted it (BENCHMARKS.md, issue 4, session 64): in a cold
        run at 0.875 req/s on `mixed` a 1115-token prompt went local (the worker had no stream
        running when last polled: 1.45 s at the whole core's rate), took 6.0-6.3 s to its
        first token as streams joined, and stretched their gaps to 23-33 ms meanwhile; the
        paced share with no stream running came in session 65 (_local_rate)."""
        whole, beside = self._warmup_rate(), self._beside_streams_rate()
        if not whole:
            return 0.0
        if beside:
            return beside
        if not self.scheduler.num_running:
            return whole
        step = self._step_or_warmup()
        if step is None or self._background is not None:
            return 0.0  # no step known, or SCHED_IDLE beside unpaced steps: not known
        return self.chunk / (step + self.chunk / whole)

    # ---- engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._iterate()

    def _iterate(self) -> None:
        """One turn of the engine loop (module doc); waits up to 0.5 s for a command when idle."""
        if self._swapped:
            self._swap_in_waiting()
        idle = not (self._local or self.scheduler.running or self.scheduler.ready)
        self._apply_commands(block=idle)
        if self._stopping:
            return
        pause = self._pace_s()
        if pause > 0:  # the core goes to the local prefill thread meanwhile
            self._apply_commands(block=True, timeout=pause)
            self._paused_s += pause
            return
        piece = self._plan_piece() if self._local else None
        if not (piece and self._piece_now(piece) and self._local_piece(piece)):
            self._decode_calls()
        self._update_gauges()

    def _pace_s(self) -> float:
        """With local prefill on its own thread and an ITL target: seconds to wait before the
        next decode step while a local prefill runs, so that the gaps between steps' ends stay
        within the target and the time between goes to the prefill (StepPacer); while a prompt
        holds the steps, a short wait checked again (_held_s); 0 otherwise."""
        held = self._held_s()
        if held:
            for seq in self.scheduler.ready:  # their first tokens need not wait out the hold
                seq.release_first()
            if self.metrics is not None:
                self.metrics.held_step_seconds_total.inc(held)
            return held
        if self._pacer is None or not len(self._background):
            return 0.0
        return self._pacer.pause_s(time.perf_counter(), self._paced_gap_s())

    def _held_s(self) -> float:
        """HOLD_POLL_S while a local prompt sent with hold_steps_for_prefill waits or runs on
        the local prefill thread, for at most HOLD_MAX_S after its arrival: no decode step
        starts meanwhile, so the thread has the whole core and the prompt ends at the rate the
        router weighed (whole_core_prefill_tokens_per_s); each running stream sees one gap of
        the prompt's length instead of the many stretched ones of a paced share. 0 otherwise
        (and without the thread, where the flag is not honoured); with a TPOT target for no
        longer than hold_budget_s."""
        self._past_budget = False
        if self._background is None:
            return 0.0
        now = time.monotonic_ns()
        held = any(seq.job.hold_steps_for_prefill and now - seq.arrival_ns < HOLD_MAX_S * 1e9
                   for seq in self._background.queued())
        if not held:
            return 0.0
        budget = self.hold_budget_s()
        self._past_budget = budget is not None and budget < HOLD_MIN_S
        if budget is None:
            return HOLD_POLL_S
        return 0.0 if self._past_budget else min(HOLD_POLL_S, budget)

    def hold_budget_s(self) -> float | None:
        """With a TPOT target: how long the steps can be held now with every running stream
        still ending within HOLD_TPOT_SHARE of the target at the measured step
        (scheduler.stall_budget_s; at most 0 when none is left); None when nothing limits it
        (no target, no step measured yet, no stream that could still meet it). _held_s holds
        no longer: once it is spent the steps go on, paced as beside any local prompt (a step
        leaves it as it was: the projection counted that step already). The load report
        carries it, so that a router sends a prompt to be held only where its prefill fits."""
        target, step = self.config.tpot_target_s, self.step_s
        if target is None or step is None:
            return None
        return stall_budget_s(self._tpot_rows(time.monotonic_ns()), step, target,
                              HOLD_TPOT_SHARE)

    def _paced_gap_s(self) -> float:
        """The gap the paced steps keep (module doc): the ITL target; with a TTFT target, longer
        where the local prefills need a larger share of the core to finish within it, at most
        pace_stretch times the ITL target or the step, whichever is longer; that longest gap
        whenever a local prompt is late (_late). A gap G leaves the prefill G - step of every G: at
        its whole-core rate R (tokens per second of its own CPU time) it then goes at
        R (1 - step / G), so a need of N tokens/s takes G = step / (1 - N / R). Prompts that
        would miss even at the longest gap do not stretch it (their tokens still count ahead
        of the later ones)."""
        base, ttft = self.config.itl_target_s, self.config.ttft_target_s
        rate, step = self._background.core_rate.tokens_per_s, self.step_s
        if step is None:
            return base
        floor = max(base, step)  # steps longer than the target: no pause left to keep
        longest = floor * self.config.pace_stretch
        queued = self._background.queued()
        if self._late(queued):
            return longest
        if ttft is None or not rate:
            return base
        need = self._deadline_need(queued, within=rate * (1 - step / longest))
        if need <= rate * (1 - step / floor):
            return base
        return min(longest, step / (1 - need / rate))

    def _late(self, queued: list[Sequence]) -> bool:
        """Whether a waiting local prompt has waited past the TTFT target (LOCAL_LATE_S
        without one): then the paced gap is the longest, whatever the others need. Without
        this a prompt got no core while steps took the ITL target or longer (the pause before
        a step is the target less the step) or once it could no longer meet its deadline (it
        needs nothing then), and a decode worker at 4 req/s on `mixed` (session 58) held 30 000
        prompt tokens of local prefills, and their KV blocks, for minutes."""
        limit_ns = (self.config.ttft_target_s or LOCAL_LATE_S) * 1e9
        now = time.monotonic_ns()
        return any(now - seq.arrival_ns > limit_ns for seq in queued)

    def _plan_piece(self) -> tuple[Sequence, int, int]:
        """The next local prefill piece: (sequence, start, end) of its prompt positions."""
        seq = self._next_local()
        return (seq, *self._next_piece(seq, self._piece_size()))

    def _piece_size(self) -> int | None:
        """The next piece's tokens at most (module doc: the ITL target): prefill_chunk_size, or
        with the target and a running batch the largest mixed chunk length whose step fits."""
        target = self.config.itl_target_s
        if target is None or not self.sizes or not (self.scheduler.running or
                                                    self.scheduler.ready):
            return self.chunk
        if self.step_s is None:
            return self.sizes[0]
        fits = [c for c in self.sizes
                if (cost := self._piece_cost(c)) is not None and self.step_s + cost <= target]
        return self._deadline_size(fits[-1] if fits else self.sizes[0])

    def _deadline_size(self, size: int) -> int:
        """The smallest piece length from `size` up at which every waiting local prefill, in the
        order they run, would finish within the TTFT target of its arrival (module doc); the
        largest when none would. Prompts already past the target add their tokens, nothing
        more."""
        per_token = self.piece_s_per_token
        if self.config.ttft_target_s is None or self.step_s is None or per_token is None:
            return size
        need = self._deadline_need(self._local_order())
        for c in self.sizes:
            if c >= size and c / (self.step_s + c * per_token) >= need:
                return c
        return self.sizes[-1]

    def _deadline_need(self, order: list[Sequence], within: float | None = None) -> float:
        """Prompt tokens per second the local prefills in ``order`` (the order they run) need
        to finish each within the TTFT target of its arrival: the most any of them needs. A
        prompt already past the target, or needing more than ``within``, adds its tokens
        ahead of the later ones, nothing more."""
        target = self.config.ttft_target_s
        now, tokens, need = time.monotonic_ns(), 0, 0.0
        for seq in order:
            tokens += self._prefill_left(seq)
            left_s = target - (now - seq.arrival_ns) / 1e9
            if left_s > 0 and (within is None or tokens / left_s <= within):
                need = max(need, tokens / left_s)
        return need

    def _piece_cost(self, tokens: int) -> float | None:
        """Seconds a piece of `tokens` adds to the running batch's step: the measured seconds
        per token times the mixed chunk length it pads to (None until measured)."""
        if self.piece_s_per_token is None:
            return None
        return self._padded(tokens) * self.piece_s_per_token

    def _padded(self, tokens: int) -> int:
        """The mixed chunk length a piece of `tokens` runs in (tokens itself without one)."""
        return next((c for c in self.sizes if c >= tokens), tokens)

    def _piece_now(self, piece: tuple[Sequence, int, int]) -> bool:
        """Whether the planned local prefill piece runs in this step (module doc: the TPOT
        target); counts the steps it waits."""
        target = self.config.tpot_target_s
        if target is None and self.config.itl_target_s is None:
            return True
        now = time.monotonic_ns()
        waiting = self.scheduler.running or self.scheduler.ready
        if waiting and (now - self.step_measured_ns) / 1e9 > STEP_REMEASURE_S:
            return False  # a step of its own first, to measure it (both targets use it)
        _, start, end = piece
        cost = self._piece_cost(end - start)
        if target is None or self.step_s is None or cost is None:
            return True
        if not piece_costs_a_tpot(self._tpot_rows(now), cost, self.step_s, target):
            return True
        if self.metrics is not None:
            self.metrics.deferred_pieces_total.inc()
        return False

    def _tpot_rows(self, now_ns: int) -> list[tuple[float, int, int]]:
        """(seconds since its first token, tokens it has, max_tokens) of each running or ready
        sequence: what a TPOT target is judged on (scheduler.stall_budget_s)."""
        seqs = list(self.scheduler.running.values()) + list(self.scheduler.ready)
        return [((now_ns - s.first_token_ns) / 1e9, len(s.generated), s.max_tokens) for s in seqs]

    def _local_piece(self, piece: tuple[Sequence, int, int]) -> bool:
        """The planned piece of a local prefill; True when the running batch's decode step rode
        in its call (then the step is done)."""
        seq, start, end = piece
        self._local.remove(seq)
        batch = self._next_batch() if not seq.scored and self._mixes(start, end) else []
        began = time.perf_counter()
        if not batch:
            self._guarded(self._prefill_piece, [seq], piece)
            self._measured_local(end - start)
            if self.scheduler.running:  # the running batch's step waits for this call
                self._measured_piece(time.perf_counter() - began, end - start)
            return False
        self._guarded(self._mixed_step, [seq] + batch, (piece, batch))
        if self.config.log_steps:
            self._log_step(time.perf_counter() - began, len(batch), 1, end - start)
        self._measured_local(end - start)
        if self.step_s is not None:  # what the piece (padded) added to the step
            self._measured_piece(time.perf_counter() - began - self.step_s,
                                 self._padded(end - start))
        if self.metrics is not None:
            self.metrics.decode_steps_total.inc()
            self.metrics.mixed_steps_total.inc()
        return True

    def _decode_calls(self) -> None:
        """The running batch's decode step as token-generation calls of its own."""
        groups = self._decode_groups(self._next_batch())
        began = time.perf_counter()
        for group in groups:
            self._guarded(self._decode_step, group, group)
        if groups:
            ended = time.perf_counter()
            if self._pacer is not None:  # an empty batch is no step: the pace does not restart
                self._pacer.done(began, ended)
            self.step_s = moving_average(self.step_s, ended - began)
            self.step_measured_ns = time.monotonic_ns()
            if self.config.log_steps:
                self._log_step(ended - began, sum(map(len, groups)), len(groups))
            if self.metrics is not None:
                self.metrics.decode_step_duration_seconds.observe(ended - began)
                self.metrics.decode_steps_total.inc()
                self.metrics.token_generation_calls_total.inc(len(groups))
                if self._past_budget:  # beside a prompt that asked for the steps held
                    self.metrics.hold_budget_steps_total.inc()

    def _log_step(self, seconds: float, rows: int, calls: int, piece: int = 0) -> None:
        """EngineConfig.log_steps: one line for the step that just ended (the pauses before it
        since the previous one, and the local prompts waiting, with it); ``piece``: the prompt
        tokens of a local prefill piece computed in the same call (a mixed step), else 0."""
        local = len(self._background) if self._background is not None else len(self._local)
        step_log.info("step end=%.6f seconds=%.6f rows=%d calls=%d paused=%.6f local=%d piece=%d",
                      time.time(), seconds, rows, calls, self._paused_s, local, piece)
        self._paused_s = 0.0

    def _next_batch(self) -> list[Sequence]:
        """The running batch of this step (scheduler.next_batch), every sequence with a block for
        the token it feeds in: a sequence that needs a block when none is free makes the newest
        running one (maybe itself) give up its blocks (module doc). A sequence joining with its
        first token held (hold_first_token) sends it now."""
        batch = self.scheduler.next_batch()
        if not self.config.reserve_max_tokens:
            self._grow_blocks(batch)
            batch = [seq for seq in batch if seq.slot >= 0]
        for seq in batch:
            seq.release_first()  # nothing unless it joins now with its first token held
        return batch

    def _grow_blocks(self, batch: list[Sequence]) -> None:
        """A block for each sequence's next token, preempting where none is free."""
        for seq in sorted(batch, key=lambda s: s.wait_order):  # the first keep their blocks
            while seq.slot >= 0:
                try:
                    with self._blocks_lock:
                        seq.block_table += self.blocks.grow(seq.request_id,
                                                            seq.next_position() + 1)
                    break
                except OutOfBlocks:
                    self._preempt(max(self.scheduler.running.values(),
                                      key=lambda s: s.wait_order))

    def _preempt(self, seq: Sequence) -> None:
        """Copy the running sequence's KV out, free its blocks and park it (_swap_in_waiting)."""
        self.scheduler.remove(seq)
        with self._blocks_lock:
            written = self.blocks.blocks_needed(seq.next_position())  # its last token is not
            table = torch.tensor(seq.block_table[:written])
            seq.swapped_kv = self.model.kv_cache[:, :, table]  # [L, 2, blocks, BS, H, D], a copy
            self.blocks.free(seq.request_id)
            seq.block_table = []
            self._swapped.append(seq)
            self._swapped.sort(key=lambda s: s.wait_order)
        log.info("preempted %s at %d tokens: no free KV block", seq.request_id,
                 seq.next_position())
        if self.metrics is not None:
            self.metrics.preemptions_total.inc()

    def _swap_in_waiting(self) -> None:
        """Preempted sequences, oldest first, back into new blocks while they fit with one block
        spare per running sequence and a batch slot is open; they run before newer ones."""
        while self._swapped:
            seq = self._swapped[0]
            waiting = len(self.scheduler.running) + len(self.scheduler.ready)
            if waiting >= self.scheduler.max_batch_size:
                return
            n, prompt = seq.next_position(), list(seq.job.prompt_ids)
            with self._blocks_lock:
                salt = seq.job.cache_salt
                if not self.blocks.can_allocate(prompt, n + 1 - len(prompt),
                                                len(self.scheduler.running), salt):
                    return
                alloc = self.blocks.allocate(seq.request_id, prompt, n + 1 - len(prompt), salt)
                self._swapped.pop(0)
            kv, seq.swapped_kv = seq.swapped_kv, None
            cached = alloc.num_cached_tokens // self.config.block_size  # shared, already there
            if cached < kv.shape[2]:
                table = torch.tensor(alloc.block_table[cached:kv.shape[2]])
                self.model.kv_cache[:, :, table] = kv[:, :, cached:]
            seq.block_table = alloc.block_table
            with self._blocks_lock:
                self.blocks.mark_computed(seq.request_id, len(prompt))
            self.scheduler.ready.appendleft(seq)

    def _measured_local(self, tokens: int) -> None:
        """A piece of `tokens` is done: the local prefill rate's sample (see __init__)."""
        now = time.perf_counter()
        if self._local_mark is not None:
            self.local_rate.add(tokens, now - self._local_mark)
        self._local_mark = now if self._local else None

    def _measured_piece(self, seconds: float, tokens: int) -> None:
        """A piece of `tokens` added `seconds` to a step (noisy: a step time less the average
        step, so it may be negative): seconds per token as a ratio of decayed sums, so a long
        piece weighs more than a short one, and the noise of short ones averages out instead of
        being clipped at zero one sample at a time."""
        seconds_sum, tokens_sum = self._piece_sums
        seconds_sum = PIECE_COST_DECAY * seconds_sum + seconds
        tokens_sum = PIECE_COST_DECAY * tokens_sum + max(tokens, 1)
        self._piece_sums = (seconds_sum, tokens_sum)
        self.piece_s_per_token = max(seconds_sum / tokens_sum, 0.0)

    def _apply_commands(self, block: bool, timeout: float = 0.5) -> None:
        try:
            cmd = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(*cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, kind: str, seq: Sequence | None, arg=None) -> None:
        if kind == "drop":
            self.scheduler.remove(seq)
            if seq in self._local:
                self._local.remove(seq)
            if self._background is not None and not self._background.cancel(seq):
                return  # its piece is running: released once it is done
            self.release(seq)
        elif seq is not None and not self._is_live(seq):
            return  # dropped (or finished) before this command arrived
        elif kind == "ready" and not seq.finished:
            self.scheduler.add_ready(seq)
        elif kind == "local" and self._background is not None:
            self._background.submit(seq)
        elif kind == "local":
            if not self._local:
                self._local_mark = time.perf_counter()
            self._local.append(seq)
        elif kind == "prefilled":  # the background thread's last piece: arg is its output
            self._piece_done(seq, seq.prompt_len, arg)
        elif kind == "failed":  # a background piece raised arg
            self.release(seq)
            seq.fail(arg)

    def _guarded(self, fn, seqs: list[Sequence], arg) -> None:
        """Run a model step; on an exception fail its sequences (the worker keeps serving)."""
        try:
            fn(arg)
        except Exception as exc:  # noqa: BLE001 - reported to each affected request
            log.exception("model step failed")
            for seq in seqs:
                self.scheduler.remove(seq)
                self.release(seq)
                seq.fail(exc)

    def _finish_step(self, seqs: list[Sequence], out) -> None:
        with deferred_wakeups():  # the step's token events: one wake-up of the loop, at the end
            self._finish_rows(seqs, out)

    def _finish_rows(self, seqs: list[Sequence], out) -> None:
        # the tokens in one tolist, a row's logits only where its request wants logprobs: a
        # tensor op per row costs ~10 us right after a step (BENCHMARKS.md, session 31)
        for i, (seq, token) in enumerate(zip(seqs, out.tokens.tolist())):
            sampling, logits = seq.job.sampling, None
            try:
                banned = seq.banned_ids()  # min_tokens
                if banned or resample_on_host(sampling, len(seq.generated)):
                    logits = host_logits(out.logits[i], seq.generated, sampling, seq.constraint,
                                         seq.job.prompt_ids, banned)
                    token = sample_row(logits, sampling, seq.last_uniform, self.global_topk)
                logprob, top = (token_logprobs(out.logits[i] if logits is None else logits,
                                               token, sampling, self.tokenizer)
                                if sampling.logprobs else (None, ()))
                seq.add_token(token, logprob, top)
            except Exception as exc:  # noqa: BLE001 - this sequence's own failure (a constraint)
                log.exception("%s: sampling failed", seq.request_id)
                seq.fail(exc)
            if seq.finished:
                self.scheduler.remove(seq)
                self.release(seq)

    def _next_local(self) -> Sequence:
        """The waiting local prefill to run next (module doc): of those whose rest fits in one
        piece the first of the shortest, else the first in the queue (the begun one, then by
        arrival). Without pieces, the first of the shortest."""
        return self._local_order()[0]

    def _local_order(self) -> list[Sequence]:
        """The waiting local prefills in the order they run (_next_local)."""
        return self.local_order(self._local)

    def local_order(self, seqs) -> list[Sequence]:
        """``seqs`` (local prefills, a begun one first, then by arrival) in the order they run:
        by priority, then those whose rest fits in one piece, shortest first, then the rest in
        the order given."""
        def key(item: tuple[int, Sequence]) -> tuple[int, bool, int]:
            index, seq = item
            left = self._prefill_left(seq)
            long = self.chunk is not None and left > self.chunk
            return seq.priority, long, index if long else left
        return [seq for _, seq in sorted(enumerate(seqs), key=key)]

    def _mixes(self, start: int, end: int) -> bool:
        """Whether the piece [start, end) takes the decode step into its call: not when it is a
        whole prompt shorter than the chunk length it pads to (context encoding pads it to a
        bucket near its length, and the step costs less)."""
        return self._mixed and (start > 0 or end - start == self._padded(end - start))

    def _prefill_left(self, seq: Sequence) -> int:
        """Prompt tokens the sequence's local prefill has still to compute (its order key)."""
        return seq.prompt_len - self._next_piece(seq)[0]

    def next_piece(self, seq: Sequence) -> tuple[int, int]:
        """Prompt positions [start, end) of the sequence's next whole-chunk piece."""
        return self._next_piece(seq)

    def _next_piece(self, seq: Sequence, size: int | None = None) -> tuple[int, int]:
        """Prompt positions [start, end) of the sequence's next local prefill call, of at most
        `size` tokens (default prefill_chunk_size)."""
        n = seq.prompt_len
        if self.chunk is None:
            return 0, n  # one context encoding; a cached prefix is computed again, not written
        # the cached prefix is read, not computed (a prompt to score is computed whole)
        start = seq.prefilled or (0 if seq.scored else seq.num_cached_tokens)
        return start, min(n, start + (size or self.chunk))

    def _piece_args(self, seq: Sequence, start: int, end: int) -> dict:
        """forward() arguments of the sequence's prompt piece [start, end)."""
        n, cached = seq.prompt_len, seq.num_cached_tokens
        slots = [self.scratch_slot if p < cached else s
                 for p, s in zip(range(start, end), self.slots(seq, start, end))]
        return dict(input_ids=torch.tensor([seq.job.prompt_ids[start:end]]),
                    seq_ids=torch.tensor([0]), position_ids=torch.arange(start, end).unsqueeze(0),
                    sampling_params=torch.tensor([seq.job.sampling.as_row()]),
                    slot_mapping=torch.tensor([slots]), block_table=torch.tensor([seq.block_table]),
                    rand=torch.tensor([seq.draw_uniform() if end == n else 0.0]))

    def _prefill_piece(self, piece: tuple[Sequence, int, int]) -> None:
        """A piece of a sequence's prompt (a model call of its own), then what follows it."""
        seq, start, end = piece
        self._piece_done(seq, end, self.piece_output(seq, start, end))

    @torch.no_grad()
    def piece_output(self, seq: Sequence, start: int, end: int) -> CausalLMOutput:
        """The model call of the prompt piece [start, end) (no engine state changed); a prompt
        to score (prompt_logprobs) runs for every position's hidden state (forward_hidden,
        eager) and its first token is sampled on the host as the device would (sample_row)."""
        args = self._piece_args(seq, start, end)
        if not seq.scored:
            return self.model.forward(**args)
        # every position's hidden state: the piece scores the prompt token after each of its
        # positions (the last piece's last position gives the first token's logits instead)
        hidden = self.model.forward_hidden(
            args["input_ids"], seq_ids=args["seq_ids"], position_ids=args["position_ids"],
            slot_mapping=args["slot_mapping"], block_table=args["block_table"])
        scores, last = score_positions(self.model, hidden[0],
                                       seq.job.prompt_ids[start + 1:end + 1],
                                       seq.job.sampling.prompt_logprobs)
        seq.prompt_logprobs = (*seq.prompt_logprobs, *scores)
        token = sample_row(last, seq.job.sampling, seq.last_uniform, self.global_topk)
        return CausalLMOutput(logits=last[None], tokens=torch.tensor([token]))

    @torch.no_grad()
    def _mixed_step(self, arg: tuple[tuple[Sequence, int, int], list[Sequence]]) -> None:
        """A piece of a prompt and a decode step of the running batch in one model call
        (forward_mixed): the weights are read once for both."""
        (seq, start, end), batch = arg
        out = self.model.forward_mixed(chunk=self._piece_args(seq, start, end),
                                       decode=self._step_args(batch))
        self._piece_done(seq, end, _rows(out, slice(0, 1)))
        self._finish_step(batch, _rows(out, slice(1, None)))

    def _piece_done(self, seq: Sequence, end: int, out) -> None:
        """After a piece: after the last, the sequence's first token, and it joins the batch.
        Cached prefix positions are never written (their blocks are shared)."""
        n = seq.prompt_len
        last = end == n
        seq.prefilled = end
        if not last:
            self._local.appendleft(seq)  # its next piece after the next decode step
            return
        with self._blocks_lock:
            self._local_left.pop(id(seq), None)
            self.blocks.mark_computed(seq.request_id, n)
        self._finish_step([seq], out)
        if not seq.finished:
            self.scheduler.add_ready(seq)

    def _decode_groups(self, batch: list[Sequence]) -> list[list[Sequence]]:
        """The step's TKG calls: short sequences apart from long ones when that is cheaper."""
        if len(batch) < 2:
            return [batch] if batch else []
        tkg = self.model.token_generation_model
        rows = split_by_length([s.next_position() + 1 for s in batch], tkg.length_buckets,
                               tkg.batch_buckets, self.config.split_call_cost_row_tokens)
        return [[batch[i] for i in group] for group in rows]

    @torch.no_grad()
    def _decode_step(self, batch: list[Sequence]) -> None:
        """One token for every running sequence (a token-generation call)."""
        args = self._step_args(batch)
        began = time.perf_counter()
        out = self.model.forward(**args)
        if self.metrics is not None:
            self.metrics.token_generation_forward_seconds.observe(time.perf_counter() - began)
        self._finish_step(batch, out)

    def _step_args(self, batch: list[Sequence]) -> dict:
        """forward() arguments of a decode step: [B, 1] inputs, [B, W] block table."""
        bs = self.config.block_size
        positions = [s.next_position() for s in batch]
        width = max(p // bs + 1 for p in positions)
        scratch = self.model.scratch[1]
        table = [(s.block_table + [scratch] * width)[:width] for s in batch]
        return dict(
            input_ids=torch.tensor([[s.generated[-1]] for s in batch]),
            seq_ids=torch.tensor([s.slot for s in batch], dtype=torch.int32),
            position_ids=torch.tensor([[p] for p in positions]),
            sampling_params=torch.tensor([s.job.sampling.as_row() for s in batch]),
            slot_mapping=torch.tensor([self.slots(s, p, p + 1) for s, p in zip(batch, positions)]),
            block_table=torch.tensor(table),
            rand=torch.tensor([s.draw_uniform() for s in batch]))

    def _update_gauges(self) -> None:
        if self.metrics is None:
            return
        load = self.load()
        self.metrics.running_sequences.set(load["running"])
        self.metrics.queue_depth_requests.set(load["queued"])
        self.metrics.queued_prompt_tokens.set(load["local_prompt_tokens"])
        self.metrics.prefill_tokens_per_second.set(load["prefill_tokens_per_s"])
        self.metrics.kv_blocks_used_blocks.set(load["kv_blocks_used"])
        self.metrics.kv_blocks_free_blocks.set(load["kv_blocks_free"])


def _rows(out: CausalLMOutput, rows: slice) -> CausalLMOutput:
    """Some rows of a model call's output."""
    return CausalLMOutput(logits=None if out.logits is None else out.logits[rows],
                          tokens=None if out.tokens is None else out.tokens[rows])
