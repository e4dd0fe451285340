"""The prefill worker's gRPC service (``nxdi.serving.v1.Prefill``) and its command line.

``Prefill`` validates a request (the model fingerprint first), queues it on the engine, then
streams: one first_token event as soon as context encoding is done, the request's KV in chunks,
and one done event. Whatever the worker holds for a request (its queue entry, its KV copy) is
freed when the stream ends, however it ends. Handlers raise; the StatusInterceptor maps errors to
status codes."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass

from nxdi_common import kv_transfer
from nxdi_common.cache_journal import CacheJournal
from nxdi_common.kv_transfer import ModelFingerprint, fingerprint_mismatch
from nxdi_common.serving import kv_socket as kvs
from nxdi_common.serving import worker
from nxdi_common.serving.compute import ComputeThread
from nxdi_common.serving.convert import cache_report_for
from nxdi_common.serving.errors import FailedPrecondition, InvalidRequest, Overloaded
from nxdi_common.serving.grpc_server import (GrpcServer, freeze_startup_heap, install_shutdown,
                                              print_ready)
from nxdi_common.serving.metrics import ServingMetrics
from nxdi_common.serving.structured import compile_constraint
from nxdi_common.serving.types import ModelLimits, PrefillJob, check_prompt, check_sampling
from prefill_service import convert
from prefill_service.prefix_cache import PrefixCache
from prefill_service.scheduler import (DEFAULT_TTFT_TARGET_S, ORDERS, LoadReport, PrefillEngine,
                                       PrefillOutput, PrefillScheduler, PrefillTask, check_order)

log = logging.getLogger("prefill_service")


# 16,384 tokens of 16: on the bundled model in bfloat16 (23 KB of K+V a token) 377 MB.
DEFAULT_PREFIX_CACHE_BLOCKS = 1024


@dataclass(frozen=True)
class PrefillSettings:
    """Capacity of a prefill worker."""

    max_batch_size: int = 4  # KV cache rows
    ctx_batch_size: int = 4  # prompts per CTE batch
    max_queued_requests: int = 64  # admitted, waiting prompts; more are refused
    max_chunk_bytes: int = kv_transfer.DEFAULT_MAX_CHUNK_BYTES  # K+V payload per KV chunk
    # Padded prompt tokens a CTE batch of several prompts may hold (one prompt always runs):
    # longer prompts are encoded alone, and only these batch buckets are traced and warmed up.
    max_batch_tokens: int = 2048
    # KV chunks on a direct TCP connection when the decode worker accepts that (kv_socket):
    # on/off, its port (0: a free one), how long an offer waits to be claimed, and the least
    # K+V payload worth a connection (setting one up costs ~1.5 ms here; the stream moves a
    # short prompt's KV sooner: bench/bench_kv_transfer.py --short-prompts).
    kv_socket: bool = True
    kv_socket_port: int = 0
    kv_socket_accept_seconds: float = kvs.DEFAULT_ACCEPT_TIMEOUT_SECONDS
    kv_socket_min_bytes: int = kvs.DEFAULT_MIN_PAYLOAD_BYTES
    # Which waiting prompts go next (scheduler module doc): "arrival" (oldest first) or
    # "shortest" (shortest length bucket first, until the oldest has waited max_overtaken_s) or
    # "deadline" (the oldest that can still be encoded within ttft_target_s, until the same).
    order: str = "arrival"
    max_overtaken_s: float | None = None  # None: the order's default (1 s, or 2x the target)
    # The prefix cache (prefix_cache module doc): KV blocks of block_size tokens that keep the
    # prompts encoded here, so a prompt starting with an earlier one's prefix has only the rest
    # computed. 0: off (a flat KV cache, every prompt computed whole).
    prefix_cache_blocks: int = DEFAULT_PREFIX_CACHE_BLOCKS
    block_size: int = 16
    ttft_target_s: float = DEFAULT_TTFT_TARGET_S

    def __post_init__(self):
        for name in ("max_batch_size", "ctx_batch_size", "max_queued_requests",
                     "max_chunk_bytes", "max_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.prefix_cache_blocks < 0 or self.block_size < 1:
            raise ValueError(f"prefix_cache_blocks must be >= 0 (0: off) and block_size >= 1, "
                             f"got {self.prefix_cache_blocks} and {self.block_size}")
        if not 0 <= self.kv_socket_port <= 65535:
            raise ValueError(f"kv_socket_port must be 0..65535 (0: a free port), got "
                             f"{self.kv_socket_port}")
        if self.kv_socket_min_bytes < 0:
            raise ValueError(f"kv_socket_min_bytes must be >= 0, got {self.kv_socket_min_bytes}")
        if not self.kv_socket_accept_seconds > 0:
            raise ValueError(f"kv_socket_accept_seconds must be > 0, got "
                             f"{self.kv_socket_accept_seconds}")
        # at start-up, before the model loads
        check_order(self.order, self.max_overtaken_s, self.ttft_target_s)
        if self.ctx_batch_size > self.max_batch_size:
            raise ValueError(f"ctx_batch_size {self.ctx_batch_size} exceeds max_batch_size "
                             f"{self.max_batch_size}; raise --max-batch-size")

    def check_prefix_cache(self, max_model_len: int) -> None:
        """ValueError unless the prefix cache (when on) holds any batch these settings allow:
        one prompt of max_model_len tokens, or a batch of max_batch_tokens padded tokens (at
        most ctx_batch_size prompts of max_model_len) with a partly filled last block each."""
        if not self.prefix_cache_blocks:
            return
        def blocks(tokens):
            return -(-tokens // self.block_size)
        batch = min(self.max_batch_tokens, self.ctx_batch_size * max_model_len)
        least = max(blocks(max_model_len), blocks(batch) + self.ctx_batch_size)
        if self.prefix_cache_blocks < least:
            raise ValueError(f"prefix_cache_blocks {self.prefix_cache_blocks} cannot hold a "
                             f"batch: at least {least} blocks of {self.block_size} tokens for "
                             f"max_model_len {max_model_len} and max_batch_tokens "
                             f"{self.max_batch_tokens}")


def check_fingerprint(ours: ModelFingerprint, theirs: ModelFingerprint | None) -> None:
    """FailedPrecondition unless the caller's fingerprint equals ours."""
    if theirs is None:
        raise FailedPrecondition(f"fingerprint: the request carries none; this worker serves "
                                 f"{ours}")
    mismatch = fingerprint_mismatch(ours, theirs)
    if mismatch:
        raise FailedPrecondition(mismatch)


