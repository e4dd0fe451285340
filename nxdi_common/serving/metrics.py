"""Prometheus metrics every service exports, in one private registry per service instance.

Each metric carries a ``role`` label (router, prefill, decode) and its unit in its name. Services
update the attributes (``metrics.queue_depth_requests.set(3)``,
``metrics.time_to_first_token_seconds.observe(0.2)``, ``metrics.requests_total.inc("ok")``);
:meth:`ServingMetrics.render` gives the text exposition and :meth:`ServingMetrics.start_http_server`
serves ``GET /metrics`` from a background thread."""
from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)
from prometheus_client import start_http_server as _prometheus_http_server

ROLES = ("router", "prefill", "decode")
OUTCOMES = ("ok", "cancelled", "error", "rejected", "invalid")

# Latency buckets, seconds: time to first token and whole requests span ms to minutes; the gap
# between tokens is ms to seconds; a KV transfer ms to a minute.
TTFT_BUCKETS_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                        60.0, 120.0, 300.0)
ITL_BUCKETS_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0,
                       2.5, 5.0, 10.0)
E2E_BUCKETS_SECONDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                       600.0, 1200.0)
# A decode step and its model call: ms to a few hundred ms, finer where steps of a small
# model on CPU lie (5-100 ms).
STEP_BUCKETS_SECONDS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04,
                        0.05, 0.06, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
KV_TRANSFER_BUCKETS_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                               2.5, 5.0, 10.0, 30.0, 60.0)

# (attribute and metric name without the "nxdi_" prefix, help text, buckets)
HISTOGRAMS = (
    ("time_to_first_token_seconds", "Time from request arrival to its first token",
     TTFT_BUCKETS_SECONDS),
    ("inter_token_latency_seconds", "Time between consecutive tokens of one request",
     ITL_BUCKETS_SECONDS),
    ("e2e_request_latency_seconds", "Time from request arrival to its last token",
     E2E_BUCKETS_SECONDS),
    ("kv_transfer_duration_seconds", "Time to move one request's KV cache between workers",
     KV_TRANSFER_BUCKETS_SECONDS),
    ("decode_step_duration_seconds", "Time of one decode step of the running batch (decode "
     "workers): its token-generation calls and the host work on their tokens (host sampling, "
     "logprobs, handing tokens to their streams); steps that ride in a prefill piece's call "
     "not included", STEP_BUCKETS_SECONDS),
    ("token_generation_forward_seconds", "Time of one token-generation model call alone "
     "(decode workers); decode_step_duration_seconds less these is the step's host work",
     STEP_BUCKETS_SECONDS),
)
GAUGES = (
    ("queue_depth_requests", "Requests admitted and waiting to run"),
    ("running_sequences", "Sequences in the running batch"),
    ("kv_blocks_used_blocks", "KV cache blocks in use"),
    ("kv_blocks_free_blocks", "KV cache blocks free to reserve"),
    ("open_kv_transfers", "KV transfers in progress"),
    ("queued_prompt_tokens", "Prompt tokens waiting to be prefilled (prefill: queued; decode: "
     "what its local prefills have still to compute), the prefill pool's scaling signal"),
    ("prefill_tokens_per_second", "Prompt tokens prefilled per second lately while there were "
     "prompts to prefill, as the load report tells the router (decode: its local prefills, the "
     "time between their pieces included)"),
)
COUNTERS = (  # prometheus_client adds the "_total" suffix in the exposition
    ("kv_transfer_bytes", "KV cache payload bytes sent or received"),
    ("generated_tokens", "Tokens generated"),
    ("prompt_tokens", "Prompt tokens processed"),
    ("decode_steps", "Decode steps (one token for every running sequence)"),
    ("token_generation_calls", "Token-generation model calls (one per decode step, two when "
     "short and long sequences run apart)"),
    ("mixed_steps", "Decode steps run in the same model call as a piece of a local prefill "
     "(counted in decode_steps too, not in token_generation_calls)"),
    ("deferred_pieces", "Decode steps run without the waiting local prefill's next piece, "
     "which would have put a running sequence over the TPOT target (--tpot-target-ms)"),
    ("held_step_seconds", "Seconds a decode worker held its steps for a local prompt sent "
     "with hold_steps_for_prefill (the router's --local-prefill-hold-ttft-seconds)"),
    ("hold_budget_steps", "Decode steps run while a local prompt asked for the steps to be "
     "held, because a running sequence's TPOT budget was spent (--tpot-target-ms)"),
    ("kv_socket_transfers", "KV transfers sent on a direct TCP connection (KV socket) instead "
     "of the gRPC stream"),
    ("kv_socket_fallbacks", "KV transfers whose KV socket offer was not claimed in time, so "
     "the chunks went on the gRPC stream"),
    ("kv_pull_failovers", "KV pulls a decode worker took to its next prefill candidate after "
     "the one before failed (a prefill worker gone, overloaded or refusing)"),
    ("admission_waits", "Requests the router queued because every decode worker was full "
     "(served when room came, or shed with 429 after --queue-timeout-seconds)"),
    ("preemptions", "Running sequences a decode worker preempted for lack of a free KV block "
     "(KV copied to host memory, copied back into new blocks when there are some)"),
    ("prefix_cache_hit_tokens", "Prompt tokens read from the worker's prefix cache instead of "
     "computed (prefill: its own cache; decode: its cache, neither computed nor pulled)"),
    ("local_prefills", "Prompts prefilled by their decode worker (router: requests it sent "
     "without prefill candidates; decode: prompts it prefilled itself)"),
    ("expected_cached_tokens", "Router, cache-aware policy: prompt tokens of finished requests "
     "it believed their decode worker's prefix cache held when it routed them (compare with "
     "cached_prompt_tokens: how good its view of the caches is)"),
    ("cached_prompt_tokens", "Router, cache-aware policy: prompt tokens of the same requests "
     "their decode worker reported read from its prefix cache (usage)"),
)
PREFIX = "nxdi_"


