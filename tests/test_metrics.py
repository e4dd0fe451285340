"""ServingMetrics: exact metric names with units, values after updates, the /metrics endpoint."""
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nxdi_common.serving.metrics import OUTCOMES, ServingMetrics

EXPECTED_FAMILIES = {
    "nxdi_time_to_first_token_seconds": "histogram",
    "nxdi_inter_token_latency_seconds": "histogram",
    "nxdi_e2e_request_latency_seconds": "histogram",
    "nxdi_kv_transfer_duration_seconds": "histogram",
    "nxdi_decode_step_duration_seconds": "histogram",
    "nxdi_token_generation_forward_seconds": "histogram",
    "nxdi_queue_depth_requests": "gauge",
    "nxdi_running_sequences": "gauge",
    "nxdi_kv_blocks_used_blocks": "gauge",
    "nxdi_kv_blocks_free_blocks": "gauge",
    "nxdi_open_kv_transfers": "gauge",
    "nxdi_queued_prompt_tokens": "gauge",
    "nxdi_prefill_tokens_per_second": "gauge",
    "nxdi_kv_transfer_bytes": "counter",
    "nxdi_requests": "counter",
    "nxdi_generated_tokens": "counter",
    "nxdi_prompt_tokens": "counter",
    "nxdi_decode_steps": "counter",
    "nxdi_token_generation_calls": "counter",
    "nxdi_mixed_steps": "counter",
    "nxdi_deferred_pieces": "counter",
    "nxdi_held_step_seconds": "counter",
    "nxdi_hold_budget_steps": "counter",
    "nxdi_kv_socket_transfers": "counter",
    "nxdi_kv_socket_fallbacks": "counter",
    "nxdi_kv_pull_failovers": "counter",
    "nxdi_admission_waits": "counter",
    "nxdi_preemptions": "counter",
    "nxdi_prefix_cache_hit_tokens": "counter",
    "nxdi_local_prefills": "counter",
    "nxdi_expected_cached_tokens": "counter",
    "nxdi_cached_prompt_tokens": "counter",
}


def _families(text: str) -> dict:
    """Metric families by name; the "_created" timestamps prometheus_client adds to counters and
    histograms (gauges in the text format) are left out."""
    return {f.name: f for f in text_string_to_metric_families(text)
            if not f.name.endswith("_created")}


def test_names_types_and_role_label():
    m = ServingMetrics("decode")
    families = _families(m.render().decode())
    assert {name: f.type for name, f in families.items()} == EXPECTED_FAMILIES
    for family in families.values():
        assert family.samples, family.name
        assert {s.labels["role"] for s in family.samples} == {"decode"}
    outcomes = {s.labels["outcome"] for s in families["nxdi_requests"].samples
                if s.name == "nxdi_requests_total"}
    assert outcomes == set(OUTCOMES)


def test_values_after_updates():
    m = ServingMetrics("prefill")
    m.time_to_first_token_seconds.observe(0.2)
    m.time_to_first_token_seconds.observe(3.0)
    m.queue_depth_requests.set(4)
    m.kv_blocks_used_blocks.inc(10)
    m.kv_blocks_used_blocks.dec(3)
    m.kv_transfer_bytes_total.inc(4096)
    m.generated_tokens_total.inc(5)
    m.prompt_tokens_total.inc(17)
    m.requests_total.inc("ok")
    m.requests_total.inc("ok")
    m.requests_total.inc("rejected")
    assert m.value("nxdi_time_to_first_token_seconds_count") == 2.0
    assert m.value("nxdi_time_to_first_token_seconds_sum") == 3.2
    assert m.value("nxdi_time_to_first_token_seconds_bucket", le="0.25") == 1.0
    assert m.value("nxdi_time_to_first_token_seconds_bucket", le="5.0") == 2.0
    assert m.value("nxdi_time_to_first_token_seconds_bucket", le="+Inf") == 2.0
    assert m.value("nxdi_queue_depth_requests") == 4.0
    assert m.value("nxdi_kv_blocks_used_blocks") == 7.0
    assert m.value("nxdi_kv_transfer_bytes_total") == 4096.0
    assert m.value("nxdi_generated_tokens_total") == 5.0
    assert m.value("nxdi_prompt_tokens_total") == 17.0
    assert m.value("nxdi_requests_total", outcome="ok") == 2.0
    assert m.value("nxdi_requests_total", outcome="rejected") == 1.0
    assert m.value("nxdi_requests_total", outcome="error") == 0.0


def test_buckets_span_milliseconds_to_minutes():
    m = ServingMetrics("router")
    families = _families(m.render().decode())
    for name in ("nxdi_time_to_first_token_seconds", "nxdi_e2e_request_latency_seconds",
                 "nxdi_inter_token_latency_seconds", "nxdi_kv_transfer_duration_seconds"):
        bounds = [float(s.labels["le"]) for s in families[name].samples
                  if s.name == name + "_bucket" and s.labels["le"] != "+Inf"]
        assert bounds == sorted(bounds)
        assert bounds[0] <= 0.05, name
        assert bounds[-1] >= 10.0, name
    assert float(max(float(s.labels["le"]) for s in families["nxdi_e2e_request_latency_seconds"]
                     .samples if s.labels.get("le") not in (None, "+Inf"))) >= 600.0


def test_instances_are_independent():
    a, b = ServingMetrics("decode"), ServingMetrics("decode")
    a.running_sequences.set(3)
    assert a.value("nxdi_running_sequences") == 3.0
    assert b.value("nxdi_running_sequences") == 0.0


def test_validation():
    with pytest.raises(ValueError, match="role"):
        ServingMetrics("gateway")
    m = ServingMetrics("decode")
    with pytest.raises(ValueError, match="outcome"):
        m.requests_total.inc("timeout")
    with pytest.raises(ValueError, match="metrics port"):
        m.start_http_server("127.0.0.1", -1)


def test_http_endpoint_serves_metrics():
    m = ServingMetrics("decode")
    port = m.start_http_server("127.0.0.1", 0)
    try:
        assert port > 0
        m.running_sequences.set(2)
        m.requests_total.inc("cancelled")
        reply = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/plain")
        families = _families(reply.text)
        running = families["nxdi_running_sequences"].samples
        assert [(s.labels, s.value) for s in running] == [({"role": "decode"}, 2.0)]
        cancelled = [s.value for s in families["nxdi_requests"].samples
                     if s.name == "nxdi_requests_total" and s.labels["outcome"] == "cancelled"]
        assert cancelled == [1.0]
        with pytest.raises(RuntimeError, match="already running"):
            m.start_http_server("127.0.0.1", 0)
    finally:
        m.stop_http_server()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
