"""``nxdi-bench``: goodput benchmarks of OpenAI-compatible servers.

  nxdi-bench load    --url URL (--rate R | --concurrency C) [--num-requests N]   one run
  nxdi-bench sweep   --url URL                                                    goodput of one server
  nxdi-bench compare [--configs disaggregated,aggregated,vllm-cpu,llama.cpp,replicated] [--quick]
                     starts each configuration itself, sweeps each, writes table + plots

Every command takes --workload {chat,long-context,mixed,shared-prefix}, --seed, --slo-ttft,
--slo-tpot, and writes JSON results (--out / --out-dir) that a later run can be compared with."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from decode_service.background_prefill import parse_nice
from nxdi_bench.arrivals import ARRIVAL_KINDS
from nxdi_bench.client import LoadTarget
from nxdi_bench.configs import AGGREGATED_LOCAL_PREFILL
from nxdi_common.bucketing import parse_buckets
from nxdi_common.serving.launcher_process import parse_cpu_list
from nxdi_common.serving.worker import process_nice as worker_nice
from nxdi_common.serving.worker import wake_interval_ms, wakeup_slice_us
from nxdi_bench.metrics import SLO
from nxdi_bench.runs import Runner, SweepSettings
from nxdi_bench.workloads import WORKLOADS, PromptBuilder, get_workload

# Default SLOs for the bundled 135M chat model on a 2-core CPU (reasons in BENCHMARKS.md):
# a first token within 2 s even behind a 1.8k-token prompt, and >= 10 tokens/s while streaming.
DEFAULT_SLO_TTFT_S = 2.0
DEFAULT_SLO_TPOT_S = 0.100
QUICK_MAX_MODEL_LEN = 512


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="mixed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, default=DEFAULT_SLO_TTFT_S, metavar="SECONDS")
    p.add_argument("--slo-tpot", type=float, default=DEFAULT_SLO_TPOT_S, metavar="SECONDS")
    p.add_argument("--slo-attainment", type=float, default=0.9)
    p.add_argument("--arrivals", choices=ARRIVAL_KINDS, default="poisson")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape: 1 = Poisson, < 1 burstier, > 1 smoother")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="lengths are scaled down to fit when the workload is longer (default "
                   "2048; compare --quick: 512, which its short requests fit, so the servers "
                   "start faster)")
    p.add_argument("--length-scale", type=float, default=1.0,
                   help="multiply every prompt and output length range")


def _target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the bundled model)")
    p.add_argument("--extra-body", default='{"ignore_eos": true}', metavar="JSON",
                   help="extra JSON fields for every request")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    p.add_argument("--no-stream-usage", action="store_true",
                   help="do not ask for usage in the stream (servers that refuse stream_options)")


def _sweep_args(p: argparse.ArgumentParser) -> None:
    d = SweepSettings()
    p.add_argument("--duration", type=float, default=d.duration_s,
                   help="seconds of arrivals per rate point")
    p.add_argument("--min-requests", type=int, default=d.min_requests)
    p.add_argument("--max-requests", type=int, default=d.max_requests)
    p.add_argument("--start-rate", type=float, default=d.start_rate)
    p.add_argument("--max-rate", type=float, default=d.max_rate)
    p.add_argument("--min-rate", type=float, default=d.min_rate)
    p.add_argument("--bisect-steps", type=int, default=d.bisect_steps)
    p.add_argument("--unloaded-requests", type=int, default=d.unloaded_requests)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nxdi-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("load", help="one run at a rate (open loop) or a concurrency (closed loop)")
    _common(p)
    _target_args(p)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--rate", type=float, help="requests/s (open loop)")
    g.add_argument("--concurrency", type=int, help="requests in flight (closed loop)")
    p.add_argument("--num-requests", type=int, default=50)
    p.add_argument("--out", type=Path, help="results JSON")

    p = sub.add_parser("sweep", help="goodput of one running server")
    _common(p)
    _target_args(p)
    _sweep_args(p)
    p.add_argument("--out", type=Path, help="results JSON")

    p = sub.add_parser("compare", help="start each configuration, sweep it, write table and plots")
    _common(p)
    _sweep_args(p)
    p.add_argument("--configs", default=None,
                   help="comma-separated, of disaggregated, aggregated, vllm-cpu, llama.cpp "
                        "and replicated (one decode worker per CPU); default: the first four "
                        "(with --quick: disaggregated and aggregated)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: short lengths, two short rate points, under two minutes")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="default: results/goodput/<workload>-<date>")
    p.add_argument("--cdf-rate", type=float, help="rate whose runs the CDF plots show "
                   "(default: the highest rate every configuration ran)")
    _server_args(p.add_argument_group("servers"))
    local = p.add_argument_group("local prefill (ours)")
    _local_prefill_args(local)
    _aggregated_args(local)
    return parser


def _server_args(g) -> None:
    """compare: what each configuration serves, and where."""
    g.add_argument("--model", help="HF checkpoint directory (default: the bundled SmolLM2)")
    g.add_argument("--gguf", help="GGUF file for llama.cpp (default: the bundled one)")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    g.add_argument("--backend", choices=("compiled", "eager"), default="compiled")
    g.add_argument("--compiled-root")
    g.add_argument("--quantize", choices=("int8",), help="our configurations' weights as int8 "
                   "(the peers serve the checkpoint's own dtype)")
    g.add_argument("--context-buckets", type=parse_buckets, metavar="N,N,...",
                   help="our workers' prompt-length buckets, ending at --max-model-len")
    g.add_argument("--cpus", help="comma-separated CPU ids every configuration shares "
                   "(default: the first two this process may use)")
    g.add_argument("--router-cpus", type=_cpu_list, default=None, metavar="CPUS",
                   help="pin our router to these CPU ids, e.g. the prefill worker's (the first "
                        "of --cpus); default: not pinned, it runs where the OS puts it")
    g.add_argument("--router-nice", type=worker_nice, default=None, metavar="N",
                   help="our router's OS nice value (0-19; --nice), e.g. below the decode "
                        "worker whose core it shares (default: unchanged)")
    g.add_argument("--router-wake-ms", type=wake_interval_ms, default=0.0, metavar="MS",
                   help="our router's --wake-ms: its event loop woken every MS ms so that, on "
                        "a core shared with a prefill worker, its threads run sooner than the "
                        "kernel's next tick (default 0: off)")
    g.add_argument("--client-cpus", type=_cpu_list, default=None, metavar="CPUS",
                   help="pin this load generator (all its threads, the ones reading the "
                        "services' output too) to these CPU ids while it drives a "
                        "configuration (every configuration alike); default: not pinned")
    g.add_argument("--client-slice-us", type=wakeup_slice_us, default=0, metavar="US",
                   help="this load generator's threads' scheduler slice in microseconds while "
                        "it drives a configuration (every configuration alike; Linux 6.12+), "
                        "meant to wake a client thread sharing a server's core sooner; "
                        "BENCHMARKS.md issue 4 session 74 measured no change in late "
                        "deliveries with it; 0 (default): the kernel's")
    g.add_argument("--decode-max-batch-size", type=int, default=16)
    g.add_argument("--decode-batch-buckets", type=parse_buckets, default=None, metavar="N,N,...",
                   help="our decode workers' --batch-buckets (the running batch sizes a step is "
                        "padded to, ending at --decode-max-batch-size); default: the workers'")
    g.add_argument("--kv-blocks", type=int, default=1024)
    # the prefill worker's ORDERS (prefill_service.scheduler imports torch; a test keeps the two
    # equal)
    g.add_argument("--prefill-order", choices=("arrival", "shortest", "deadline"),
                   help="disaggregated: the prefill worker's --order (arrival: oldest prompt "
                        "first; shortest: shortest first; deadline: the oldest that can still "
                        "be encoded within --prefill-ttft-target; a prompt overtaken for at "
                        "most --prefill-max-overtaken; default: the worker's)")
    g.add_argument("--prefill-max-overtaken", type=float, metavar="SECONDS",
                   help="disaggregated: the prefill worker's --max-overtaken-seconds")
    g.add_argument("--prefill-ttft-target", type=float, metavar="SECONDS",
                   help="disaggregated: the prefill worker's --ttft-target-seconds")
    g.add_argument("--prefill-nice", type=worker_nice, metavar="N",
                   help="disaggregated: the prefill worker's --nice (0-19), below a router "
                        "pinned to its core (--router-cpus); default: unchanged")


def _cpu_list(text: str) -> list[int]:
    """--router-cpus, --client-cpus: "0" or "0,2-3", CPUs this process may use."""
    try:
        cpus = parse_cpu_list(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad CPU list {text!r} (use e.g. 0 or 0,2-3)") from None
    allowed = os.sched_getaffinity(0)
    if not set(cpus) <= allowed:
        raise argparse.ArgumentTypeError(f"CPUs {sorted(set(cpus) - allowed)} are not available "
                                         f"to this process (available: {sorted(allowed)})")
    return cpus


def _nice(text: str) -> int | str:
    """--decode-local-prefill-nice: what the decode worker's --local-prefill-nice takes."""
    try:
        return parse_nice(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _local_prefill_args(g) -> None:
    """compare: the disaggregated router's local prefill rule and our decode workers' pieces."""
    g.add_argument("--local-prefill-max-tokens", type=int, default=0, metavar="N",
                   help="disaggregated: the router's conditional disaggregation (prompts of at "
                        "most N tokens prefilled by the decode worker while the prefill worker is "
                        "busy; 0: off)")
    g.add_argument("--local-prefill-queue-tokens", type=int, default=0, metavar="Q",
                   help="disaggregated: the prefill worker counts as busy with at least Q "
                        "prompt tokens queued or being prefilled")
    g.add_argument("--local-prefill-always-tokens", type=int, default=0, metavar="A",
                   help="disaggregated: prompts of at most A tokens are always prefilled by the "
                        "decode worker")
    g.add_argument("--local-prefill-hold-ttft", type=float, default=0.0, metavar="SECONDS",
                   help="disaggregated: the router's --local-prefill-hold-ttft-seconds (a prompt "
                        "the prefill worker would finish later goes to the decode worker, "
                        "prefilled with its steps held; needs --decode-local-prefill-nice; "
                        "0: off)")
    g.add_argument("--prefill-chunk-tokens", type=int, default=None, metavar="N",
                   help="our decode workers prefill a prompt N tokens per piece, one piece "
                        "between two decode steps (0: whole prompts; default: the worker's)")
    g.add_argument("--decode-tpot-target", type=float, default=None, metavar="SECONDS",
                   help="our decode workers hold a local prefill piece back while it would put "
                        "a running sequence over this time per output token (e.g. the "
                        "--slo-tpot value; default: off)")
    g.add_argument("--decode-itl-target", type=float, default=None, metavar="SECONDS",
                   help="our decode workers size each local prefill piece beside running "
                        "sequences so that the step stays within this inter-token gap (with "
                        "--decode-local-prefill-nice: pace the steps to it) (default: off, every "
                        "piece --prefill-chunk-tokens)")
    g.add_argument("--decode-local-prefill-nice", type=_nice, default=None, metavar="N|idle",
                   help="our decode workers run local prefills on a thread of their own at OS "
                        "nice N (0-19) or SCHED_IDLE ('idle') beside the decode steps (default: "
                        "pieces between the steps)")
    g.add_argument("--decode-hold-first-token", action="store_true",
                   help="our decode workers send a prompt's first token when it joins the "
                        "running batch, one step before its second (--hold-first-token)")
    g.add_argument("--decode-log-steps", action="store_true",
                   help="our decode workers log a line for every decode step into the run's "
                        "logs folder (--log-steps), to line the client's token gaps up with")
    g.add_argument("--decode-ttft-target", type=float, default=None, metavar="SECONDS",
                   help="with --decode-itl-target: our decode workers make a local prefill "
                        "piece larger (the paced gap longer) where waiting local prompts would "
                        "otherwise miss this time to first token (e.g. a little under "
                        "--slo-ttft; default: off)")
    g.add_argument("--decode-pace-stretch", type=float, default=None, metavar="X",
                   help="with --decode-ttft-target and --decode-local-prefill-nice: the paced "
                        "gap grows to at most X times --decode-itl-target (1: never past it; "
                        "default: the worker's, 1.5)")


def _aggregated_args(g) -> None:
    """compare: how our configurations without a prefill worker prefill."""
    g.add_argument("--aggregated-local-prefill", choices=AGGREGATED_LOCAL_PREFILL,
                   default="inline",
                   help="the aggregated (and replicated) workers' prefills: 'inline' (default), "
                        "pieces between their steps on all their threads, without "
                        "--decode-local-prefill-nice, --decode-itl-target, --decode-ttft-target "
                        "and --decode-pace-stretch (they hold a worker that prefills every "
                        "prompt to one thread in the gaps); 'same': the --decode-* options of "
                        "the disaggregated decode worker")


def _slo(args) -> SLO:
    try:
        return SLO(args.slo_ttft, args.slo_tpot, args.slo_attainment)
    except ValueError as exc:
        raise SystemExit(f"nxdi-bench: {exc}") from None


def _workload(args):
    w = get_workload(args.workload)
    if args.length_scale != 1.0:
        w = w.scaled(args.length_scale)
    return w.fit(_max_model_len(args))


def _tokenizer(path: str | None):
    from transformers import AutoTokenizer
    if path is None:
        from nxdi_common.bundled import bundled_model_dir
        path = str(bundled_model_dir())
    return AutoTokenizer.from_pretrained(path)


def _target(args) -> LoadTarget:
    from nxdi_bench.configs import served_model_id
    model = args.model or served_model_id(args.url.rstrip("/"), args.api_key)
    try:
        extra = json.loads(args.extra_body)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"nxdi-bench: --extra-body is not JSON: {exc}") from None
    return LoadTarget(args.url, model, extra, usage_in_stream=not args.no_stream_usage,
                      api_key=args.api_key)


