"""Latency metrics of one run and goodput under an SLO (DistServe's definition).

Everything here is a pure function of recorded timelines, so it is tested on constructed ones.
Times are seconds on one monotonic clock, relative to the start of the run.

- TTFT: first token's arrival minus the time the request was *due* (its open-loop arrival time,
  or when a closed-loop slot sent it), so a client that falls behind cannot hide queueing.
- ITL: every gap between consecutive tokens' arrivals.
- TPOT: (last token - first token) / (output tokens - 1); undefined for one-token outputs, which
  then meet any TPOT SLO.
- SLO attainment: the fraction of all requests (failed ones count as misses) that meet both the
  TTFT and the TPOT SLO. Goodput: the highest request rate whose attainment is >= the target
  (90%), found by sweeping the rate."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

__all__ = ["RequestRecord", "SLO", "Percentiles", "RunSummary", "SweepPoint", "SweepResult",
           "summarize", "find_goodput", "percentiles"]


@dataclass
class RequestRecord:
    """What the client saw of one request."""

    index: int
    kind: str
    due_s: float                      # when it was due to be sent
    prompt_tokens: int                # as built; the server's count when it reported usage
    expected_output_tokens: int
    sent_s: float | None = None       # when the HTTP request actually went out
    token_times: list[float] = field(default_factory=list)  # arrival of each token-bearing event
    end_s: float | None = None        # when the response ended (or failed)
    output_tokens: int | None = None  # the server's usage count, else the events seen
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times)

    @property
    def n_output(self) -> int:
        return self.output_tokens if self.output_tokens is not None else len(self.token_times)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.due_s if self.ok else None

    @property
    def itls(self) -> list[float]:
        return np.diff(self.token_times).tolist() if self.ok else []

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.n_output < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.n_output - 1)

    @property
    def e2e(self) -> float | None:
        return self.end_s - self.due_s if self.ok and self.end_s is not None else None


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float
    attainment: float = 0.9

    def __post_init__(self):
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLO: ttft_s and tpot_s must be > 0, got {self.ttft_s}, {self.tpot_s}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"SLO: attainment must be in (0, 1], got {self.attainment}")

    def met_by(self, r: RequestRecord) -> bool:
        if not r.ok or r.ttft > self.ttft_s:
            return False
        tpot = r.tpot
        return tpot is None or tpot <= self.tpot_s


@dataclass
class Percentiles:
    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None


def percentiles(values) -> Percentiles:
    v = np.asarray([x for x in values if x is not None], dtype=np.float64)
    if v.size == 0:
        return Percentiles(0, None, None, None, None, None)
    p50, p90, p99 = (float(x) for x in np.percentile(v, [50, 90, 99]))
    return Percentiles(int(v.size), float(v.mean()), p50, p90, p99, float(v.max()))


@dataclass
class RunSummary:
    rate: float | None                # offered requests/s (None: closed loop)
    concurrency: int | None
    num_requests: int
    completed: int
    failed: int
    duration_s: float                 # first due time to last response end
    request_throughput: float         # completed requests/s
    output_token_throughput: float    # output tokens/s of completed requests
    input_token_throughput: float
    slo_attainment: float | None
    good_request_rate: float | None   # requests meeting the SLO per second
    ttft_s: Percentiles
    tpot_s: Percentiles
    itl_s: Percentiles
    e2e_s: Percentiles
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(records: list[RequestRecord], slo: SLO | None = None, rate: float | None = None,
              concurrency: int | None = None) -> RunSummary:
    if not records:
        raise ValueError("summarize: no records")
    done = [r for r in records if r.ok]
    start = min(r.due_s for r in records)
    ends = [r.end_s for r in records if r.end_s is not None]
    duration = max(max(ends, default=start) - start, 1e-9)
    good = sum(slo.met_by(r) for r in records) if slo else None
    errors = sorted({r.error for r in records if r.error})
    return RunSummary(
        rate=rate, concurrency=concurrency, num_requests=len(records), completed=len(done),
        failed=len(records) - len(done), duration_s=duration,
        request_throughput=len(done) / duration,
        output_token_throughput=sum(r.n_output for r in done) / duration,
        input_token_throughput=sum(r.prompt_tokens for r in done) / duration,
        slo_attainment=good / len(records) if slo else None,
        good_request_rate=good / duration if slo else None,
        ttft_s=percentiles(r.ttft for r in done),
        tpot_s=percentiles(r.tpot for r in done),
        itl_s=percentiles(x for r in done for x in r.itls),
        e2e_s=percentiles(r.e2e for r in done),
        errors=errors[:10])


@dataclass
class SweepPoint:
    rate: float
    summary: RunSummary
    passed: bool


@dataclass
class SweepResult:
    goodput: float                    # highest rate that met the SLO target (0.0 if none did)
    points: list[SweepPoint]

    def to_dict(self) -> dict:
        return {"goodput": self.goodput, "points": [
            {"rate": p.rate, "passed": p.passed, "summary": p.summary.to_dict()}
            for p in sorted(self.points, key=lambda p: p.rate)]}


def find_goodput(measure: Callable[[float], RunSummary], slo: SLO, start_rate: float,
                 max_rate: float = 64.0, min_rate: float = 1 / 64, bisect_steps: int = 3,
                 ) -> SweepResult:
    """Goodput by sweeping the offered rate: double from ``start_rate`` while the SLO holds (or
    halve while it does not), then bisect between the highest passing and the lowest failing
    rate ``bisect_steps`` times. ``measure(rate)`` runs the workload at that rate."""
    if not 0 < min_rate <= start_rate <= max_rate:
        raise ValueError(f"rates must satisfy 0 < min_rate <= start_rate <= max_rate, got "
                         f"{min_rate}, {start_rate}, {max_rate}")
    points: list[SweepPoint] = []

    def run(rate: float) -> bool:
        summary = measure(rate)
        passed = summary.slo_attainment is not None and summary.slo_attainment >= slo.attainment
        points.append(SweepPoint(rate, summary, passed))
        return passed

    rate = start_rate
    if run(rate):
        lo, hi = rate, None
        while hi is None and rate * 2 <= max_rate:
            rate *= 2
            if run(rate):
                lo = rate
            else:
                hi = rate
    else:
        lo, hi = None, rate
        while lo is None and rate / 2 >= min_rate:
            rate /= 2
            if run(rate):
                lo = rate
            else:
                hi = rate
    if lo is not None and hi is not None:
        for _ in range(bisect_steps):
            mid = (lo + hi) / 2
            if run(mid):
                lo = mid
            else:
                hi = mid
    return SweepResult(goodput=lo or 0.0, points=points)
