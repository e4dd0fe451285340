"""Prefill scheduling and the torch work: waiting prompts are batched by context-encoding (CTE)
length bucket and run on one dedicated worker thread, never on the event loop.

- :class:`PrefillScheduler` holds the waiting prompts and picks the next batch (no threads, no
  torch): a length bucket, then up to ``ctx_batch_size`` waiting prompts of that bucket (fewer
  for long buckets under a batch token budget), oldest first. The bucket: the oldest waiting
  prompt's (``order="arrival"``), or the shortest waiting one's (``order="shortest"``) until the
  oldest prompt has waited ``max_overtaken_s``, when its bucket goes next. Shortest first, a chat
  prompt waits behind the batch running, not behind every long prompt queued before it: a
  TTFT SLO is met by the many short prompts at the cost of a bounded delay to the few long ones
  (BENCHMARKS.md, issue 4, session 25). ``order="deadline"``: the oldest waiting prompt that
  can still be encoded within ``ttft_target_s`` of its arrival here, at the time this worker
  measured for its length bucket (a moving average per padded token), goes next; when none
  can, the oldest does, and so does a prompt that has waited ``max_overtaken_s`` (by default
  twice the target). A
  burst of long prompts then costs the goodput only the prompts that were late anyway, not
  every one queued behind them: session 69's bursts of 4-5 long prompts made FIFO miss 3 of
  them (BENCHMARKS.md, issue 4). Prompts already late wait longer: their TTFT is traded for
  others' SLO. All of this among the prompts of the best (lowest) ``priority`` waiting: a
  prompt of a worse one waits until none of a better one does.
- :class:`PrefillEngine` owns the model and its worker thread. Each batch runs CTE over rows
  ``0..B-1`` of the flat KV cache, samples the first tokens, copies every request's KV out of its
  cache row into the request's own tensors and so frees the rows before the next batch; the result
  is handed to the event loop with ``loop.call_soon_threadsafe``.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nxdi_common import bucketing
from nxdi_common.application import CausalLMOutput
from nxdi_common.serving.compute import run_loop
from nxdi_common.serving.errors import Overloaded, Unavailable
from nxdi_common.serving.rates import PrefillRate, moving_average
from nxdi_common.serving.sampling import (host_logits, model_global_topk, next_uniform,
                                          request_generator, resample_on_host, sample_row,
                                          score_positions, token_logprobs)
from nxdi_common.serving.types import PrefillJob, PromptLogprob, TokenLogprob
from prefill_service.prefix_cache import PrefixCache, pieces

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FirstTokenResult:
    """The first generated token of a prompt."""

    token_id: int
    logprob: float | None = None  # set when the request asked for logprobs
    top_logprobs: tuple[TokenLogprob, ...] = ()
    compute_ns: int = 0  # wall time of the CTE batch that encoded the prompt
    # the prompt's scores when the request asked for them (SamplingOptions.prompt_logprobs)
    prompt_logprobs: tuple[PromptLogprob, ...] = ()
    cached_tokens: int = 0  # leading prompt tokens read from the prefix cache, not computed


@dataclass
class PrefillOutput:
    """What one request gets back from the engine: its first token and its own copy of the KV it
    asked for (positions [kv_token_start, len(prompt)), its head range)."""

    first: FirstTokenResult
    k: torch.Tensor  # [layers, tokens, heads, head_dim]
    v: torch.Tensor  # [layers, tokens, heads, head_dim]


@dataclass(eq=False)
class PrefillTask:
    """One admitted request: the job, the KV heads to return, and the future its result is
    delivered to (on ``loop``)."""

    job: PrefillJob
    heads: tuple[int, int]  # [h0, h1) KV heads to copy out
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    bucket: int = 0  # CTE length bucket, set by the scheduler
    # the request's structured-output constraint (compiled by the servicer), or None
    constraint: object = None
    arrival_ns: int = field(default_factory=time.perf_counter_ns)
    # leading prompt tokens the prefix cache held when last looked at (PrefillEngine.submit,
    # and again when its batch starts): not counted as work in the load report
    cached_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.job.prompt_ids)

    @property
    def tokens_to_compute(self) -> int:
        return self.num_tokens - self.cached_tokens


@dataclass(frozen=True)
class LoadReport:
    """A prefill worker's load at one instant (the internal twin of the WorkerLoad message)."""

    address: str
    fingerprint: object  # kv_transfer.ModelFingerprint
    queued_prompt_tokens: int
    queued_requests: int
    running_sequences: int
    max_running_sequences: int
    open_transfers: int
    reported_at_unix_ns: int
    running_prompt_tokens: int = 0  # still to compute (PrefillEngine.counts)
    prefill_tokens_per_s: float = 0.0  # measured; 0 until the first batch
    # the prefix cache's blocks (all 0 without one): the router sizes its memory of what this
    # worker holds by them (router/prefix_index.py)
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_block_size: int = 0


