"""The comparison runner: start each configuration, run the same workload against it (warm-up,
an unloaded baseline, a goodput sweep), stop it, then write results.json, table.md and plots;
our configurations' process output goes to logs/<configuration>.log as they run.

A configuration that cannot start (a peer that does not install or run here) is recorded with
its error and the run goes on with the others."""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nxdi_bench.configs import CONFIGS, ServeSettings, serve
from nxdi_bench.metrics import SLO
from nxdi_bench.report import markdown_table, write_plots
from nxdi_bench.runs import Runner, SweepSettings
from nxdi_bench.workloads import PromptBuilder, Workload
from nxdi_common.serving.thread_priority import set_process_slice, thread_ids

__all__ = ["CompareSettings", "compare", "machine_description", "QUICK_SWEEP"]

# --quick: a smoke test (two short points per configuration), not a measurement.
QUICK_SWEEP = SweepSettings(duration_s=6.0, min_requests=6, max_requests=16, start_rate=1.0,
                            max_rate=2.0, min_rate=0.5, bisect_steps=0, unloaded_requests=2)
QUICK_LENGTH_SCALE = 1 / 8


@dataclass
class CompareSettings:
    configs: list[str]
    workload: Workload
    slo: SLO
    sweep: SweepSettings
    serve: ServeSettings
    out_dir: Path
    cdf_rate: float | None = None       # None: the highest rate every configuration ran
    client_cpus: list[int] | None = None  # the load generator's CPUs while it runs (None: any)
    client_slice_us: int = 0  # the load generator's threads' scheduler slice meanwhile (0: default)
    command: list[str] = field(default_factory=lambda: list(sys.argv))


def machine_description() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = ""
    try:
        mem = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"
    except (ValueError, OSError):
        pass
    return f"{model}, {os.cpu_count()} CPUs{mem}, {platform.system()} {platform.release()}"


def _meta(s: CompareSettings) -> dict:
    import torch
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": machine_description(), "python": platform.python_version(),
            "torch": torch.__version__, "command": " ".join(s.command),
            "workload": s.workload.name,
            "workload_classes": [asdict(c) for c in s.workload.classes],
            "slo": asdict(s.slo), "sweep": asdict(s.sweep),
            "serve": {k: v for k, v in asdict(s.serve).items()},
            "client_cpus": s.client_cpus, "client_slice_us": s.client_slice_us}


@contextlib.contextmanager
def pinned(cpus: list[int] | None):
    """Run this process on ``cpus`` meanwhile (None: leave it where it is): the load generator's
    event loop, and every thread already started, such as those draining the services' output
    (started with the services, before this; left where they were, they ran on the decode
    worker's core); each thread's affinity before comes back after."""
    if not cpus:
        yield
        return
    mine, before = os.sched_getaffinity(0), {}
    for tid in thread_ids():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            before[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, cpus)
    try:
        yield
    finally:
        for tid in thread_ids():  # threads started meanwhile get the calling thread's set back
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, before.get(tid, mine))


@contextlib.contextmanager
def sliced(slice_us: int, progress):
    """Give this process's threads a scheduler slice of ``slice_us`` microseconds meanwhile
    (thread_priority.set_process_slice; 0: leave them as they are), the kernel's default after.
    Why: the client shares a core with the prefill worker and the router, and a woken thread
    with the default slice can wait out the running one's slice until the kernel's next tick
    (session 73: p90 3.6 ms on one core), time a remote client would not add to the gaps it
    records. Session 74 measured no change in the late deliveries with it (off by default)."""
    if not slice_us:
        yield
        return
    if not set_process_slice(slice_us):
        progress(f"client slice {slice_us} us: not available on this kernel (Linux 6.12+ has "
                 "it); unchanged")
    try:
        yield
    finally:
        set_process_slice(0)


def _run_config(name: str, s: CompareSettings, builder: PromptBuilder, progress) -> tuple[dict, dict]:
    with serve(name, s.serve, progress, s.out_dir / "logs" / f"{name}.log") as target, \
            pinned(s.client_cpus), sliced(s.client_slice_us, progress):
        runner = Runner(target, s.workload, builder, s.slo, s.sweep, label=name)
        progress(f"[{name}] serving at {target.base_url} (model {target.model}); warming up")
        runner.warm_up()
        unloaded = runner.unloaded()
        sweep = runner.sweep()
    progress(f"[{name}] goodput {sweep.goodput:.3g} req/s")
    result = {"status": "ok", "unloaded": unloaded.to_dict(), "sweep": sweep.to_dict()}
    return result, runner.records


def _cdf_rate(records: dict[str, dict], wanted: float | None) -> str | None:
    """The run label whose records the CDF plots use: ``rate=wanted``, else the highest rate
    that every configuration ran."""
    if not records:
        return None
    if wanted is not None:
        return f"rate={wanted:.6g}"
    common = set.intersection(*(set(r) for r in records.values())) - {"unloaded"}
    if not common:
        return None
    return max(common, key=lambda k: float(k.split("=", 1)[1]))


def _attach_cdfs(results: dict, records: dict[str, dict], label: str | None) -> dict:
    """results[config]['cdf'] = TTFTs and ITLs of the chosen run; returns those runs' records."""
    kept = {}
    for name, runs in records.items():
        recs = runs.get(label) if label else None
        if recs is None:
            continue
        ok = [r for r in recs if r.ok]
        results["configs"][name]["cdf"] = {
            "label": label.replace("rate=", "") + " req/s",
            "ttft_s": [round(r.ttft, 6) for r in ok],
            "itl_s": [round(x, 6) for r in ok for x in r.itls]}
        kept[name] = [asdict(r) for r in recs]
    return kept


def _write(out_dir: Path, name: str, data) -> None:
    path = out_dir / name
    tmp = path.with_suffix(".tmp")
    tmp.write_text(data if isinstance(data, str) else json.dumps(data, indent=1))
    tmp.replace(path)


def compare(s: CompareSettings, tokenizer, progress=print) -> dict:
    unknown = [c for c in s.configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    s.out_dir.mkdir(parents=True, exist_ok=True)
    builder = PromptBuilder(tokenizer)
    results = {"meta": _meta(s), "configs": {}}
    records: dict[str, dict] = {}
    for name in s.configs:
        try:
            results["configs"][name], records[name] = _run_config(name, s, builder, progress)
        except Exception as exc:  # noqa: BLE001 - a configuration that fails is reported, not fatal
            error = f"{type(exc).__name__}: {exc}"
            progress(f"[{name}] could not be measured: {error}")
            results["configs"][name] = {"status": "unavailable", "error": error}
        _write(s.out_dir, "results.json", results)
    label = _cdf_rate(records, s.cdf_rate)
    kept = _attach_cdfs(results, records, label)
    _write(s.out_dir, "results.json", results)
    _write(s.out_dir, "records.json", kept)
    _write(s.out_dir, "table.md", markdown_table(results))
    write_plots(results, s.out_dir)
    return results
