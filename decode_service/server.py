"""The decode worker's gRPC server: Decode.Generate and Decode.GetLoad.

Generate: validate -> reserve blocks (or RESOURCE_EXHAUSTED) -> pull the prompt's KV from the
ranked prefill candidates (or prefill locally) -> stream one TokenEvent per token from the engine.
Whatever happens to the stream (finish, error, cancellation, deadline) the sequence is dropped and
its blocks freed in the handler's ``finally``."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from decode_service import convert
from decode_service.engine import DecodeEngine
from decode_service.kv_pull import KVPuller
from nxdi_common.serving import types as t
from nxdi_common.serving.convert import cache_report_for
from nxdi_common.serving.handoff import LoopHandoff
from nxdi_common.serving.structured import compile_constraint

log = logging.getLogger(__name__)


class DecodeServicer(convert.DecodeServicerBase):
    def __init__(self, engine: DecodeEngine, puller: KVPuller, limits: t.ModelLimits,
                 fingerprint, local_prefill_max_tokens: int, metrics=None, grammars=None,
                 local_prefill_uncached_tokens: int = 0):
        self.engine, self.puller, self.limits = engine, puller, limits
        self.fingerprint, self.local_max = fingerprint, local_prefill_max_tokens
        self.local_uncached_max = local_prefill_uncached_tokens
        self.metrics = metrics
        self.grammars = grammars  # structured.GrammarCompiler (None: structured output refused)
        self.address = ""
        self._loop_handoff: LoopHandoff | None = None

    def _handoff(self) -> LoopHandoff:
        """The running loop's handoff (one for all streams: a step's events, one wake-up)."""
        loop = asyncio.get_running_loop()
        if self._loop_handoff is None or self._loop_handoff.loop is not loop:
            self._loop_handoff = LoopHandoff(loop)
        return self._loop_handoff

    async def _admit(self, request, emit):
        try:
            job = convert.job_from_proto(request)
            t.check_prompt(job.prompt_ids, self.limits, "prompt_token_ids")
            t.check_sampling(job.sampling, self.limits, "sampling_params.logit_bias")
            max_tokens = t.resolve_max_tokens(len(job.prompt_ids), job.stop, self.limits)
            constraint = await compile_constraint(self.grammars, job.sampling)
        except ValueError:
            self._count("invalid")
            raise
        try:
            return self.engine.admit(job, max_tokens, emit, constraint)
        except Exception:
            self._count("rejected")
            raise

    async def Generate(self, request, context):
        handoff, events = self._handoff(), asyncio.Queue()
        seq = await self._admit(request, lambda item: handoff.post(events.put_nowait, item))
        task, outcome = None, "cancelled"
        try:
            # taken: a router waiting for room lets its next request try now, not at our first
            # token (a prefill away)
            await context.send_initial_metadata(((t.ADMITTED_METADATA_KEY, "1"),))
            task = self._start_prefill(seq, events)
            async for event in self._stream(seq, events):
                yield event
            outcome = "ok"
        except Exception:
            outcome = "error"
            raise
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            self.engine.drop(seq)
            self._count(outcome)

    def _start_prefill(self, seq, events: asyncio.Queue):
        if self._prefills_here(seq):
            self._submit_local(seq)
            return None
        return asyncio.create_task(self._pull(seq, events))

    def _prefills_here(self, seq) -> bool:
        """No prefill worker was offered, the prompt is short, or this worker's prefix cache
        holds all but a few of its tokens, and at least as many as it lacks: here only the rest
        is computed, where a prefill worker would compute the whole prompt again unless its own
        prefix cache (--prefix-cache-blocks) holds it, and send the rest's KV over. (The second condition keeps a short chat that shares only the chat
        template's first block with others on the prefill worker.) A prompt to score
        (prompt_logprobs) is computed whole wherever it runs: its cache counts for nothing."""
        if not seq.job.prefill_candidates or seq.prompt_len <= self.local_max:
            return True
        cached = 0 if seq.scored else seq.num_cached_tokens
        uncached = seq.prompt_len - cached
        return uncached <= min(self.local_uncached_max, cached)

    async def _pull(self, seq, events: asyncio.Queue) -> None:
        try:
            if await self.puller.pull(seq, seq.job.prefill_candidates):
                self.engine.mark_prompt_ready(seq)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the stream, which raises it
            if seq.job.local_prefill_fallback and not seq.generated:
                log.warning("%s; prefilling %s locally", exc, seq.request_id)
                self._submit_local(seq)
            else:
                events.put_nowait(exc)

    def _submit_local(self, seq) -> None:
        if self.metrics is not None:
            self.metrics.local_prefills_total.inc()
        self.engine.submit_local_prefill(seq)

    async def _stream(self, seq, events: asyncio.Queue):
        last_ns = seq.arrival_ns
        while True:
            item = await events.get()
            if isinstance(item, Exception):
                raise item
            now = time.monotonic_ns()
            self._observe_token(item.index, (now - last_ns) / 1e9)
            last_ns = now
            yield convert.token_event(item)
            if item.finish_reason is not None:
                if self.metrics is not None:
                    self.metrics.e2e_request_latency_seconds.observe(
                        (now - seq.arrival_ns) / 1e9)
                return

    def _observe_token(self, index: int, seconds: float) -> None:
        if self.metrics is None:
            return
        hist = self.metrics.time_to_first_token_seconds if index == 0 else \
            self.metrics.inter_token_latency_seconds
        hist.observe(seconds)
        self.metrics.generated_tokens_total.inc()

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.requests_total.labels(outcome=outcome).inc()

    async def GetLoad(self, request, context):
        cfg = self.engine.config
        return convert.worker_load(
            self.address, self.fingerprint, self.engine.load(), cfg.max_batch_size,
            cfg.block_size, self.puller.open_transfers,
            cache_report_for(request, self.engine.blocks.journal))
