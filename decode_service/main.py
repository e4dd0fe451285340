"""Command line and process wiring of the decode worker."""
from __future__ import annotations

import argparse
import asyncio
import logging

from decode_service import convert
from decode_service.background_prefill import parse_nice
from decode_service.engine import PACE_STRETCH, DecodeEngine, EngineConfig
from decode_service.kv_pull import KVPuller, PrefillChannels
from decode_service.server import DecodeServicer
from nxdi_common import kv_transfer
from nxdi_common.bucketing import parse_buckets, validate_buckets
from nxdi_common.serving import grpc_server, worker
from nxdi_common.serving.compute import ComputeThread
from nxdi_common.serving.metrics import ServingMetrics
from nxdi_common.serving.types import ModelLimits

log = logging.getLogger("decode_service")
# Tokens of a local prefill per piece. SmolLM2-135M, bfloat16, one core of the AMD Zen 4 VM: a
# 1792-token prompt takes 1.04x its one-pass time in 256-token pieces (0.35-0.64 s each) and
# 1.13x in 128-token pieces (each piece reads the weights again and runs its own call).
DEFAULT_PREFILL_CHUNK_TOKENS = 256
SMALLEST_DEFAULT_PIECE = 16  # --itl-target-ms's default piece sizes: 16, 32, ... then the chunk
# Without a target: one smaller size, so a short piece (a cached prefix's remainder, a long
# prompt's last piece) is not padded to the whole chunk (BENCHMARKS.md, serving, session 36)
SHORT_PIECE = 64
# A long prompt's KV (30 MB, 1700 tokens of SmolLM2 in bf16) takes ~11 ms of the decode core's
# CPU to receive, check and write; at nice 5 a decode step beside it went 12.5 -> 17.6 ms at the
# median (BENCHMARKS.md, issue 4, session 61), where at nice 0 the core is split evenly.
DEFAULT_KV_RECEIVE_NICE = 5


def default_piece_sizes(chunk: int) -> tuple[int, ...]:
    """Powers of two from SMALLEST_DEFAULT_PIECE below `chunk`, then `chunk`."""
    sizes, c = [], SMALLEST_DEFAULT_PIECE
    while c < chunk:
        sizes.append(c)
        c *= 2
    return (*sizes, chunk)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m decode_service",
                                description="Decode worker: token generation with continuous "
                                            "batching over a block KV cache.")
    worker.add_server_args(p)
    worker.add_model_args(p)
    _add_batch_args(p.add_argument_group("running batch and KV cache"))
    p.add_argument("--local-prefill-max-tokens", type=int, default=0,
                   help="prompts up to this length are prefilled here, not pulled")
    p.add_argument("--local-prefill-uncached-tokens", type=int, default=64, metavar="N",
                   help="a prompt whose leading blocks are in this worker's prefix cache is "
                        "prefilled here when at most N of its tokens are not, and no more than "
                        "are (a prefill worker would compute all of them again); 0: never for "
                        "that reason")
    p.add_argument("--split-call-cost", type=int,
                   default=EngineConfig.split_call_cost_row_tokens, metavar="ROW_TOKENS",
                   help="fixed cost of one more token-generation call, in row-tokens of "
                   "attention: a step runs short and long sequences apart when that saves more")
    p.add_argument("--hold-first-token", action="store_true",
                   help="send a prompt's first token when its sequence joins the running batch, "
                   "one step before its second, instead of as soon as the prefill has it: the "
                   "first inter-token gap is then one step, not the KV transfer, the wait for "
                   "the batch and a step, and the time to first token grows by as much")
    p.add_argument("--log-steps", action="store_true",
                   help="log a line for every decode step (logger decode_service.steps): its "
                   "wall-clock end, seconds, rows and calls, the paced pause before it, the "
                   "local prompts waiting and the tokens of a prompt piece computed in the same "
                   "call (mixed steps; 0 for plain ones); to line a client's token gaps up with "
                   "the steps")
    _add_local_prefill_args(p.add_argument_group("local prefill"))
    p.add_argument("--max-chunk-bytes", type=int, default=kv_transfer.DEFAULT_MAX_CHUNK_BYTES)
    p.add_argument("--kv-socket", choices=("on", "off"), default="on",
                   help="take prompt KV over the prefill worker's direct TCP connection when it "
                        "offers one (the gRPC stream stays the control path); off: on the "
                        "stream only")
    p.add_argument("--kv-receive-nice", type=int, default=DEFAULT_KV_RECEIVE_NICE, metavar="N",
                   help="OS nice value (0-19) of the threads that receive prompt KV over the KV "
                   "socket and write it into the cache: on the decode worker's core the kernel "
                   "shares the core between them and the decode steps by weight (nice 5: the "
                   "steps keep ~3/4 of it while a long prompt's KV arrives, nice 0: half) "
                   f"(default {DEFAULT_KV_RECEIVE_NICE})")
    p.add_argument("--kv-pull-timeout-seconds", type=float, default=600.0)
    args = p.parse_args(argv)
    if args.local_prefill_uncached_tokens < 0:
        p.error(f"--local-prefill-uncached-tokens must be >= 0, got "
                f"{args.local_prefill_uncached_tokens}")
    return args


