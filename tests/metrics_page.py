"""A running service's Prometheus /metrics page, read the way the tests need it."""
from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def metric_value(address: str, name: str) -> float:
    """The sum of every sample named ``name`` (over all label sets) on http://address/metrics;
    0 when the page has none."""
    text = httpx.get(f"http://{address}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)