class OutcomeCounter:
    """``nxdi_requests_total{outcome=...}``: every outcome exported from the start (as 0)."""

    def __init__(self, counter: Counter, role: str):
        self._children = {o: counter.labels(role=role, outcome=o) for o in OUTCOMES}

    def inc(self, outcome: str, amount: float = 1) -> None:
        """Count ``amount`` finished requests with ``outcome`` (one of OUTCOMES)."""
        self.labels(outcome).inc(amount)

    def labels(self, outcome: str):
        if outcome not in self._children:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        return self._children[outcome]


class ServingMetrics:
    """The metrics of one service instance (``role``: router, prefill or decode).

    Attributes (prometheus_client children, already labelled with the role):
    histograms ``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
    ``e2e_request_latency_seconds``, ``kv_transfer_duration_seconds``,
    ``decode_step_duration_seconds``, ``token_generation_forward_seconds``; gauges
    ``queue_depth_requests``, ``running_sequences``, ``kv_blocks_used_blocks``,
    ``kv_blocks_free_blocks``, ``open_kv_transfers``, ``queued_prompt_tokens``,
    ``prefill_tokens_per_second``; counters ``kv_transfer_bytes_total``,
    ``generated_tokens_total``, ``prompt_tokens_total``, ``decode_steps_total``,
    ``token_generation_calls_total``, ``mixed_steps_total``, ``deferred_pieces_total``,
    ``held_step_seconds_total``, ``hold_budget_steps_total``, ``kv_socket_transfers_total``,
    ``kv_socket_fallbacks_total``, ``kv_pull_failovers_total``, ``prefix_cache_hit_tokens_total``,
    ``local_prefills_total``; and ``requests_total``, an
    :class:`OutcomeCounter` (``requests_total.inc("ok")``)."""

    def __init__(self, role: str):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role = role
        self.registry = CollectorRegistry()
        self._http_server = None
        for name, doc, buckets in HISTOGRAMS:
            metric = Histogram(PREFIX + name, doc, ["role"], buckets=buckets,
                               registry=self.registry)
            setattr(self, name, metric.labels(role=role))
        for name, doc in GAUGES:
            setattr(self, name, Gauge(PREFIX + name, doc, ["role"],
                                      registry=self.registry).labels(role=role))
        for name, doc in COUNTERS:
            setattr(self, name + "_total", Counter(PREFIX + name, doc, ["role"],
                                                   registry=self.registry).labels(role=role))
        requests = Counter(PREFIX + "requests", "Finished requests by outcome",
                           ["role", "outcome"], registry=self.registry)
        self.requests_total = OutcomeCounter(requests, role)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    def value(self, name: str, **labels: str) -> float | None:
        """The current value of one sample (e.g. ``value("nxdi_requests_total", outcome="ok")``),
        the role label filled in; None when there is no such sample."""
        return self.registry.get_sample_value(name, {"role": self.role, **labels})

    def start_http_server(self, host: str, port: int) -> int:
        """Serve ``GET /metrics`` on ``host:port`` from a daemon thread (port 0: a free port);
        returns the bound port. At most one server per instance."""
        if self._http_server is not None:
            raise RuntimeError("the metrics HTTP server is already running")
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"metrics port must be in [0, 65535], got {port!r}")
        server, _thread = _prometheus_http_server(port, addr=host.strip("[]"),
                                                  registry=self.registry)
        self._http_server = server
        return server.server_port

    def stop_http_server(self) -> None:
        """Stop the metrics HTTP server, if running."""
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()
            self._http_server = None