def _add_batch_args(p) -> None:
    p.add_argument("--max-batch-size", type=int, default=8, help="largest running batch")
    p.add_argument("--batch-buckets", type=parse_buckets, default=None, metavar="N,N,...",
                   help="the running batch sizes a decode step is padded to (one graph each), "
                   "ascending, ending at --max-batch-size; default: 1, 2, 4, 8, then every "
                   "doubling in four steps (10, 12, 14, 16, 20, ...), so a step of more than 8 "
                   "rows pads under a quarter of them")
    p.add_argument("--kv-blocks", type=int, default=512, help="KV cache blocks")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--reserve-max-tokens", action="store_true",
                   help="reserve KV blocks for prompt + max_tokens at admission: never preempts "
                   "a running sequence, but fewer requests run at once (a request without "
                   "max_tokens reserves the rest of --max-model-len); default: blocks as tokens "
                   "come, the newest sequence preempted (KV kept in host memory) when none is "
                   "free")


def _add_local_prefill_args(p) -> None:
    """How a prompt prefilled here is cut into pieces between decode steps, and the targets
    that size and hold back those pieces (engine module doc)."""
    p.add_argument("--prefill-chunk-tokens", type=int, default=DEFAULT_PREFILL_CHUNK_TOKENS,
                   metavar="N", help="a prompt prefilled here runs N tokens at a time, one piece "
                   "between two decode steps, so running sequences wait for one piece instead of "
                   "the whole prefill; 0: the whole prompt at once")
    p.add_argument("--local-prefill-nice", default=None, metavar="N|idle",
                   help="run local prefills (short prompts the router keeps here, aggregated "
                   "mode's prompts) on a thread of their own at OS nice N (0-19) beside the "
                   "decode steps, which keep most of the core (nice 5: ~3/4; 'idle': Linux's "
                   "SCHED_IDLE, all of it while a step runs) so that running "
                   "streams' inter-token gaps grow by a share instead of by whole pieces "
                   "(decode_service/background_prefill.py); default: pieces between the steps "
                   "(the TPOT and TTFT targets below apply only then; --itl-target-ms paces "
                   "the steps instead: while a local prefill runs the steps end about MS apart, "
                   "the time between going to the prefill; with 'idle' that is all the prefill "
                   "gets while streams run)")
    p.add_argument("--tpot-target-ms", type=float, default=None, metavar="MS",
                   help="a local prefill piece waits while it would put a running sequence over "
                   "this time per output token that it would otherwise meet (e.g. the TPOT SLO), "
                   "and a prompt sent to hold the steps (the router's "
                   "--local-prefill-hold-ttft-seconds) holds them only while every running "
                   "sequence would still end within 90%% of it; default: a piece every step "
                   "while a prompt waits, holds limited only by time")
    p.add_argument("--itl-target-ms", type=float, default=None, metavar="MS",
                   help="with sequences running, a local prefill piece is sized so that the step "
                   "it rides in stays within MS: the largest of --piece-sizes whose measured "
                   "cost fits (the smallest if none does; a prompt always advances); default: "
                   "every piece --prefill-chunk-tokens")
    p.add_argument("--ttft-target-ms", type=float, default=None, metavar="MS",
                   help="with --itl-target-ms: a local prefill piece is made larger (with "
                   "--local-prefill-nice: the paced gap longer, up to --pace-stretch times the "
                   "ITL target) where "
                   "the waiting local prompts would otherwise miss this time to first token from "
                   "their arrival (e.g. the TTFT SLO); default: the ITL target alone")
    p.add_argument("--pace-stretch", type=float, default=PACE_STRETCH, metavar="X",
                   help="with --local-prefill-nice, --itl-target-ms and --ttft-target-ms: the "
                   "paced gap grows for the local prompts' deadlines to at most X times the ITL "
                   "target (or the step, if longer); 1: never past the target, the inter-token "
                   f"gap kept at the cost of the local prompts' TTFT (default {PACE_STRETCH:g})")
    p.add_argument("--piece-sizes", type=parse_buckets, default=None, metavar="N,N,...",
                   help="the lengths a local prefill piece is padded to (one chunked-prefill "
                   "and one mixed sub-model is built for each), ascending, ending at "
                   "--prefill-chunk-tokens; default with --itl-target-ms: 16, 32, 64, ... and "
                   "--prefill-chunk-tokens, else 64 and --prefill-chunk-tokens")