def _sweep_settings(args) -> SweepSettings:
    return SweepSettings(duration_s=args.duration, min_requests=args.min_requests,
                         max_requests=args.max_requests, start_rate=args.start_rate,
                         max_rate=args.max_rate, min_rate=min(args.min_rate, args.start_rate),
                         bisect_steps=args.bisect_steps,
                         unloaded_requests=args.unloaded_requests, seed=args.seed,
                         arrivals=args.arrivals, burstiness=args.burstiness)


def _print_summary(summary) -> None:
    d = summary.to_dict()
    print(f"requests {d['completed']}/{d['num_requests']} ok in {d['duration_s']:.1f} s; "
          f"{d['request_throughput']:.2f} req/s, {d['output_token_throughput']:.1f} output tok/s")
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        p = d[key]
        if p["count"]:
            print(f"  {key[:-2]:<5} ms  p50 {p['p50'] * 1e3:8.1f}  p90 {p['p90'] * 1e3:8.1f}  "
                  f"p99 {p['p99'] * 1e3:8.1f}")
    if d["slo_attainment"] is not None:
        print(f"  SLO attainment {d['slo_attainment'] * 100:.1f}%")
    for err in d["errors"]:
        print(f"  error: {err}")


def cmd_load(args) -> int:
    one_run = SweepSettings(seed=args.seed, arrivals=args.arrivals, burstiness=args.burstiness)
    runner = Runner(_target(args), _workload(args), PromptBuilder(_tokenizer(args.tokenizer)),
                    _slo(args), one_run)
    if args.rate:
        summary = runner.open_loop(args.rate, args.num_requests)
    else:
        summary = runner.closed_loop(args.concurrency, args.num_requests)
    _print_summary(summary)
    if args.out:
        from dataclasses import asdict
        (records,) = runner.records.values()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary.to_dict(),
                                        "records": [asdict(r) for r in records]}, indent=1))
    return 0 if summary.failed == 0 else 1