def head_range(job: PrefillJob, num_kv_heads: int) -> tuple[int, int]:
    """The KV heads [h0, h1) to send (0, 0: all of them)."""
    if job.head_start == 0 and job.head_end == 0:
        return 0, num_kv_heads
    if not 0 <= job.head_start < job.head_end <= num_kv_heads:
        raise InvalidRequest("head_start", f"heads [{job.head_start}, {job.head_end}) are not a "
                                           f"non-empty range within the model's {num_kv_heads} "
                                           f"KV heads (0 and 0 mean all)")
    return job.head_start, job.head_end


def chunk_bound(job: PrefillJob, heads: tuple[int, int], fp: ModelFingerprint,
                own_bytes: int) -> int:
    """The chunk payload bound for ``job``: the smaller of the caller's (when set) and ours; it
    must hold the K+V of one token of one layer."""
    bound = min(job.max_chunk_bytes, own_bytes) if job.max_chunk_bytes else own_bytes
    row = 2 * (heads[1] - heads[0]) * fp.head_dim * kv_transfer.DTYPES[fp.kv_dtype].itemsize
    if row > bound:
        raise InvalidRequest("max_chunk_bytes", f"{bound} bytes cannot hold the K+V of one token "
                                                f"of one layer ({row} bytes)")
    return bound


def check_job(job: PrefillJob, limits: ModelLimits, fp: ModelFingerprint,
              own_chunk_bytes: int) -> tuple[tuple[int, int], int]:
    """Validate a job against the model; return its head range and chunk bound."""
    if not job.request_id or len(job.request_id.encode()) > kv_transfer.MAX_REQUEST_ID_BYTES:
        raise InvalidRequest("request_id", f"must be 1..{kv_transfer.MAX_REQUEST_ID_BYTES} "
                                           f"UTF-8 bytes, got {job.request_id!r:.300}")
    check_prompt(job.prompt_ids, limits, "prompt_token_ids")
    check_sampling(job.sampling, limits, "sampling_params.logit_bias")
    bad = [t for t in job.banned_first if not 0 <= t < limits.vocab_size]
    if bad or len(job.banned_first) >= limits.vocab_size:
        raise InvalidRequest("banned_first_token_ids", f"fewer than {limits.vocab_size} ids in "
                                                       f"[0, {limits.vocab_size}), got "
                                                       f"{len(job.banned_first)} ({bad[:3]} out)")
    if job.kv_token_start >= len(job.prompt_ids):
        raise InvalidRequest("kv_token_start", f"{job.kv_token_start} must be below the prompt "
                                               f"length {len(job.prompt_ids)}")
    heads = head_range(job, fp.num_kv_heads)
    return heads, chunk_bound(job, heads, fp, own_chunk_bytes)