def _check_args(args) -> None:
    """SystemExit naming the flag for a value the worker cannot run with; parses
    --local-prefill-nice in place."""
    for flag, value in (("--tpot-target-ms", args.tpot_target_ms),
                        ("--itl-target-ms", args.itl_target_ms),
                        ("--ttft-target-ms", args.ttft_target_ms)):
        if value is not None and not value > 0:
            raise SystemExit(f"{flag} must be > 0 milliseconds, got {value}")
    if not 0 <= args.kv_receive_nice <= 19:
        raise SystemExit(f"--kv-receive-nice must be an integer from 0 to 19, got "
                         f"{args.kv_receive_nice}")
    if not 1 <= args.pace_stretch <= 10:
        raise SystemExit(f"--pace-stretch must be from 1 to 10 (1: the paced gap never passes "
                         f"--itl-target-ms), got {args.pace_stretch:g}")
    if args.prefill_chunk_tokens < 0:
        raise SystemExit(f"--prefill-chunk-tokens must be >= 0 (0: no chunking), got "
                         f"{args.prefill_chunk_tokens}")
    try:
        args.local_prefill_nice = parse_nice(args.local_prefill_nice)
    except ValueError as exc:
        raise SystemExit(f"--local-prefill-nice: {exc}") from None


def build(args):
    """(servicer, engine, channels, metrics) for the parsed arguments."""
    _check_args(args)
    opts = worker.model_options_from_args(args)
    nc = worker.decode_neuron_config(opts, args.max_batch_size, args.kv_blocks, args.block_size,
                                     args.prefill_chunk_tokens, _piece_sizes(args),
                                     _batch_buckets(args))
    # the model loads, and the engine loop runs, on one thread (nxdi_common/serving/compute.py)
    compute = ComputeThread(opts.threads, "decode-engine")
    model = compute.call(worker.load_model, opts, nc)
    tokenizer = worker.load_tokenizer(opts)
    fingerprint = worker.model_fingerprint(model, opts)
    metrics = ServingMetrics("decode")
    config = EngineConfig(args.max_batch_size, args.kv_blocks, args.block_size,
                          not args.no_prefix_caching, args.split_call_cost,
                          *(None if ms is None else ms / 1000 for ms in (
                              args.tpot_target_ms, args.itl_target_ms, args.ttft_target_ms)),
                          reserve_max_tokens=args.reserve_max_tokens,
                          local_prefill_nice=args.local_prefill_nice,
                          hold_first_token=args.hold_first_token,
                          pace_stretch=args.pace_stretch, log_steps=args.log_steps)
    engine = DecodeEngine(model, tokenizer, worker.eos_token_ids(opts.model_dir()), config,
                          metrics, runner=compute)
    channels = PrefillChannels(kv_transfer.max_message_bytes(args.max_chunk_bytes))
    puller = KVPuller(engine, channels, fingerprint, args.max_chunk_bytes, metrics,
                      args.kv_pull_timeout_seconds, kv_socket=args.kv_socket == "on",
                      receive_nice=args.kv_receive_nice)
    limits = ModelLimits(opts.max_model_len, model.config.vocab_size)
    servicer = DecodeServicer(engine, puller, limits, fingerprint,
                              args.local_prefill_max_tokens, metrics,
                              worker.grammar_compiler(opts, limits.vocab_size, tokenizer),
                              args.local_prefill_uncached_tokens)
    return servicer, engine, channels, metrics


