"""One workload against one running server: a run at a rate, an unloaded baseline, a goodput sweep."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from nxdi_bench.arrivals import arrival_times
from nxdi_bench.client import LoadTarget, Progress, run_closed_loop, run_open_loop
from nxdi_bench.metrics import SLO, RequestRecord, RunSummary, SweepResult, find_goodput, summarize
from nxdi_bench.workloads import PromptBuilder, Workload, draw_requests

__all__ = ["SweepSettings", "Runner"]


@dataclass
class SweepSettings:
    """How long each rate runs and how the rate is searched.

    A rate r runs max(min_requests, r * duration_s) requests, so every point lasts about
    duration_s of arrivals; the same seed gives the same requests (and, per rate, the same
    arrival pattern) to every configuration."""

    duration_s: float = 60.0
    min_requests: int = 20
    max_requests: int = 400
    start_rate: float = 0.5
    max_rate: float = 32.0
    min_rate: float = 1 / 32
    bisect_steps: int = 3
    unloaded_requests: int = 8
    seed: int = 0
    arrivals: str = "poisson"
    burstiness: float = 1.0

    def num_requests(self, rate: float) -> int:
        return int(min(self.max_requests, max(self.min_requests, round(rate * self.duration_s))))


class Runner:
    """Runs a workload against ``target`` and keeps every run's records by label."""

    def __init__(self, target: LoadTarget, workload: Workload, builder: PromptBuilder, slo: SLO,
                 settings: SweepSettings, label: str = "", stream=None):
        self.target, self.workload, self.builder = target, workload, builder
        self.slo, self.settings, self.label = slo, settings, label
        self.stream = stream
        self.records: dict[str, list[RequestRecord]] = {}

    def _progress(self, what: str, total: int) -> Progress:
        return Progress(f"[{self.label}] {what}" if self.label else what, total, stream=self.stream)

    def open_loop(self, rate: float, n: int | None = None) -> RunSummary:
        """``n`` requests (default: the settings' count for this rate) arriving at ``rate``."""
        s = self.settings
        n = n or s.num_requests(rate)
        requests = draw_requests(self.workload, n, self.builder, s.seed)
        arrivals = arrival_times(n, rate, s.seed + 1, s.arrivals, s.burstiness)
        progress = self._progress(f"rate {rate:.3g}/s", n)
        records = asyncio.run(run_open_loop(self.target, requests, arrivals, progress.update))
        self.records[f"rate={rate:.6g}"] = records
        return summarize(records, self.slo, rate=rate)

    def closed_loop(self, concurrency: int, n: int, key: str | None = None,
                    seed_offset: int = 0) -> RunSummary:
        """``n`` requests, ``concurrency`` in flight; records kept under ``key``."""
        key = key or f"concurrency={concurrency}"
        requests = draw_requests(self.workload, n, self.builder, self.settings.seed + seed_offset)
        progress = self._progress(key, n)
        records = asyncio.run(run_closed_loop(self.target, requests, concurrency, progress.update))
        self.records[key] = records
        return summarize(records, self.slo, concurrency=concurrency)

    def unloaded(self) -> RunSummary:
        """One request at a time: the latencies with nothing else running."""
        return self.closed_loop(1, self.settings.unloaded_requests, key="unloaded", seed_offset=2)

    def warm_up(self, n: int = 2) -> None:
        """A few requests whose results are dropped (first-request costs: graphs, allocators)."""
        requests = draw_requests(self.workload, n, self.builder, self.settings.seed + 3)
        records = asyncio.run(run_closed_loop(self.target, requests, 1))
        failed = [r.error for r in records if r.error]
        if failed:
            raise RuntimeError(f"warm-up request failed: {failed[0]}")

    def sweep(self) -> SweepResult:
        s = self.settings
        return find_goodput(self.open_loop, self.slo, s.start_rate, max_rate=s.max_rate,
                            min_rate=s.min_rate, bisect_steps=s.bisect_steps)