ORDERS = ("arrival", "shortest", "deadline")
DEFAULT_TTFT_TARGET_S = 3.5  # order "deadline": encoded within this of arrival


def max_overtaken_or_default(order: str, max_overtaken_s: float | None,
                             ttft_target_s: float) -> float:
    """The bound as given, or by default 1 s (order "shortest") or twice the TTFT target
    ("deadline": a prompt already late waits at most that long)."""
    if max_overtaken_s is not None:
        return max_overtaken_s
    return 2 * ttft_target_s if order == "deadline" else 1.0


def check_order(order: str, max_overtaken_s: float | None,
                ttft_target_s: float = DEFAULT_TTFT_TARGET_S) -> None:
    """ValueError naming the field unless ``order`` is one of ORDERS, the bound >= 0 (or None:
    the order's default) and the target > 0 seconds."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    if max_overtaken_s is not None and not max_overtaken_s >= 0:
        raise ValueError(f"max_overtaken_s must be >= 0 seconds, got {max_overtaken_s}")
    if not ttft_target_s > 0:
        raise ValueError(f"ttft_target_s must be > 0 seconds, got {ttft_target_s}")


def _padded_work(task: PrefillTask) -> int:
    """The tokens ``task``'s encoding computes: its length bucket (the model pads a prompt to
    it), or the uncached rest where the prefix cache holds its start."""
    return task.tokens_to_compute if task.cached_tokens else task.bucket


class PrefillScheduler:
    """Bounded queue of waiting prompts, batched by CTE length bucket (module doc)."""

    def __init__(self, length_buckets: list[int], ctx_batch_size: int, max_queued: int,
                 batch_limits: dict[int, int] | None = None, order: str = "arrival",
                 max_overtaken_s: float | None = None,
                 clock: Callable[[], int] = time.perf_counter_ns,
                 ttft_target_s: float = DEFAULT_TTFT_TARGET_S):
        """batch_limits: the most prompts a batch of each length bucket may hold (the model's
        largest batch bucket of that length); ctx_batch_size where absent. clock: nanoseconds,
        the clock of PrefillTask.arrival_ns. ttft_target_s: order "deadline"'s target;
        max_overtaken_s None: the order's default (max_overtaken_or_default)."""
        if ctx_batch_size < 1 or max_queued < 1:
            raise ValueError(f"ctx_batch_size ({ctx_batch_size}) and max_queued_requests "
                             f"({max_queued}) must be at least 1")
        check_order(order, max_overtaken_s, ttft_target_s)
        self.order = order
        self.max_overtaken_ns = int(max_overtaken_or_default(order, max_overtaken_s,
                                                             ttft_target_s) * 1e9)
        self.ttft_target_ns = int(ttft_target_s * 1e9)
        self.ns_per_token: dict[int, float] = {}  # measured, by length bucket (observe)
        self.clock = clock
        self.length_buckets = list(length_buckets)
        self.ctx_batch_size, self.max_queued = ctx_batch_size, max_queued
        self.batch_limits = {n: max(1, min(ctx_batch_size, (batch_limits or {}).get(
            n, ctx_batch_size))) for n in self.length_buckets}
        self.waiting: list[PrefillTask] = []

    def add(self, task: PrefillTask) -> None:
        """Queue ``task``; Overloaded when the queue is full."""
        if len(self.waiting) >= self.max_queued:
            raise Overloaded(f"prefill queue is full ({self.max_queued} requests waiting); "
                             f"try another prefill worker")
        task.bucket = bucketing.select_bucket(task.num_tokens, self.length_buckets,
                                              "prompt length", "context-encoding")
        self.waiting.append(task)

    def remove(self, task: PrefillTask) -> bool:
        """Drop ``task`` if it is still waiting; True if it was."""
        if task in self.waiting:
            self.waiting.remove(task)
            return True
        return False

    def next_batch(self) -> list[PrefillTask]:
        """Take the next batch off the queue: up to the bucket's batch limit of waiting prompts
        in the next bucket (module doc), oldest first ([] when nothing waits)."""
        if not self.waiting:
            return []
        best = min(t.job.priority for t in self.waiting)
        waiting = [t for t in self.waiting if t.job.priority == best]
        oldest = waiting[0]
        now = self.clock()
        overtaken = now - oldest.arrival_ns < self.max_overtaken_ns
        bucket = oldest.bucket
        if self.order == "shortest" and overtaken:
            bucket = min(t.bucket for t in waiting)
        elif self.order == "deadline" and overtaken:
            lead = next((t for t in waiting if self.in_time(t, now)), oldest)
            bucket = lead.bucket
            waiting = [lead] + [t for t in waiting if t is not lead]
        batch = [t for t in waiting if t.bucket == bucket][:self.batch_limits[bucket]]
        for task in batch:
            self.waiting.remove(task)
        return batch

    def in_time(self, task: PrefillTask, now_ns: int) -> bool:
        """Whether ``task``, started at ``now_ns``, would be encoded within the TTFT target of
        its arrival, at the time per token measured for its bucket (or the nearest bucket
        measured; in time while nothing has been measured)."""
        if not self.ns_per_token:
            return True
        measured = min(self.ns_per_token, key=lambda n: abs(n - task.bucket))
        ns = _padded_work(task) * self.ns_per_token[measured]
        return now_ns + ns <= task.arrival_ns + self.ttft_target_ns

    def observe(self, batch: list[PrefillTask], seconds: float) -> None:
        """Note a batch's time (the engine, after each batch): order "deadline"'s estimate."""
        tokens = sum(_padded_work(t) for t in batch)
        if batch and tokens > 0 and seconds > 0:
            bucket = batch[0].bucket
            self.ns_per_token[bucket] = moving_average(self.ns_per_token.get(bucket),
                                                       seconds * 1e9 / tokens, 0.5)

    @property
    def queued_prompt_tokens(self) -> int:
        """Prompt tokens the waiting prompts have to compute (their cached prefixes left out)."""
        return sum(t.tokens_to_compute for t in self.waiting)