def _piece_sizes(args) -> tuple[int, ...] | None:
    """The checked --piece-sizes, or their default (None: the chunk alone)."""
    chunk = args.prefill_chunk_tokens
    chunked = 0 < chunk < args.max_model_len
    if args.piece_sizes is None:
        if not chunked:
            return None
        if args.itl_target_ms and args.local_prefill_nice is None:  # else it paces steps
            return default_piece_sizes(chunk)
        return (SHORT_PIECE, chunk) if chunk > SHORT_PIECE else None
    if not chunked:
        raise SystemExit(f"--piece-sizes needs local prefill in pieces: --prefill-chunk-tokens "
                         f"between 1 and --max-model-len - 1, got {chunk}")
    return tuple(_buckets_ending_at(args.piece_sizes, chunk, "--piece-sizes",
                                    "--prefill-chunk-tokens"))


def _batch_buckets(args) -> list[int] | None:
    """The checked --batch-buckets (None: decode_batch_buckets' default)."""
    if args.batch_buckets is None:
        return None
    return _buckets_ending_at(args.batch_buckets, args.max_batch_size, "--batch-buckets",
                              "--max-batch-size")


def _buckets_ending_at(buckets, end: int, flag: str, end_flag: str) -> list[int]:
    """validate_buckets' checks, and the last bucket `end`; SystemExit naming `flag`."""
    try:
        buckets = validate_buckets(buckets, end, flag, end_flag)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if buckets[-1] != end:
        raise SystemExit(f"{flag} must end at {end_flag} ({end}), got {buckets}")
    return buckets


async def serve(args) -> None:
    servicer, engine, channels, metrics = build(args)
    engine.start()
    server = grpc_server.GrpcServer(
        [(convert.add_servicer, servicer, convert.SERVICE_NAME)],
        kv_transfer.max_message_bytes(args.max_chunk_bytes))
    port = await server.start(args.host, args.port)
    servicer.address = f"{args.host}:{port}"
    metrics_port = metrics.start_http_server(args.host, args.metrics_port)

    async def stop():
        await server.stop(5.0)

    grpc_server.install_shutdown(asyncio.get_running_loop(), stop)
    grpc_server.freeze_startup_heap("decode")
    grpc_server.print_ready("decode", grpc=servicer.address,
                            metrics=f"{args.host}:{metrics_port}")
    await server.wait_for_termination()
    engine.stop()
    await channels.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    worker.apply_nice(args.nice)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s decode %(levelname)s %(name)s: %(message)s")
    worker.apply_wakeup_slice(args.wakeup_slice_us)
    asyncio.run(serve(args))
    return 0
