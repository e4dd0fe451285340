"""Open-loop arrival times: Poisson, or gamma-distributed gaps with adjustable burstiness.

Gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)): the mean gap is always 1/rate and
the coefficient of variation is 1/sqrt(burstiness). burstiness 1 is a Poisson process; below 1
requests come in clumps, above 1 they are more evenly spaced than Poisson."""
from __future__ import annotations

import numpy as np

__all__ = ["arrival_times", "ARRIVAL_KINDS"]

ARRIVAL_KINDS = ("poisson", "gamma")


def arrival_times(n: int, rate: float, seed: int, kind: str = "poisson",
                  burstiness: float = 1.0) -> np.ndarray:
    """Seconds after the start at which each of ``n`` requests is sent (first one at 0)."""
    if n < 1:
        raise ValueError(f"num_requests must be >= 1, got {n}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if kind not in ARRIVAL_KINDS:
        raise ValueError(f"arrivals: unknown kind {kind!r}; choose one of {', '.join(ARRIVAL_KINDS)}")
    shape = 1.0 if kind == "poisson" else burstiness
    if not shape > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])