# ---------------------------------------------------------------------------------------------
# Torch work (worker thread only)
# ---------------------------------------------------------------------------------------------

def batch_inputs(jobs: list[PrefillJob]):
    """Right-padded model inputs for a CTE batch: ids [B, S], mask [B, S], positions [B, S],
    sampling_params [B, 3], rand [B]."""
    b, s = len(jobs), max(len(j.prompt_ids) for j in jobs)
    ids = torch.zeros(b, s, dtype=torch.long)
    mask = torch.zeros(b, s, dtype=torch.long)
    for i, job in enumerate(jobs):
        ids[i, :len(job.prompt_ids)] = torch.tensor(job.prompt_ids, dtype=torch.long)
        mask[i, :len(job.prompt_ids)] = 1
    positions = torch.arange(s).expand(b, s)  # starts at 0: forces context encoding
    params = torch.tensor([j.sampling.as_row() for j in jobs], dtype=torch.float32)
    rand = torch.tensor([next_uniform(request_generator(j.sampling.seed)) for j in jobs],
                        dtype=torch.float32)  # draw 0 of each request's stream
    return ids, mask, positions, params, rand


def copy_kv(cache: torch.Tensor, row: int, tokens: tuple[int, int],
            heads: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of cache row ``row``, positions [t0, n), heads [h0, h1), as new tensors
    [layers, tokens, heads, head_dim]; ``cache`` is the flat [layers, 2, rows+1, kv_heads,
    seq_len, head_dim] KV cache."""
    (t0, n), (h0, h1) = tokens, heads
    # clone, not contiguous(): with one layer and one KV head the permuted slice is already
    # contiguous, and contiguous() would hand back a view of the cache, which the next batch
    # overwrites while the chunks (views of these tensors, kv_transfer) are still being sent.
    k, v = (cache[:, which, row, h0:h1, t0:n].permute(0, 2, 1, 3) for which in (0, 1))
    return (k.clone(memory_format=torch.contiguous_format),
            v.clone(memory_format=torch.contiguous_format))


def run_batch(model, batch: list[PrefillTask], cache: PrefixCache | None = None
              ) -> list[PrefillOutput]:
    """Encode ``batch``, sample first tokens and copy each request's KV out. Without a prefix
    cache in KV cache rows 0..B-1 (free again afterwards); with one in blocks (prefix_cache
    module doc): the prompts with nothing cached (or to score) by one context encoding, the rest
    past their cached prefix by chunked prefill."""
    if cache is None:
        return _run_flat(model, batch)
    entries = []
    computed = False
    try:
        for task in batch:
            entries.append(cache.admit(task.job.request_id, task.job.prompt_ids,
                                       whole=task.job.sampling.prompt_logprobs is not None,
                                       salt=task.job.cache_salt))
        start = time.perf_counter_ns()
        whole = [i for i, e in enumerate(entries) if not e.reuse]
        firsts: list = [None] * len(batch)  # (token, logits, uniform, scores) per task
        if whole:
            tasks = [batch[i] for i in whole]
            width = max(t.num_tokens for t in tasks)  # batch_inputs pads the ids to it
            blocks = cache.context_args([entries[i] for i in whole], width)
            for i, first in zip(whole, _encode(model, tasks, blocks)):
                firsts[i] = first
        for i, entry in enumerate(entries):
            if entry.reuse:
                firsts[i] = _encode_rest(model, batch[i], entry, cache)
        compute_ns = time.perf_counter_ns() - start
        results = _outputs(model, batch, firsts, compute_ns,
                           lambda i, span, heads: cache.copy_kv(entries[i], span, heads),
                           [e.reuse for e in entries])
        computed = True
        return results
    finally:
        for entry in entries:
            cache.release(entry, computed)


def _run_flat(model, batch: list[PrefillTask]) -> list[PrefillOutput]:
    """run_batch in cache rows 0..B-1 of a flat KV cache."""
    start = time.perf_counter_ns()
    firsts = _encode(model, batch)
    return _outputs(model, batch, firsts, time.perf_counter_ns() - start,
                    lambda i, span, heads: copy_kv(model.kv_cache, i, span, heads))


def _outputs(model, batch: list[PrefillTask], firsts: list[tuple], compute_ns: int, kv_of,
             cached: list[int] | None = None) -> list[PrefillOutput]:
    """Each task's PrefillOutput: its first token (_first_token) from _encode's (token, logits,
    uniform, scores), and its KV from kv_of(batch index, (t0, n), heads)."""
    results = []
    for i, (task, (token, logits, uniform, scores)) in enumerate(zip(batch, firsts)):
        k, v = kv_of(i, (task.job.kv_token_start, task.num_tokens), task.heads)
        first = _first_token(model, task, token, logits, uniform)
        results.append(PrefillOutput(FirstTokenResult(
            *first, compute_ns, tuple(scores), cached[i] if cached else 0), k, v))
    return results


def _encode(model, batch: list[PrefillTask], blocks: dict | None = None) -> list[tuple]:
    """One context encoding of ``batch`` (rows 0..B-1; blocks: its slot_mapping and
    block_table in a block KV cache): per task (token, last logits, uniform, scores)."""
    jobs = [t.job for t in batch]
    ids, mask, positions, params, rand = batch_inputs(jobs)
    rows = torch.arange(len(batch), dtype=torch.int32)  # [B] cache rows as seq_ids
    blocks = blocks or {}
    scores = [()] * len(batch)
    if any(j.sampling.prompt_logprobs is not None for j in jobs):
        out, scores = _scored(model, batch, ids, mask, positions, rows, rand, blocks)
    else:
        out = model.forward(ids, seq_ids=rows, attention_mask=mask, position_ids=positions,
                            sampling_params=params, rand=rand, **blocks)
    return [(int(out.tokens[i]), out.logits[i], float(rand[i]), scores[i])
            for i in range(len(batch))]


def _encode_rest(model, task: PrefillTask, entry, cache: PrefixCache) -> tuple:
    """A prompt past its cached prefix, in chunked-prefill pieces; (token, last logits,
    uniform, ()) as _encode gives them."""
    sampling, n = task.job.sampling, task.num_tokens
    uniform = next_uniform(request_generator(sampling.seed))  # draw 0, as batch_inputs
    params = torch.tensor([sampling.as_row()], dtype=torch.float32)
    out = None
    for start, end in pieces(entry.reuse, n, cache.sizes):
        rand = torch.tensor([uniform if end == n else 0.0], dtype=torch.float32)
        out = model.forward(**cache.piece_args(entry, start, end), sampling_params=params,
                            rand=rand)
    return int(out.tokens[0]), out.logits[0], uniform, ()


def _first_token(model, task: PrefillTask, token: int, logits, uniform: float):
    """(token, logprob, top logprobs) of a prompt's first token, resampled on the host where the
    device's sampler cannot take the request's options (logit_bias, a constraint, min_tokens'
    banned tokens)."""
    sampling = task.job.sampling
    banned = task.job.banned_first  # min_tokens: the caller's EOS and stop tokens
    if banned or resample_on_host(sampling, 0):
        logits = host_logits(logits, [], sampling, task.constraint, task.job.prompt_ids, banned)
        token = sample_row(logits, sampling, uniform, model_global_topk(model))
    logprob, top = token_logprobs(logits, token, sampling)
    return token, logprob, top


def _scored(model, batch: list[PrefillTask], ids, mask, positions, rows, rand, blocks: dict):
    """A batch with a request that scores its prompt (prompt_logprobs): every position's final
    hidden state (forward_hidden, eager), each row's last logits and first token sampled on the
    host as the device sampler would (sample_row, the row's uniform), and the scores of the
    rows that asked. (CausalLMOutput, per-row scores)."""
    hidden = model.forward_hidden(ids, seq_ids=rows, attention_mask=mask, position_ids=positions,
                                  **blocks)
    scores, logits = [], []
    for i, task in enumerate(batch):
        n, top = task.num_tokens, task.job.sampling.prompt_logprobs
        if top is None:
            scores.append(())
            logits.append(model.lm_logits(hidden[i, n - 1]))
        else:
            row_scores, last = score_positions(model, hidden[i, :n], task.job.prompt_ids[1:], top)
            scores.append(row_scores)
            logits.append(last)
    topk = model_global_topk(model)
    tokens = [sample_row(lg, task.job.sampling, float(rand[i]), topk)
              for i, (lg, task) in enumerate(zip(logits, batch))]
    return CausalLMOutput(logits=torch.stack(logits), tokens=torch.tensor(tokens)), scores


def _resolve(future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    """Set a future's outcome, on its event loop (a future cancelled meanwhile drops it)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def deliver(task: PrefillTask, result=None, error: BaseException | None = None) -> None:
    """Hand a result (or error) to the task's event loop from any thread."""
    try:
        task.loop.call_soon_threadsafe(_resolve, task.future, result, error)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        log.debug("dropped the result of %s: event loop closed", task.job.request_id)


class PrefillEngine:
    """The model, the waiting queue and the one worker thread that runs every CTE batch.

    ``submit`` / ``drop`` / ``counts`` are called from the event loop; the worker thread takes
    batches with ``scheduler.next_batch`` under the same lock. ``on_change(queued, running)`` is
    called (from either thread) whenever those counts change."""

    def __init__(self, model, scheduler: PrefillScheduler,
                 on_change: Callable[[int, int], None] | None = None, runner=None,
                 cache: PrefixCache | None = None):
        """runner: the ComputeThread (nxdi_common.serving.compute) that loaded the model, to run
        the batches on; None: a thread of its own. cache: the prefix cache over the model's
        block KV cache (None: a flat KV cache, every prompt computed whole)."""
        rows = model.neuron_config.max_batch_size
        if scheduler.ctx_batch_size > rows:
            raise ValueError(f"ctx_batch_size {scheduler.ctx_batch_size} exceeds the KV cache's "
                             f"{rows} rows (max_batch_size); raise max_batch_size")
        self.model, self.scheduler, self.cache = model, scheduler, cache
        self.on_change = on_change or (lambda queued, running: None)
        self.running = 0  # prompts in the batch being encoded
        self.running_tokens = 0  # and the prompt tokens they compute
        self.running_since = 0.0  # when that batch began (time.perf_counter())
        self.rate = PrefillRate()  # measured over the batches run
        self._cond = threading.Condition()
        self._stopping = False
        self._runner = runner
        self._done = None  # the worker loop's future (compute.run_loop), once started

    def start(self) -> None:
        """Start the worker loop (idempotent)."""
        if self._done is None:
            self._done = run_loop(self._loop, self._runner, "prefill-engine")

    def stop(self, timeout: float | None = None) -> None:
        """Stop the worker thread after its current batch; waiting requests fail UNAVAILABLE."""
        with self._cond:
            self._stopping = True
            waiting, self.scheduler.waiting = self.scheduler.waiting, []
            self._cond.notify_all()
        for task in waiting:
            deliver(task, error=Unavailable("prefill worker is shutting down"))
        if self._done is not None:
            concurrent.futures.wait([self._done], timeout)

    def submit(self, job: PrefillJob, heads: tuple[int, int], constraint=None) -> PrefillTask:
        """Queue a validated job (Overloaded when the queue is full); await ``task.future``.
        constraint: the job's compiled structured output (structured.TokenConstraint), if any."""
        loop = asyncio.get_running_loop()
        task = PrefillTask(job, heads, loop, loop.create_future(), constraint=constraint,
                           cached_tokens=self._cached_tokens(job))
        with self._cond:
            if self._stopping:
                raise Unavailable("prefill worker is shutting down")
            self.scheduler.add(task)
            self._cond.notify()
            self._changed()
        return task

    def _cached_tokens(self, job: PrefillJob) -> int:
        """The job's prompt tokens the prefix cache holds (0 without one, or for a prompt to
        score, which runs whole): the router counts the rest as this worker's work ahead."""
        if self.cache is None:
            return 0
        return self.cache.cached_tokens(job.prompt_ids, whole=job.sampling.prompt_logprobs
                                        is not None, salt=job.cache_salt)

    def drop(self, task: PrefillTask) -> None:
        """Forget ``task``: off the queue if still waiting, its result discarded if running."""
        if not task.future.done():
            task.future.cancel()
        with self._cond:
            if self.scheduler.remove(task):
                self._changed()

    def counts(self) -> tuple[int, int, int, int]:
        """(queued requests, queued prompt tokens, running sequences, running prompt tokens
        still to compute: estimated from the batch's time so far at the measured rate)."""
        with self._cond:
            left = self.rate.left(self.running_tokens, time.perf_counter() - self.running_since)
            return (len(self.scheduler.waiting), self.scheduler.queued_prompt_tokens,
                    self.running, left)

    def _changed(self) -> None:
        """Report the counts (call with the lock held)."""
        self.on_change(len(self.scheduler.waiting), self.running)

    def _next(self) -> list[PrefillTask] | None:
        """Block until there is a batch (None once stopping)."""
        with self._cond:
            while not self._stopping and not self.scheduler.waiting:
                self._cond.wait()
            if self._stopping:
                return None
            batch = self.scheduler.next_batch()
            for task in batch:  # this thread allocates: the estimate is exact now
                task.cached_tokens = self._cached_tokens(task.job)
            self.running = len(batch)
            self.running_tokens = sum(t.tokens_to_compute for t in batch)
            self.running_since = time.perf_counter()
            self._changed()
            return batch

    def _loop(self) -> None:
        while (batch := self._next()) is not None:
            self._run(batch)

    def _run(self, batch: list[PrefillTask]) -> None:
        """Run one batch and deliver its results (nothing of it stays referenced here)."""
        try:
            results = run_batch(self.model, batch, self.cache)
            computed = sum(t.num_tokens for t in batch) - sum(r.first.cached_tokens
                                                              for r in results)
            seconds = time.perf_counter() - self.running_since
            self.rate.add(computed, seconds)
            with self._cond:
                self.scheduler.observe(batch, seconds)
            for task, result in zip(batch, results):
                deliver(task, result)
        except Exception as exc:  # noqa: BLE001 - reported to every request of the batch
            log.exception("prefill batch failed")
            for task in batch:
                deliver(task, error=exc)
        finally:
            with self._cond:
                self.running = self.running_tokens = 0
                self._changed()