def cmd_sweep(args) -> int:
    target, slo = _target(args), _slo(args)
    runner = Runner(target, _workload(args), PromptBuilder(_tokenizer(args.tokenizer)), slo,
                    _sweep_settings(args))
    runner.warm_up()
    result = runner.sweep()
    print(f"goodput: {result.goodput:.3g} req/s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result.to_dict(), indent=1))
    return 0


def _max_model_len(args) -> int:
    if args.max_model_len is not None:
        return args.max_model_len
    return QUICK_MAX_MODEL_LEN if getattr(args, "quick", False) else 2048


def _compare_settings(args):
    from nxdi_bench.compare import QUICK_LENGTH_SCALE, QUICK_SWEEP, CompareSettings
    from nxdi_bench.configs import DEFAULT_CONFIGS, ServeSettings
    configs = args.configs.split(",") if args.configs else (
        ["disaggregated", "aggregated"] if args.quick else list(DEFAULT_CONFIGS))
    workload = get_workload(args.workload)
    sweep = _sweep_settings(args)
    if args.quick:
        workload = workload.scaled(QUICK_LENGTH_SCALE * args.length_scale)
        sweep = replace(QUICK_SWEEP, seed=args.seed, arrivals=args.arrivals,
                        burstiness=args.burstiness)
    elif args.length_scale != 1.0:
        workload = workload.scaled(args.length_scale)
    workload = workload.fit(_max_model_len(args))
    serve = ServeSettings(model=args.model, gguf=args.gguf, dtype=args.dtype,
                          backend=args.backend, max_model_len=_max_model_len(args),
                          compiled_root=args.compiled_root, quantize=args.quantize,
                          context_buckets=args.context_buckets,
                          decode_max_batch_size=args.decode_max_batch_size,
                          decode_batch_buckets=args.decode_batch_buckets,
                          kv_blocks=args.kv_blocks,
                          local_prefill_max_tokens=args.local_prefill_max_tokens,
                          local_prefill_queue_tokens=args.local_prefill_queue_tokens,
                          local_prefill_always_tokens=args.local_prefill_always_tokens,
                          local_prefill_hold_ttft_s=args.local_prefill_hold_ttft,
                          prefill_chunk_tokens=args.prefill_chunk_tokens,
                          decode_tpot_target_s=args.decode_tpot_target,
                          decode_itl_target_s=args.decode_itl_target,
                          decode_pace_stretch=args.decode_pace_stretch,
                          decode_ttft_target_s=args.decode_ttft_target,
                          decode_local_prefill_nice=args.decode_local_prefill_nice,
                          decode_hold_first_token=args.decode_hold_first_token,
                          decode_log_steps=args.decode_log_steps,
                          prefill_order=args.prefill_order,
                          prefill_max_overtaken_s=args.prefill_max_overtaken,
                          prefill_ttft_target_s=args.prefill_ttft_target,
                          prefill_nice=args.prefill_nice,
                          aggregated_local_prefill=args.aggregated_local_prefill)
    if args.cpus:
        serve.cpus = [int(c) for c in args.cpus.split(",")]
    serve.router_cpus, serve.router_nice = args.router_cpus, args.router_nice
    serve.router_wake_ms = args.router_wake_ms
    out_dir = args.out_dir or Path("results/goodput") / (
        f"{workload.name}-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    return CompareSettings(configs=configs, workload=workload, slo=_slo(args), sweep=sweep,
                           serve=serve, out_dir=out_dir, cdf_rate=args.cdf_rate,
                           client_cpus=args.client_cpus, client_slice_us=args.client_slice_us)


def cmd_compare(args) -> int:
    from nxdi_bench.compare import compare
    settings = _compare_settings(args)
    results = compare(settings, _tokenizer(args.model), progress=_log)
    from nxdi_bench.report import markdown_table
    print(markdown_table(results))
    print(f"results, table and plots in {settings.out_dir}")
    return 0 if any(r["status"] == "ok" for r in results["configs"].values()) else 1


def _log(message: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"load": cmd_load, "sweep": cmd_sweep, "compare": cmd_compare}[args.command](args)
    except ValueError as exc:
        print(f"nxdi-bench: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