def outcome_of(exc: BaseException | None) -> str:
    """The requests_total outcome label of a stream that ended with ``exc``."""
    if exc is None:
        return "ok"
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    if isinstance(exc, Overloaded):
        return "rejected"
    if isinstance(exc, (InvalidRequest, FailedPrecondition)):
        return "invalid"
    return "error"


class PrefillServicer:
    """``nxdi.serving.v1.Prefill``: handlers run on the event loop; torch work on the engine."""

    def __init__(self, engine: PrefillEngine, fingerprint: ModelFingerprint, limits: ModelLimits,
                 metrics: ServingMetrics, settings: PrefillSettings, grammars=None):
        self.engine, self.fingerprint, self.limits = engine, fingerprint, limits
        self.metrics, self.settings = metrics, settings
        self.grammars = grammars  # structured.GrammarCompiler (None: structured output refused)
        self.address = ""  # "host:port", set once bound
        self.open_transfers = 0  # streams sending KV now
        self.kv_socket: kvs.KVSocketServer | None = None  # set when listening
        # what the prefix cache holds, for routers; without a cache an empty journal (a router
        # then knows this worker holds no prefix, rather than guessing from what it sent here)
        self._journal = (engine.cache.blocks.journal if engine.cache is not None
                         else CacheJournal())

    async def Prefill(self, request, context) -> None:  # noqa: N802 - gRPC method name
        """Stream first_token, kv_chunk..., done for one prompt (see the proto)."""
        arrival_ns = time.perf_counter_ns()
        error = None
        try:
            await self._prefill(request, context, arrival_ns)
        except BaseException as exc:
            error = exc
            raise
        finally:
            self.metrics.requests_total.inc(outcome_of(error))

    async def _prefill(self, request, context, arrival_ns: int) -> None:
        """Validate (fingerprint first), queue, stream; the queue entry is dropped however the
        stream ends."""
        check_fingerprint(self.fingerprint, convert.fingerprint_from_request(request))
        job = convert.job_from_proto(request)
        heads, chunk_bytes = check_job(job, self.limits, self.fingerprint,
                                       self.settings.max_chunk_bytes)
        constraint = await compile_constraint(self.grammars, job.sampling)
        task = self.engine.submit(job, heads, constraint)
        try:
            await self._stream(task, context, arrival_ns, chunk_bytes)
        finally:
            self.engine.drop(task)

    async def _stream(self, task: PrefillTask, context, arrival_ns: int, chunk_bytes: int):
        """Wait for the engine's result, then send it; the KV copy is released on the way out."""
        out: PrefillOutput = await task.future
        try:
            await write(context, convert.first_token_event(out.first))
            self.metrics.time_to_first_token_seconds.observe(_seconds_since(arrival_ns))
            self.metrics.prompt_tokens_total.inc(task.num_tokens)
            self.metrics.prefix_cache_hit_tokens_total.inc(out.first.cached_tokens)
            self._count_transfer(+1)
            try:
                done = await self._send_kv(task, out, context, chunk_bytes)
            finally:
                self._count_transfer(-1)
            await write(context, convert.done_event(*done))
            self.metrics.e2e_request_latency_seconds.observe(_seconds_since(arrival_ns))
        finally:
            out.k = out.v = None

    async def _send_kv(self, task: PrefillTask, out: PrefillOutput, context,
                       chunk_bytes: int) -> tuple[int, int, int]:
        """Send the KV chunks; returns (num_chunks, payload_bytes, transfer_ns)."""
        chunks = kv_transfer.encode_chunks(
            task.job.request_id, out.k, out.v, token_start=task.job.kv_token_start,
            head_start=task.heads[0], max_chunk_bytes=chunk_bytes)
        start, count, total = time.perf_counter_ns(), 0, 0
        try:
            payload = 2 * out.k.numel() * out.k.element_size()
            conn = await self._claimed_socket(task, context, payload)
            if conn is not None:
                count, total = await kvs.send(conn, chunks,
                                                    self.metrics.kv_transfer_bytes_total.inc)
            for chunk in chunks:  # one chunk's bytes exist at a time (none left after a socket)
                await write(context, convert.chunk_event(chunk))
                size = len(chunk.k) + len(chunk.v)
                count, total = count + 1, total + size
                self.metrics.kv_transfer_bytes_total.inc(size)
        finally:
            chunks.close()  # releases the generator's hold on the KV tensors at once
        elapsed = time.perf_counter_ns() - start
        self.metrics.kv_transfer_duration_seconds.observe(elapsed / 1e9)
        return count, total, elapsed

    async def _claimed_socket(self, task: PrefillTask, context, payload_bytes: int):
        """Offer the KV socket when the caller accepts one and the payload is worth it; the
        connection that claimed it, or None (no offer, or not claimed in time: the chunks go on
        the stream)."""
        if (self.kv_socket is None or not task.job.accept_kv_socket
                or payload_bytes < self.settings.kv_socket_min_bytes):
            return None
        offer = self.kv_socket.offer()
        try:
            await write(context, convert.kv_socket_event(self.kv_socket.port, offer.token))
        except BaseException:
            self.kv_socket.withdraw(offer)
            raise
        conn = await self.kv_socket.claimed(offer)
        if conn is not None:
            self.metrics.kv_socket_transfers_total.inc()
        else:
            self.metrics.kv_socket_fallbacks_total.inc()
            log.warning("KV socket offer for %s not claimed within %.1f s; sending on the stream",
                        task.job.request_id, self.kv_socket.accept_timeout)
        return conn

    def _count_transfer(self, delta: int) -> None:
        self.open_transfers += delta
        self.metrics.open_kv_transfers.set(self.open_transfers)

    async def GetLoad(self, request, context):  # noqa: N802 - gRPC method name
        """This worker's load report."""
        return convert.load_to_proto(self.load(), cache_report_for(request, self._journal))

    def load(self) -> LoadReport:
        queued, queued_tokens, running, running_tokens = self.engine.counts()
        blocks = self.engine.cache.blocks if self.engine.cache is not None else None
        free = blocks.num_free_blocks if blocks is not None else 0
        return LoadReport(self.address, self.fingerprint, queued_tokens, queued, running,
                          self.settings.ctx_batch_size, self.open_transfers, time.time_ns(),
                          running_tokens, self.engine.rate.tokens_per_s,
                          kv_blocks_used=blocks.num_blocks - free if blocks is not None else 0,
                          kv_blocks_free=free,
                          kv_block_size=blocks.block_size if blocks is not None else 0)


async def write(context, message) -> None:
    """Send one stream message. A send that fails means the stream is gone (the client cancelled
    or the connection broke; grpc reports the cancellation only after the failed send): raise
    CancelledError, which ends the handler as a cancelled stream."""
    try:
        await context.write(message)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - grpc raises its internal ExecuteBatchError here
        raise asyncio.CancelledError(f"stream closed by the peer ({type(exc).__name__})") from exc


def _seconds_since(start_ns: int) -> float:
    return (time.perf_counter_ns() - start_ns) / 1e9


def host_port(host: str, port: int) -> str:
    """"host:port", bracketing an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class PrefillApp:
    """A prefill worker: engine, servicer, gRPC server and metrics around one loaded model."""

    def __init__(self, model, fingerprint: ModelFingerprint, settings: PrefillSettings,
                 metrics: ServingMetrics | None = None, runner=None, grammars=None):
        self.settings = settings
        self.metrics = metrics or ServingMetrics("prefill")
        cte = model.context_encoding_model
        scheduler = PrefillScheduler(cte.length_buckets, settings.ctx_batch_size,
                                     settings.max_queued_requests,
                                     {n: cte.max_batch(n) for n in cte.length_buckets},
                                     settings.order, settings.max_overtaken_s,
                                     ttft_target_s=settings.ttft_target_s)
        nc = model.neuron_config
        cache = None
        if nc.is_block_kv_layout:
            settings.check_prefix_cache(nc.seq_len)
            cache = PrefixCache(model, nc.pa_num_blocks, nc.pa_block_size)
        self.engine = PrefillEngine(model, scheduler, self._on_change, runner, cache)
        limits = ModelLimits(model.neuron_config.seq_len, model.config.vocab_size)
        self.servicer = PrefillServicer(self.engine, fingerprint, limits, self.metrics, settings,
                                        grammars)
        self.grpc: GrpcServer | None = None

    def _on_change(self, queued: int, running: int) -> None:
        """The engine's counts changed (called with its lock held: reads, no calls into it)."""
        self.metrics.queue_depth_requests.set(queued)
        self.metrics.running_sequences.set(running)
        self.metrics.queued_prompt_tokens.set(self.engine.scheduler.queued_prompt_tokens)
        self.metrics.prefill_tokens_per_second.set(self.engine.rate.tokens_per_s)

    async def start(self, host: str, port: int, start_engine: bool = True) -> int:
        """Serve on host:port (0: a free port); returns the bound port. With start_engine False
        requests queue up until ``engine.start()``."""
        max_bytes = kv_transfer.max_message_bytes(
            self.settings.max_chunk_bytes, max_prompt_tokens=self.servicer.limits.max_model_len)
        self.grpc = GrpcServer([(convert.add_servicer, self.servicer, convert.SERVICE_NAME)],
                               max_bytes)
        bound = await self.grpc.start(host, port)
        self.servicer.address = host_port(host, bound)
        if self.settings.kv_socket:
            server = kvs.KVSocketServer(self.settings.kv_socket_accept_seconds)
            await server.start(host, self.settings.kv_socket_port)
            self.servicer.kv_socket = server
        if start_engine:
            self.engine.start()
        return bound

    async def stop(self, grace_seconds: float | None = 10.0) -> None:
        """Refuse new requests, let running streams finish for up to grace_seconds, then stop."""
        if self.grpc is not None:
            await self.grpc.stop(grace_seconds)
        if self.servicer.kv_socket is not None:
            await self.servicer.kv_socket.stop()
        await asyncio.to_thread(self.engine.stop)
        self.metrics.stop_http_server()


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def _add_order_args(g) -> None:
    """--order and its bounds (the scheduler module doc)."""
    g.add_argument("--order", choices=ORDERS, default="arrival",
                   help="which waiting prompts are encoded next: arrival (oldest first), "
                        "shortest (the shortest length bucket first, so short prompts do not "
                        "wait behind long ones) or deadline (the oldest that can still be "
                        "encoded within --ttft-target-seconds of its arrival, at the time "
                        "measured here for its length, so a burst of long prompts makes late "
                        "only those that were late anyway); see --max-overtaken-seconds")
    g.add_argument("--max-overtaken-seconds", type=float, metavar="S",
                   help="with --order shortest or deadline: once the oldest waiting prompt has "
                        "waited S seconds it goes next, whatever its length (bounds a prompt's "
                        "wait; default 1 s for shortest, twice --ttft-target-seconds for "
                        "deadline)")
    g.add_argument("--ttft-target-seconds", type=float, default=DEFAULT_TTFT_TARGET_S,
                   metavar="S",
                   help="with --order deadline: seconds from a prompt's arrival here by which "
                        "its encoding should end (the TTFT SLO less the KV transfer and the "
                        "router's share)")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m prefill_service",
                                description="Prefill worker: context encoding, first token, and "
                                            "the prompt's KV cache streamed to a decode worker.")
    worker.add_server_args(p)
    worker.add_model_args(p)
    p.add_argument("--max-batch-size", type=int, default=4, help="KV cache rows")
    p.add_argument("--ctx-batch-size", type=int, default=4, help="prompts per CTE batch")
    p.add_argument("--max-batch-tokens", type=int, default=2048,
                   help="padded prompt tokens a CTE batch of several prompts may hold; a longer "
                        "prompt is encoded alone (fewer graphs to build and warm up, no gain "
                        "lost: long prompts fill the CPU on their own)")
    p.add_argument("--max-queued-requests", type=int, default=64,
                   help="waiting prompts beyond this are refused (RESOURCE_EXHAUSTED)")
    _add_order_args(p.add_argument_group("queue order"))
    p.add_argument("--prefix-cache-blocks", type=int, default=DEFAULT_PREFIX_CACHE_BLOCKS,
                   metavar="N",
                   help="keep the KV of the prompts encoded here in N blocks of --block-size "
                        "tokens, so a prompt that starts with an earlier one's prefix (a shared "
                        "system prompt or document, earlier chat turns) has only the rest "
                        "computed; least recently used blocks are evicted (0: off, every "
                        "prompt computed whole in a flat KV cache)")
    p.add_argument("--block-size", type=int, default=16,
                   help="tokens per prefix cache block")
    p.add_argument("--max-chunk-bytes", type=int, default=kv_transfer.DEFAULT_MAX_CHUNK_BYTES,
                   help="K+V payload per KV chunk, in bytes")
    p.add_argument("--kv-socket", choices=("on", "off"), default="on",
                   help="offer decode workers a direct TCP connection for the KV chunks (the "
                        "gRPC stream stays the control path); off: chunks on the stream only")
    p.add_argument("--kv-socket-port", type=int, default=0,
                   help="TCP port of the KV socket listener, on --host (0: a free port)")
    p.add_argument("--kv-socket-accept-seconds", type=float,
                   default=kvs.DEFAULT_ACCEPT_TIMEOUT_SECONDS,
                   help="how long an offered KV socket waits for the decode worker to connect "
                        "before the chunks go on the stream instead")
    p.add_argument("--kv-socket-min-bytes", type=int, default=kvs.DEFAULT_MIN_PAYLOAD_BYTES,
                   help="offer the KV socket only for a K+V payload of at least this many bytes "
                        "(a short prompt's KV moves sooner on the stream)")
    p.add_argument("--model-name", help="model name in the fingerprint (default: the "
                                        "checkpoint directory's name)")
    p.add_argument("--grace-seconds", type=float, default=10.0,
                   help="on SIGTERM, how long running streams may take to finish")
    return p.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> PrefillSettings:
    return PrefillSettings(args.max_batch_size, args.ctx_batch_size, args.max_queued_requests,
                           args.max_chunk_bytes, args.max_batch_tokens, args.kv_socket == "on",
                           args.kv_socket_port, args.kv_socket_accept_seconds,
                           args.kv_socket_min_bytes, args.order, args.max_overtaken_seconds,
                           args.prefix_cache_blocks, args.block_size, args.ttft_target_seconds)


def load_app(args: argparse.Namespace) -> PrefillApp:
    """Load the model the arguments name and build the worker around it."""
    settings = settings_from_args(args)
    opts = worker.model_options_from_args(args)
    settings.check_prefix_cache(opts.max_model_len)  # before the model loads
    config = worker.prefill_neuron_config(opts, settings.max_batch_size, settings.ctx_batch_size,
                                          settings.max_batch_tokens, settings.prefix_cache_blocks,
                                          settings.block_size)
    # the model loads, and its batches run, on one thread (nxdi_common/serving/compute.py)
    compute = ComputeThread(opts.threads, "prefill-engine")
    model = compute.call(worker.load_model, opts, config)
    fingerprint = worker.model_fingerprint(model, opts)
    if args.model_name:
        fingerprint = dataclasses.replace(fingerprint, model_name=args.model_name)
    grammars = worker.grammar_compiler(opts, model.config.vocab_size)  # tokenizer on first use
    return PrefillApp(model, fingerprint, settings, runner=compute, grammars=grammars)


async def serve(args: argparse.Namespace) -> None:
    """Load, serve, print the ready line, and run until SIGTERM / SIGINT (graceful stop)."""
    app = load_app(args)
    port = await app.start(args.host, args.port)
    metrics_port = app.metrics.start_http_server(args.host, args.metrics_port)
    stopped = install_shutdown(asyncio.get_running_loop(),
                               lambda: app.stop(args.grace_seconds))
    log.info("prefill worker serving %s, fingerprint %s", app.servicer.address,
             app.servicer.fingerprint)
    extra = {}
    if app.servicer.kv_socket is not None:
        extra["kv_socket"] = host_port(args.host, app.servicer.kv_socket.port)
    freeze_startup_heap("prefill")
    print_ready("prefill", grpc=host_port(args.host, port),
                metrics=host_port(args.host, metrics_port), **extra)
    await stopped.wait()


def main(argv=None) -> int:
    args = parse_args(argv)
    worker.apply_nice(args.nice)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    worker.apply_wakeup_slice(args.wakeup_slice_us)
    asyncio.run(serve(args))
    return 0
