"""Router pieces without a running router: routing policies (exact rankings), the worker registry
(DNS resolution, static addresses, polling a server that is not a worker, optimistic load
updates), OpenAI request -> internal request conversion with every validation error, and the
OpenAI response shapes."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import socket
import time

import pytest
from pydantic import ValidationError

from nxdi_common.serving.errors import InvalidRequest, Unavailable
from nxdi_common.serving.metrics import ServingMetrics
from nxdi_common.serving.types import (SamplingOptions, StopOptions, StructuredOutput,
                                       TokenLogprob, TokenOutput, Usage)
from nxdi_common.serving.worker import ModelOptions
from protos.nxdi.serving.v1 import serving_pb2 as pb
from router import convert
from router.dispatch import Dispatcher, WorkerError, compatible_prefills
from router.frontend import ModelFrontend, RoutedRequest
from router.openai_format import ChatFormatter, CompletionFormatter, finish_reason
from router.openai_schema import (ChatRequest, CompletionRequest, chat_to_routed, chat_tools,
                                  completion_to_routed, completions_to_routed, structured_field)
from nxdi_common.block_manager import BlockManager
from router.policies import (DECODE, PREFILL, CacheAware, LeastLoaded, LocalChoice,
                             LocalPrefillRule,
                             PrefixAffinity, RoundRobin, WorkerLoad, WorkerState, affinity_key,
                             make_policy, prefill_eta_s, prompt_tokens_ahead, rendezvous_order)
from router.prefix_index import DEFAULT_CAPACITY_BLOCKS, PrefixIndex, block_hashes
from router.registry import Registry, resolve, split_host_port

MAX_MODEL_LEN = 64


def decode_worker(address, free, running=0, queued=0, healthy=True):
    load = WorkerLoad(kv_blocks_free=free, running_sequences=running, queued_requests=queued,
                      kv_block_size=16, role=DECODE)
    return WorkerState(address, DECODE, healthy, load, "" if healthy else "down")


def prefill_worker(address, queued_tokens, transfers=0, healthy=True):
    load = WorkerLoad(queued_prompt_tokens=queued_tokens, open_transfers=transfers, role=PREFILL)
    return WorkerState(address, PREFILL, healthy, load, "" if healthy else "down")


def addresses(workers):
    return [w.address for w in workers]


# --- policies -----------------------------------------------------------------------------------


def test_least_loaded_decode_ranks_by_free_blocks_then_running_then_address():
    workers = [decode_worker("d1:1", 10, running=3), decode_worker("d2:1", 30),
               decode_worker("d3:1", 10, running=1, queued=1), decode_worker("d4:1", 10, 1, 1),
               decode_worker("d5:1", 99, healthy=False)]
    assert addresses(LeastLoaded().rank_decode([1, 2], workers)) == ["d2:1", "d3:1", "d4:1",
                                                                     "d1:1"]


def test_least_loaded_prefill_ranks_by_queued_tokens_then_open_transfers():
    workers = [prefill_worker("p1:1", 500), prefill_worker("p2:1", 100, transfers=2),
               prefill_worker("p3:1", 100, transfers=1), prefill_worker("p4:1", 0, healthy=False)]
    assert addresses(LeastLoaded().rank_prefill([1], workers)) == ["p3:1", "p2:1", "p1:1"]


def test_round_robin_rotates_per_role_over_healthy_workers():
    policy = RoundRobin()
    decodes = [decode_worker(a, 1) for a in ("c:1", "a:1", "b:1")] + \
        [decode_worker("z:1", 1, healthy=False)]
    prefills = [prefill_worker("p:1", 0), prefill_worker("q:1", 0)]
    assert [addresses(policy.rank_decode([1], decodes)) for _ in range(4)] == [
        ["a:1", "b:1", "c:1"], ["b:1", "c:1", "a:1"], ["c:1", "a:1", "b:1"],
        ["a:1", "b:1", "c:1"]]
    assert addresses(policy.rank_prefill([1], prefills)) == ["p:1", "q:1"]
    assert addresses(policy.rank_prefill([1], prefills)) == ["q:1", "p:1"]
    assert policy.rank_decode([1], [decode_worker("x:1", 1, healthy=False)]) == []


def test_affinity_key_covers_the_first_block_aligned_tokens():
    ids = list(range(1000, 1300))
    assert affinity_key(ids[:15]) == b""
    assert affinity_key(ids[:16]) == affinity_key(ids[:31]) != affinity_key(ids[:32])
    assert affinity_key(ids[:256]) == affinity_key(ids) != affinity_key(ids[:255])
    assert len(affinity_key(ids)) == 16


def test_prefix_affinity_sends_a_shared_prefix_to_the_same_workers():
    policy = PrefixAffinity()
    decodes = [decode_worker(f"10.0.0.{i}:9000", 50) for i in range(4)]
    prefills = [prefill_worker(f"10.0.1.{i}:9000", 0) for i in range(3)]
    prefix = list(range(500, 756))  # the 256 tokens the key covers
    first = policy.rank_decode(prefix + [1, 2, 3], decodes)
    second = policy.rank_decode(prefix + [7] * 40, decodes)
    assert first[0] is second[0]
    assert first[0] is rendezvous_order(affinity_key(prefix), decodes)[0]
    assert addresses(first[1:]) == sorted(a for a in addresses(decodes)
                                          if a != first[0].address)
    p1, p2 = policy.rank_prefill(prefix + [1], prefills), policy.rank_prefill(prefix, prefills)
    assert p1[0] is p2[0] is rendezvous_order(affinity_key(prefix), prefills)[0]


def test_prefix_affinity_spreads_different_prefixes_over_all_workers():
    policy = PrefixAffinity()
    decodes = [decode_worker(f"10.0.0.{i}:9000", 50) for i in range(4)]
    winners = {policy.rank_decode([k] * 16, decodes)[0].address for k in range(64)}
    assert winners == set(addresses(decodes))


def test_rendezvous_winner_survives_removing_another_worker():
    workers = [decode_worker(f"10.0.0.{i}:9000", 50) for i in range(5)]
    for k in range(20):
        key = affinity_key([k] * 16)
        order = rendezvous_order(key, workers)
        rest = [w for w in workers if w is not order[-1]]
        assert rendezvous_order(key, rest)[0] is order[0]


def test_prefix_affinity_falls_back_to_least_loaded():
    policy = PrefixAffinity()
    prompt = list(range(32))
    decodes = [decode_worker("a:1", 5), decode_worker("b:1", 9), decode_worker("c:1", 7)]
    winner = rendezvous_order(affinity_key(prompt), decodes)[0]
    least_loaded = addresses(LeastLoaded().rank_decode(prompt, decodes))

    winner.load = WorkerLoad(kv_blocks_free=0, kv_block_size=16)  # saturated
    assert addresses(policy.rank_decode(prompt, decodes)) == \
        addresses(LeastLoaded().rank_decode(prompt, decodes))
    winner.load, winner.healthy = WorkerLoad(kv_blocks_free=100), False  # unhealthy
    assert addresses(policy.rank_decode(prompt, decodes)) == \
        [a for a in least_loaded if a != winner.address]
    winner.healthy = True
    assert addresses(policy.rank_decode(prompt[:15], decodes)) == \
        addresses(LeastLoaded().rank_decode(prompt, decodes))  # shorter than a block


def test_block_hashes_are_the_workers_cache_keys():
    """The index keys a prompt's full blocks as a worker's BlockManager seals them: a worker
    that computed a prompt shares exactly the blocks whose hashes the index would record."""
    prompt = list(range(300, 350))  # 3 full blocks of 16 and 2 tokens
    hashes = block_hashes(prompt, 16)
    assert len(hashes) == 3 and block_hashes(prompt[:47], 16) == hashes[:2]
    assert block_hashes(prompt, 8)[:1] != hashes[:1] and block_hashes(prompt[:15], 16) == []
    bm = BlockManager(16, 16)
    bm.allocate("a", prompt)
    bm.mark_computed("a", len(prompt))
    bm.free("a")
    for blocks in range(4):
        longer = prompt[:16 * blocks] + [9] * 20
        assert bm.allocate(f"b{blocks}", longer).num_cached_tokens == 16 * min(blocks, 3)
        bm.free(f"b{blocks}")
    assert block_hashes([7] * 16 + prompt[16:32], 16)[1] != hashes[1]  # chained on the first


def test_prefix_index_matches_leading_blocks_and_forgets_tails_first():
    index = PrefixIndex()
    a, b = block_hashes(list(range(64)), 16), block_hashes(list(range(100, 164)), 16)
    index.record("w:1", a, capacity_blocks=6)
    assert index.matched_blocks("w:1", a) == 4 and index.matched_blocks("w:2", a) == 0
    assert index.matched_blocks("w:1", a[:2] + b[2:]) == 2
    assert index.matched_blocks("w:1", [b[0]] + a[1:]) == 0  # leading blocks only
    index.record("w:1", b, capacity_blocks=6)  # 8 blocks > 6: a's two deepest go
    assert index.matched_blocks("w:1", a) == 2 and index.matched_blocks("w:1", b) == 4
    assert index.blocks_held("w:1") == 6
    index.record("w:2", a, capacity_blocks=6)
    index.forget({"w:2"})
    assert index.blocks_held("w:1") == 0 and index.matched_blocks("w:2", a) == 4


def cache_decode(address, used, free=100, running=0):
    load = WorkerLoad(kv_blocks_used=used, kv_blocks_free=free, running_sequences=running,
                      kv_block_size=16, role=DECODE)
    return WorkerState(address, DECODE, True, load, "")


def test_cache_aware_sends_a_chats_next_turn_back_to_its_history():
    """Turn 1 went to a:1; while a:1 holds more running blocks than b:1 (least-loaded would
    pick b:1), turn 2, which starts with turn 1's prompt, goes back to a:1 until a:1's load
    outweighs the prefill the cached blocks save: (1 + weight) x uncached + used."""
    policy = CacheAware()
    a, b = cache_decode("a:1", used=0), cache_decode("b:1", used=0)
    turn1 = list(range(1000, 1320))  # 20 blocks
    assert addresses(policy.rank_decode(turn1, [b, a])) == ["a:1", "b:1"]  # tie: address
    policy.note_routed(turn1, a, None)
    turn2 = turn1 + list(range(5000, 5064))  # 24 blocks, 20 of them on a:1
    # cost 2 * 4 + 30 = 38 < 48
    a.load = dataclasses.replace(a.load, kv_blocks_used=30, kv_blocks_free=70)
    assert addresses(LeastLoaded().rank_decode(turn2, [a, b]))[0] == "b:1"
    assert addresses(policy.rank_decode(turn2, [a, b])) == ["a:1", "b:1"]
    # 2 * 4 + 41 = 49 > 48: the load wins
    a.load = dataclasses.replace(a.load, kv_blocks_used=41, kv_blocks_free=59)
    assert addresses(policy.rank_decode(turn2, [a, b])) == ["b:1", "a:1"]
    heavier = CacheAware(overlap_weight=3.0)  # 4 * 4 + 41 = 57 < 4 * 24 = 96
    heavier.note_routed(turn1, a, None)
    assert addresses(heavier.rank_decode(turn2, [a, b])) == ["a:1", "b:1"]


def test_cache_aware_spreads_a_hot_prefix_over_every_worker():
    """Every request shares a 256-token system prompt. prefix-affinity sends them all to one
    worker while it has a free block; cache-aware sends the next one elsewhere once the
    first holds enough running blocks, and from then on both hold the prefix."""
    system = list(range(2000, 2256))
    decodes = [cache_decode(f"d{i}:1", used=0) for i in range(2)]
    policy, affinity, picks = CacheAware(), PrefixAffinity(), []
    for i in range(8):
        prompt = system + [i] * 40
        best = policy.rank_decode(prompt, decodes)[0]
        picks.append(best.address)
        policy.note_routed(prompt, best, None)
        best.load = dataclasses.replace(best.load, kv_blocks_used=best.load.kv_blocks_used + 19)
        assert affinity.rank_decode(prompt, decodes)[0] is affinity.rank_decode(system, decodes)[0]
    assert picks.count("d0:1") == 4 and picks.count("d1:1") == 4
    assert all(policy.index.matched_blocks(d.address, block_hashes(system, 16)) == 16
               for d in decodes)


def test_cache_aware_puts_full_and_unhealthy_workers_last_or_out():
    policy = CacheAware()
    prompt = list(range(64))
    full, fine = cache_decode("a:1", used=4, free=0), cache_decode("b:1", used=90)
    policy.note_routed(prompt, full, None)
    down = cache_decode("c:1", used=0)
    down.healthy = False
    assert addresses(policy.rank_decode(prompt, [full, fine, down])) == ["b:1", "a:1"]


def test_cache_aware_prefill_counts_cached_tokens_off_the_work_ahead():
    policy = CacheAware()
    p1, p2 = prefill_worker("p1:1", 300), prefill_worker("p2:1", 100)
    prompt = list(range(512))
    assert addresses(policy.rank_prefill(prompt, [p1, p2])) == ["p2:1", "p1:1"]
    policy.note_routed(prompt, cache_decode("d:1", 0), p1)  # p1 now holds the 32 blocks
    assert addresses(policy.rank_prefill(prompt + [1] * 10, [p1, p2])) == ["p1:1", "p2:1"]
    assert policy.index.blocks_held("p1:1") == 32
    for w, rate in ((p1, 1000.0), (p2, 100.0)):  # with rates: seconds, not tokens
        w.load = dataclasses.replace(w.load, prefill_tokens_per_s=rate)
    assert addresses(policy.rank_prefill(list(range(9000, 9100)), [p1, p2])) == ["p1:1", "p2:1"]
    # a worker that reports no cache size is given the prefill worker's default
    many = [list(range(k * 10000, k * 10000 + 16)) for k in range(DEFAULT_CAPACITY_BLOCKS + 5)]
    for prompt in many:
        policy.note_routed(prompt, cache_decode("d:1", 0), p2)
    assert policy.index.blocks_held("p2:1") == DEFAULT_CAPACITY_BLOCKS


def test_cache_aware_weight_must_be_a_number_at_least_zero():
    for bad in (-1, "2", True, float("nan")):
        with pytest.raises(ValueError, match="cache overlap weight must be a number >= 0"):
            CacheAware(bad)
    assert make_policy("cache-aware", overlap_weight=0).overlap_weight == 0.0


def test_router_command_line_picks_cache_aware_and_its_weight():
    from router.server import RouterSettings, build_parser, settings_from_args
    settings = settings_from_args(build_parser().parse_args([]))
    assert settings.policy == "cache-aware"
    assert settings.make_policy().overlap_weight == 1.0
    args = build_parser().parse_args(["--cache-overlap-weight", "2.5"])
    assert settings_from_args(args).make_policy().overlap_weight == 2.5
    with pytest.raises(ValueError, match="cache overlap weight must be a number >= 0, got -1"):
        RouterSettings(cache_overlap_weight=-1)
    assert isinstance(RouterSettings(policy="least-loaded").make_policy(), LeastLoaded)


def test_make_policy_names_the_choices():
    assert isinstance(make_policy("prefix-affinity"), PrefixAffinity)
    assert isinstance(make_policy("cache-aware"), CacheAware)
    with pytest.raises(ValueError, match="policy must be one of .*'round-robin'.*got 'fastest'"):
        make_policy("fastest")


# --- registry -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_split_host_port():
    assert split_host_port("10.1.2.3:50051") == ("10.1.2.3", 50051)
    assert split_host_port("[::1]:80") == ("::1", 80)
    assert split_host_port("decode.ns.svc.cluster.local:9000") == \
        ("decode.ns.svc.cluster.local", 9000)
    for bad in ("nohost", ":80", "host:0", "host:x", "host:70000"):
        with pytest.raises(ValueError, match=f"--decode must be host:port .* got '{bad}'"):
            split_host_port(bad, "--decode")


def test_registry_refuses_a_bad_address_naming_the_flag():
    with pytest.raises(ValueError, match="--decode address must be host:port"):
        Registry({DECODE: ["localhost"]})
    with pytest.raises(ValueError, match="--prefill-dns name must be host:port"):
        Registry(dns={PREFILL: ["svc:port"]})


def test_resolve_localhost_gives_every_address():
    port = free_port()
    expected = set()
    for *_, sockaddr in socket.getaddrinfo("localhost", port, type=socket.SOCK_STREAM):
        host = sockaddr[0]
        expected.add(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    got = asyncio.run(resolve(f"localhost:{port}"))
    assert got == sorted(expected)
    assert f"127.0.0.1:{port}" in got


def test_registry_polls_static_and_dns_workers_and_marks_dead_ones_unhealthy():
    dead_a, dead_b = free_port(), free_port()

    async def run():
        registry = Registry({DECODE: [f"127.0.0.1:{dead_a}"]},
                            {PREFILL: [f"localhost:{dead_b}"]}, poll_timeout_seconds=0.5)
        try:
            await registry.refresh()
            return ([(w.address, w.healthy, w.reason.split(":")[0])
                     for w in registry.workers(DECODE)],
                    addresses(registry.workers(PREFILL)), registry.healthy(PREFILL),
                    registry.refreshes)
        finally:
            await registry.close()

    decode, prefill, healthy_prefill, refreshes = asyncio.run(run())
    assert decode == [(f"127.0.0.1:{dead_a}", False, "UNAVAILABLE")]
    assert prefill == asyncio.run(resolve(f"localhost:{dead_b}"))
    assert healthy_prefill == []
    assert refreshes == 1


def test_registry_drops_addresses_that_disappear_from_dns():
    answers = [["10.0.0.1:9000", "10.0.0.2:9000"], ["10.0.0.2:9000", "10.0.0.3:9000"]]

    async def resolver(name):
        assert name == "svc:9000"
        return answers.pop(0)

    async def run():
        registry = Registry(dns={DECODE: ["svc:9000"]}, poll_timeout_seconds=0.2,
                            resolver=resolver)
        seen = []
        for _ in range(2):
            await registry.refresh()
            seen.append((addresses(registry.workers(DECODE)), registry.channel_addresses()))
        await registry.close()
        return seen

    assert asyncio.run(run()) == [
        (["10.0.0.1:9000", "10.0.0.2:9000"], ["10.0.0.1:9000", "10.0.0.2:9000"]),
        (["10.0.0.2:9000", "10.0.0.3:9000"], ["10.0.0.2:9000", "10.0.0.3:9000"])]


def test_registry_keeps_the_last_good_resolution_when_dns_fails():
    calls = []

    async def resolver(name):
        calls.append(name)
        if len(calls) > 1:
            raise socket.gaierror("temporary failure in name resolution")
        return ["10.0.0.7:9000"]

    async def run():
        registry = Registry(dns={PREFILL: ["svc:9000"]}, resolver=resolver)
        first = await registry.addresses(PREFILL)
        second = await registry.addresses(PREFILL)
        await registry.close()
        return first, second

    assert asyncio.run(run()) == (["10.0.0.7:9000"], ["10.0.0.7:9000"])


def test_a_server_without_the_decode_service_is_not_a_healthy_decode_worker():
    from nxdi_common.serving.grpc_server import GrpcServer

    async def run():
        server = GrpcServer([], 1 << 20)  # health and reflection only
        port = await server.start("127.0.0.1", 0)
        registry = Registry({DECODE: [f"127.0.0.1:{port}"]}, poll_timeout_seconds=2.0)
        try:
            await registry.refresh()
            return registry.workers(DECODE)[0]
        finally:
            await registry.close()
            await server.stop(0)

    w = asyncio.run(run())
    assert (w.healthy, w.reason.split(":")[0]) == (False, "UNIMPLEMENTED")


def test_optimistic_load_updates_spread_a_burst():
    async def run():
        registry = Registry({DECODE: ["d1:1", "d2:1"], PREFILL: ["p1:1"]})
        d1, d2 = registry.workers(DECODE)
        (p1,) = registry.workers(PREFILL)
        d1.healthy = d2.healthy = p1.healthy = True
        d1.load = WorkerLoad(kv_blocks_free=10, kv_blocks_used=2, kv_block_size=16)
        d2.load = WorkerLoad(kv_blocks_free=9, kv_block_size=16)
        p1.load = WorkerLoad(queued_prompt_tokens=5)
        registry.note_dispatch("d1:1", "p1:1", 40)  # ceil(41 / 16) = 3 blocks
        ranked = addresses(LeastLoaded().rank_decode([1], registry.workers(DECODE)))
        registry.note_refused("d2:1")
        return d1.load, d2.load, p1.load, ranked

    d1, d2, p1, ranked = asyncio.run(run())
    assert (d1.kv_blocks_free, d1.kv_blocks_used, d1.running_sequences) == (7, 5, 1)
    assert ranked == ["d2:1", "d1:1"]
    assert d2.kv_blocks_free == 0
    assert (p1.queued_prompt_tokens, p1.queued_requests) == (45, 1)


# --- dispatch without workers -------------------------------------------------------------------


def _with_fingerprint(address, role, weights_hash):
    fp = None if weights_hash is None else pb.ModelFingerprint(
        model_name="m", num_layers=2, num_kv_heads=2, head_dim=16, dtype=pb.DTYPE_FLOAT32,
        kv_quantization=pb.KV_QUANTIZATION_NONE, weights_hash=weights_hash)
    return WorkerState(address, role, healthy=True, load=WorkerLoad(fingerprint=fp))


def test_prefill_candidates_must_report_the_decode_workers_fingerprint():
    decode = _with_fingerprint("d:1", DECODE, "aaa")
    prefills = [_with_fingerprint("p:1", PREFILL, "bbb"), _with_fingerprint("p:2", PREFILL, "aaa"),
                _with_fingerprint("p:3", PREFILL, None), WorkerState("p:4", PREFILL)]
    # p:1 serves other weights: skipped; not yet reported (p:3, p:4): kept, in rank order.
    assert compatible_prefills(decode, prefills) == ["p:2", "p:3", "p:4"]
    # A decode worker that has not reported its fingerprint pairs with every candidate.
    assert compatible_prefills(WorkerState("d:2", DECODE), prefills) == ["p:1", "p:2", "p:3", "p:4"]
    # None compatible: no candidates, so the decode worker prefills locally.
    assert compatible_prefills(decode, prefills[:1]) == []


def test_dispatch_with_no_healthy_decode_worker_is_unavailable_and_counted_rejected():
    metrics = ServingMetrics("router")
    req = RoutedRequest("r1", (1, 2, 3), SamplingOptions(), StopOptions(max_tokens=4))

    async def run(registry):
        dispatcher = Dispatcher(registry, LeastLoaded(), metrics)
        try:
            with pytest.raises(Unavailable) as info:
                async for _ in dispatcher.generate(req):
                    pass
            return str(info.value)
        finally:
            await registry.close()

    assert asyncio.run(run(Registry())) == "no decode workers are configured or discovered"
    message = asyncio.run(run(Registry({DECODE: ["127.0.0.1:9"]})))
    assert message == "no healthy decode worker: 127.0.0.1:9 (not polled yet)"
    assert metrics.value("nxdi_requests_total", outcome="rejected") == 2
    assert metrics.value("nxdi_queue_depth_requests") == 0


# --- OpenAI requests -> internal ----------------------------------------------------------------


@pytest.fixture(scope="module")
def frontend(tiny_chat_model):
    return ModelFrontend.from_options(ModelOptions(model=str(tiny_chat_model),
                                                   max_model_len=MAX_MODEL_LEN))


def test_frontend_limits_come_from_the_checkpoint(frontend, tiny_chat_model):
    assert frontend.name == tiny_chat_model.name
    assert (frontend.limits.max_model_len, frontend.limits.vocab_size) == (MAX_MODEL_LEN, 49152)


def test_completion_request_converts_exactly(frontend):
    body = CompletionRequest.model_validate({
        "model": frontend.name, "prompt": "Hello world", "max_tokens": 5, "temperature": 0.5,
        "top_p": 0.9, "top_k": 40, "seed": 7, "stop": "\n", "logprobs": 2, "ignore_eos": True,
        "user": "u1", "n": 1, "echo": False, "stop_token_ids": [2]})
    routed = completion_to_routed(body, frontend, request_id="abc")
    assert routed == RoutedRequest(
        "abc", tuple(frontend.tokenizer.encode("Hello world")),
        SamplingOptions(temperature=0.5, top_k=40, top_p=0.9, seed=7, logprobs=True,
                        top_logprobs=2),
        StopOptions(max_tokens=5, stop_token_ids=(2,), stop_strings=("\n",), ignore_eos=True))


def test_completion_defaults_and_token_id_prompts(frontend):
    routed = completion_to_routed(CompletionRequest.model_validate({"prompt": [[5, 6, 7]]}),
                                  frontend)
    assert routed.prompt_ids == (5, 6, 7)
    assert routed.sampling == SamplingOptions()
    assert routed.stop == StopOptions(max_tokens=16)
    assert len(routed.request_id) == 32


def test_chat_request_applies_the_template(frontend):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                             {"type": "text", "text": "there"}]}]
    body = ChatRequest.model_validate({"messages": messages, "max_completion_tokens": 3,
                                       "logprobs": True, "top_logprobs": 4,
                                       "stop": ["a", "b"]})
    routed = chat_to_routed(body, frontend)
    text = frontend.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
        tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert routed.prompt_ids == tuple(frontend.tokenizer.encode(text, add_special_tokens=False))
    assert routed.sampling == SamplingOptions(logprobs=True, top_logprobs=4)
    assert routed.stop == StopOptions(max_tokens=3, stop_strings=("a", "b"))
    unlimited = chat_to_routed(ChatRequest.model_validate({"messages": messages}), frontend)
    assert unlimited.stop.max_tokens == MAX_MODEL_LEN - len(routed.prompt_ids)


COMPLETION_ERRORS = [
    ({"prompt": ""}, "prompt", "must not be empty"),
    ({"prompt": []}, "prompt", "must not be empty"),
    ({"prompt": "word " * 80}, "prompt", "the maximum context is 64 tokens"),
    ({"prompt": [49152]}, "prompt", "token id 49152 is outside [0, 49152)"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "must be an integer >= 1, got 0"),
    ({"prompt": "hi", "max_tokens": 64}, "max_tokens", "use at most 63"),
    ({"prompt": "hi", "temperature": -0.1}, "temperature", "must be a finite number >= 0"),
    ({"prompt": "hi", "top_p": 0}, "top_p", "must be in (0, 1], got 0"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p", "must be in (0, 1], got 1.5"),
    ({"prompt": "hi", "top_k": -2}, "top_k", "must be an integer >= -1"),
    ({"prompt": "hi", "seed": -1}, "seed", "must be in [0, 2**64)"),
    ({"prompt": "hi", "logprobs": 6}, "logprobs", "must be an integer in [0, 5], got 6"),
    ({"prompt": "hi", "stop": [""]}, "stop", "stop strings must be 1..256 characters"),
    ({"prompt": "hi", "stop_token_ids": [49152]}, "stop_token_ids", "outside [0, 49152)"),
    ({"prompt": "hi", "model": "gpt-4"}, "model", "model 'gpt-4' is not served here"),
    ({"prompt": "hi", "n": 17}, "n", "must be an integer in [1, 16], got 17"),
    ({"prompt": "hi", "best_of": 3}, "best_of", "is not supported"),
    ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs",
     "not available when stream"),
    ({"prompt": "hi", "suffix": "end"}, "suffix", "is not supported"),
    ({"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias", "keys must be token ids"),
    ({"prompt": "hi", "logit_bias": {"-5": 1}}, "logit_bias", "keys must be token ids"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias", "bias must be a number in "
                                                               "[-100, 100], got 101"),
    ({"prompt": "hi", "logit_bias": {"49152": 1}}, "logit_bias", "token id 49152 is outside"),
    ({"prompt": "hi", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias",
     "at most 1024 entries, got 1025"),
    ({"prompt": "hi", "response_format": {"type": "xml"}}, "response_format.type",
     "must be 'text', 'json_object' or 'json_schema', got 'xml'"),
    ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "must be a JSON Schema object"),
    ({"prompt": "hi", "response_format": {"type": "json_object", "schema": {}}},
     "response_format", "unsupported key 'schema'"),
    ({"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs", "needs exactly one of json, regex, choice, grammar"),
    ({"prompt": "hi", "structured_outputs": {"xml": "a"}}, "structured_outputs",
     "unsupported key 'xml'"),
    ({"prompt": "hi", "structured_outputs": {"choice": []}}, "structured_outputs.choice",
     "choice needs 1..256 alternatives, got 0"),
    ({"prompt": "hi", "structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice",
     "must be non-empty strings"),
    ({"prompt": "hi", "structured_outputs": {"json": "{oops"}}, "structured_outputs.json",
     "is not JSON"),
    ({"prompt": "hi", "structured_outputs": {"regex": ""}}, "structured_outputs.regex",
     "regex must not be empty"),
    ({"prompt": "hi", "structured_outputs": {"grammar": "x" * 70000}},
     "structured_outputs.grammar", "at most 65536"),
    ({"prompt": "hi", "structured_outputs": {"regex": "a"}, "response_format": {"type": "text"}},
     "structured_outputs", "not both"),
    ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty",
     "must be a number in [-2, 2], got 2.5"),
    ({"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty",
     "must be a number in [-2, 2], got -3"),
    ({"prompt": "hi", "tools": []}, "tools", "unrecognized request argument 'tools'"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options",
     "is only allowed when stream is true"),
]


@pytest.mark.parametrize("body,field,message", COMPLETION_ERRORS)
def test_completion_validation_errors_name_the_field(frontend, body, field, message):
    with pytest.raises(InvalidRequest) as info:
        completion_to_routed(CompletionRequest.model_validate(body), frontend)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert message in str(info.value)


FN = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
CHAT_ERRORS = [
    ({"messages": []}, "messages", "must contain at least one message"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "got 'robot'"),
    ({"messages": [{"role": "user", "content": "word " * 80}]}, "messages",
     "the maximum context is 64 tokens"),
    ({"max_tokens": 0}, "max_tokens", "must be an integer >= 1"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "must be an integer >= 1"),
    ({"max_completion_tokens": 1000}, "max_completion_tokens", "exceeds the maximum context"),
    ({"top_logprobs": 2}, "top_logprobs", "requires logprobs to be true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "must be in [0, 20]"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "must be an object with a 'name'"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "must be 'function'"),
    ({"tools": {"type": "function"}}, "tools", "must be a list"),
    ({"tools": [FN, {"type": "function", "function": {"name": "bad name"}}]},
     "tools[1].function.name", "must be 1-64 characters"),
    ({"tools": [FN, FN]}, "tools[1].function.name", "is given twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters", "must be a JSON Schema object"),
    ({"tools": [FN], "tool_choice": "sometimes"}, "tool_choice", "must be one of"),
    ({"tools": [FN], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice.function.name", "'g' is not one of the tools: ['lookup']"),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tools": [FN], "response_format": {"type": "json_object"}}, "response_format",
     "cannot be combined with tools"),
    ({"tools": [FN], "tool_choice": {"type": "function"}}, "tool_choice",
     "a named tool choice is"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "messages[0].tool_calls", "only an assistant message"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
     "messages[0].tool_calls[0]", "must be {"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "4"}]},
     "messages[1].tool_call_id", "needs the id of the call"),
    ({"functions": [FN["function"]]}, "functions", "is not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": []}},
     "response_format.json_schema", "must be an object"),
    ({"n": 0}, "n", "must be an integer in [1, 16], got 0"),
    ({"echo": True}, "echo", "unrecognized request argument 'echo'"),
]


@pytest.mark.parametrize("extra,field,message", CHAT_ERRORS)
def test_chat_validation_errors_name_the_field(frontend, extra, field, message):
    body = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **extra})
    with pytest.raises(InvalidRequest) as info:
        chat_to_routed(body, frontend, tools=chat_tools(body))
    assert info.value.field == field
    assert message in str(info.value)


def test_a_batch_of_prompts_is_a_request_each_and_errors_name_the_prompt(frontend):
    body = CompletionRequest.model_validate({"prompt": ["hi", [5, 6, 7]], "max_tokens": 2})
    first, second = completions_to_routed(body, frontend)
    assert second.prompt_ids == (5, 6, 7) and first.prompt_ids != second.prompt_ids
    assert first.request_id != second.request_id and second.stop.max_tokens == 2
    long = CompletionRequest.model_validate({"prompt": ["hi", "word " * 80]})
    with pytest.raises(InvalidRequest) as info:
        completions_to_routed(long, frontend)
    assert info.value.field == "prompt[1]"
    one = completions_to_routed(CompletionRequest.model_validate({"prompt": ["hi"]}), frontend)
    assert len(one) == 1


def test_penalties_reach_the_sampling_options(frontend):
    body = {"prompt": "hi", "presence_penalty": 0.5, "frequency_penalty": -1}
    sampling = completion_to_routed(CompletionRequest.model_validate(body), frontend).sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -1)
    chat = {"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 1.5}
    assert chat_to_routed(ChatRequest.model_validate(chat), frontend).sampling.penalized


def test_logit_bias_and_structured_outputs_reach_the_sampling_options(frontend):
    chat = {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"7": -100, "3": 2.5},
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "p", "strict": True, "schema": {"type": "object"}}}}
    sampling = chat_to_routed(ChatRequest.model_validate(chat), frontend).sampling
    assert sampling.logit_bias == ((3, 2.5), (7, -100.0))
    assert sampling.structured == StructuredOutput("json_schema", '{"type": "object"}')
    body = {"prompt": "hi", "response_format": {"type": "json_object"}}
    so = completion_to_routed(CompletionRequest.model_validate(body), frontend).sampling.structured
    assert so.kind == "json_schema" and json.loads(so.spec) == {"type": "object"}
    for given, want in [({"choice": ["yes", "no"]}, StructuredOutput("choice", choices=("yes", "no"))),
                        ({"regex": "[0-9]+"}, StructuredOutput("regex", "[0-9]+")),
                        ({"grammar": 'start: "a"'}, StructuredOutput("lark_grammar", 'start: "a"')),
                        ({"json": '{"type": "integer"}'},
                         StructuredOutput("json_schema", '{"type": "integer"}'))]:
        body = {"prompt": "hi", "structured_outputs": given}
        got = completion_to_routed(CompletionRequest.model_validate(body), frontend).sampling
        assert got.structured == want
    text = {"prompt": "hi", "response_format": {"type": "text"}}
    assert completion_to_routed(CompletionRequest.model_validate(text),
                                frontend).sampling.structured is None


@pytest.mark.parametrize("structured,field,message", [
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "regex does not compile"),
    ({"structured_outputs": {"grammar": "start: nothing"}}, "structured_outputs",
     'unknown name: "nothing"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
     "response_format", "json_schema does not compile"),
])
def test_a_constraint_that_does_not_compile_is_refused_by_name(frontend, structured, field,
                                                               message):
    body = CompletionRequest.model_validate({"prompt": "hi", **structured})
    routed = completion_to_routed(body, frontend)
    with pytest.raises(InvalidRequest) as info:
        asyncio.run(frontend.check_structured(routed.sampling, structured_field(body)))
    assert info.value.field == field and message in str(info.value)


def test_no_op_values_of_unsupported_parameters_are_accepted(frontend):
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 1, "tools": [],
            "tool_choice": "none", "presence_penalty": 0.0, "response_format": {"type": "text"},
            "logit_bias": None, "user": "x", "parallel_tool_calls": False}
    assert chat_to_routed(ChatRequest.model_validate(body), frontend).stop.max_tokens > 0


@pytest.mark.parametrize("body,loc", [
    ({"prompt": "hi", "temperature": "1"}, ("temperature",)),
    ({"prompt": "hi", "max_tokens": 1.5}, ("max_tokens",)),
    ({"prompt": "hi", "stream": "yes"}, ("stream",)),
    ({"prompt": [1, True]}, ("prompt",)),
    ({"prompt": ["a", 5]}, ("prompt",)),
    ({"prompt": ["a"] * 65}, ("prompt",)),
    ({"prompt": "hi", "stop": 5}, ("stop",)),
    ({}, ("prompt",)),
])
def test_completion_type_errors_are_located_at_the_field(body, loc):
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(body)
    assert info.value.errors()[0]["loc"] == loc


def test_chat_content_type_error_is_located_at_the_message():
    with pytest.raises(ValidationError) as info:
        ChatRequest.model_validate({"messages": [{"role": "user", "content": "a"},
                                                 {"role": "user", "content": [{"type": "image"}]}]})
    assert info.value.errors()[0]["loc"] == ("messages", 1, "content")


# --- OpenAI response shapes ---------------------------------------------------------------------


def outputs():
    return [TokenOutput("r", 72, 0, "Hi", logprob=-0.25, top_logprobs=(TokenLogprob(72, -0.25,
                                                                                     "Hi"),)),
            TokenOutput("r", 2, 1, "", logprob=-1.5, finish_reason="eos_token",
                        usage=Usage(prompt_tokens=3, completion_tokens=2))]


def test_completion_response_shape(frontend):
    routed = RoutedRequest("r", (1, 2, 3), SamplingOptions(logprobs=True, top_logprobs=1),
                           StopOptions(max_tokens=5))
    body = CompletionRequest.model_validate({"prompt": "x"})
    f = CompletionFormatter(frontend, routed, body)
    assert f.response_id == "cmpl-r"
    eos = frontend.token_text(2)
    assert f.response([outputs()]) == {
        "id": f.response_id, "object": "text_completion", "created": f.created,
        "model": frontend.name,
        "choices": [{"index": 0, "text": "Hi", "finish_reason": "stop", "logprobs": {
            "tokens": [frontend.token_text(72), eos], "token_logprobs": [-0.25, -1.5],
            "top_logprobs": [{"Hi": -0.25}, {}], "text_offset": [0, 2]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


def test_chat_stream_chunks_shape(frontend):
    routed = RoutedRequest("r", (1, 2, 3), SamplingOptions(), StopOptions(max_tokens=5))
    body = ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                       "stream": True,
                                       "stream_options": {"include_usage": True}})
    f = ChatFormatter(frontend, routed, body)
    head = {"id": f.response_id, "object": "chat.completion.chunk", "created": f.created,
            "model": frontend.name}
    chunks = f.start_chunks() + [f.token_chunk(o) for o in outputs()] + f.end_chunks()

    def choice(delta, finish=None):
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                     "finish_reason": finish}], "usage": None}
    assert chunks == [choice({"role": "assistant", "content": ""}), choice({"content": "Hi"}),
                      choice({"content": ""}, "stop"),
                      {**head, "choices": [], "usage": {"prompt_tokens": 3,
                                                        "completion_tokens": 2,
                                                        "total_tokens": 5}}]


def test_choices_are_indexed_and_usage_adds_their_tokens(frontend):
    routed = RoutedRequest("r", (1, 2, 3), SamplingOptions(), StopOptions(max_tokens=5))
    body = CompletionRequest.model_validate({"prompt": "x", "n": 2, "stream": True,
                                             "stream_options": {"include_usage": True}})
    f = CompletionFormatter(frontend, routed, body, n=2)
    a, b = outputs(), outputs()
    chunks = [f.token_chunk(a[0], 1), f.token_chunk(b[0], 0), f.token_chunk(a[1], 1)]
    assert [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in chunks] == \
        [(1, "Hi"), (0, "Hi"), (1, "")]
    assert f.end_chunks()[0]["usage"]["completion_tokens"] == 2 + 1  # choice 0 had one token
    full = CompletionFormatter(frontend, routed, body, n=2).response([a, b[:1]])
    assert [c["index"] for c in full["choices"]] == [0, 1]
    assert full["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    # two prompts (3 and 2 tokens), two choices each: each prompt counted once
    other = RoutedRequest("q", (4, 5), SamplingOptions(), StopOptions(max_tokens=5))
    batch = CompletionFormatter(frontend, routed, body, n=2, prompts=[routed, other])
    assert batch.n == 4 and batch.token_chunk(a[0], 3)["choices"][0]["index"] == 3
    assert batch.response([a, a, [], []])["usage"] == {
        "prompt_tokens": 3 + 2, "completion_tokens": 4, "total_tokens": 9}


def test_finish_reason_mapping():
    assert [finish_reason(r) for r in ("length", "eos_token", "stop_token", "stop_string",
                                       None)] == ["length", "stop", "stop", "stop", None]
    with pytest.raises(WorkerError, match="finish reason 'cancelled'") as info:
        finish_reason("cancelled")
    assert info.value.http_status == 503


# --- conditional disaggregation ------------------------------------------------------------------


def busy_prefill(address, queued=0, running=0):
    load = WorkerLoad(queued_prompt_tokens=queued, running_prompt_tokens=running, role=PREFILL)
    return WorkerState(address, PREFILL, True, load, "")


def test_local_prefill_rule_needs_a_short_prompt_and_every_prefill_worker_busy():
    rule = LocalPrefillRule(max_tokens=256, queue_tokens=1000)
    idle, busy = busy_prefill("p1:1", queued=100), busy_prefill("p2:1", queued=300, running=900)
    assert rule.prefill_locally(256, [busy])
    assert not rule.prefill_locally(257, [busy])  # too long: a prefill worker takes it
    assert not rule.prefill_locally(10, [busy, idle])  # one worker keeps up: remote
    assert rule.prefill_locally(10, [busy, busy_prefill("p3:1", running=1000)])
    assert not LocalPrefillRule().prefill_locally(10, [busy])  # off by default
    assert LocalPrefillRule(64, 0).prefill_locally(64, [idle])  # threshold 0: always local
    with pytest.raises(ValueError, match="local prefill queue_tokens must be an integer >= 0"):
        LocalPrefillRule(64, -1)


def test_short_prompts_can_always_be_local_and_long_ones_when_the_pool_is_busy():
    rule = LocalPrefillRule(max_tokens=2048, queue_tokens=1000, always_tokens=256)
    idle, busy = busy_prefill("p1:1", queued=100), busy_prefill("p2:1", running=1200)
    assert rule.prefill_locally(256, [idle])  # short: local whatever the pool's queue
    assert not rule.prefill_locally(257, [idle])  # longer, pool keeps up: remote
    assert rule.prefill_locally(2048, [busy])  # longer, pool busy: local
    assert not rule.prefill_locally(2049, [busy])
    assert LocalPrefillRule(always_tokens=64).prefill_locally(64, [busy])
    with pytest.raises(ValueError, match="local prefill always_tokens must be an integer >= 0"):
        LocalPrefillRule(always_tokens=-1)


def rated(address, role, rate, received_ns, queued=0, running=0):
    load = WorkerLoad(queued_prompt_tokens=queued, running_prompt_tokens=running, role=role,
                      prefill_tokens_per_s=rate, received_ns=received_ns)
    return WorkerState(address, role, True, load, "")


def test_tokens_ahead_count_down_at_the_reported_rate_from_the_poll():
    s = 10**9
    w = rated("p1:1", PREFILL, 500.0, received_ns=100 * s, queued=400, running=1000)
    assert prompt_tokens_ahead(w, 100 * s) == 1400
    assert prompt_tokens_ahead(w, 101 * s) == 900  # a second at 500 tok/s since the poll
    assert prompt_tokens_ahead(w, 104 * s) == 0  # never below nothing
    assert prompt_tokens_ahead(w, 99 * s) == 1400  # a poll "from the future": no progress
    unrated = rated("p2:1", PREFILL, 0.0, received_ns=100 * s, queued=400)
    assert prompt_tokens_ahead(unrated, 105 * s) == 400  # no rate measured: as reported
    assert prefill_eta_s(w.load, 600, 101 * s) == pytest.approx((900 + 600) / 500)
    assert prefill_eta_s(unrated.load, 600, 101 * s) is None


def test_local_prefill_goes_where_the_prompt_would_be_prefilled_first():
    s = 10**9
    rule = LocalPrefillRule(max_tokens=2048, queue_tokens=1000, always_tokens=256)
    # session 19's case: the prefill worker has a long prompt's 1400 tokens ahead, the decode
    # worker 700 of another one left at a third of the rate: remote (5 s against 11.5 s)
    remote = rated("p1:1", PREFILL, 600.0, received_ns=100 * s, running=1400)
    local = rated("d1:1", DECODE, 200.0, received_ns=100 * s, queued=700)
    assert not rule.prefill_locally(1600, [remote], local, now_ns=100 * s)
    # the decode worker free and as fast: local (the pool has >= queue_tokens ahead)
    idle_local = rated("d1:1", DECODE, 600.0, received_ns=100 * s)
    assert rule.prefill_locally(1600, [remote], idle_local, now_ns=100 * s)
    # the same remote report 1 s older: 600 tokens less ahead, below queue_tokens: remote
    assert not rule.prefill_locally(1600, [remote], idle_local, now_ns=101 * s)
    # the soonest of several candidates is what local must beat
    soon = rated("p2:1", PREFILL, 1200.0, received_ns=100 * s, running=1000)
    slow_local = rated("d1:1", DECODE, 300.0, received_ns=100 * s)
    assert rule.prefill_locally(500, [remote], slow_local, now_ns=100 * s)  # 1.67 <= 3.17 s
    assert not rule.prefill_locally(500, [remote, soon], slow_local, now_ns=100 * s)  # > 1.25
    # a side without a measured rate does not veto, but a decode worker without one that
    # already has local prompts waiting takes no more (they may not be moving at all; session
    # 58's collapse); short prompts stay local whatever
    assert rule.prefill_locally(1600, [remote], rated("d1:1", DECODE, 0.0, 100 * s),
                                now_ns=100 * s)
    assert not rule.prefill_locally(1600, [remote], rated("d1:1", DECODE, 0.0, 100 * s, 5000),
                                    now_ns=100 * s)
    assert rule.prefill_locally(200, [remote], rated("d1:1", DECODE, 0.0, 100 * s, 5000),
                                now_ns=100 * s)
    assert rule.prefill_locally(1600, [rated("p1:1", PREFILL, 0.0, 0, running=1400)], local,
                                now_ns=100 * s)
    assert rule.prefill_locally(200, [remote], local, now_ns=100 * s)



def whole_core(address, rate, whole, received_ns, queued=0, hold_budget=None):
    """A decode worker reporting its paced local rate and its whole core's (and the stall its
    running streams can take within their TPOT target)."""
    load = WorkerLoad(queued_prompt_tokens=queued, role=DECODE, prefill_tokens_per_s=rate,
                      received_ns=received_ns, whole_core_prefill_tokens_per_s=whole,
                      hold_budget_s=hold_budget)
    return WorkerState(address, DECODE, True, load, "")


def test_a_long_prompt_the_prefill_pool_would_make_late_goes_local_with_the_steps_held():
    """hold_ttft_s: a prompt the paced rule leaves to the pool goes to the decode worker, with
    its steps held, when every candidate would finish it past hold_ttft_s and the decode worker
    at its whole core's rate (local prompts ahead first) within it and sooner; off at 0, and
    never where the decode worker reports no whole-core rate (no local prefill thread)."""
    s = 10**9
    rule = LocalPrefillRule(max_tokens=512, queue_tokens=1024, hold_ttft_s=3.5)
    busy = rated("p1:1", PREFILL, 600.0, received_ns=100 * s, running=1500)  # 2.5 s ahead
    decode = whole_core("d1:1", 200.0, 700.0, received_ns=100 * s)
    choice = rule.choose(1400, [busy], decode, now_ns=100 * s)  # 4.83 s remote, 2.0 s held
    assert (choice.local, choice.hold_steps) == (True, True)
    assert choice.local_eta_s == pytest.approx(1400 / 700)
    assert choice.remote_eta_s == pytest.approx(2900 / 600)
    assert choice.note() == "local:2.00s,prefill:4.83s,held"
    # the pool in time (the same report 2 s later: 1200 tokens less ahead): remote
    assert not rule.choose(1400, [busy], decode, now_ns=102 * s).local
    # local prompts ahead on the decode worker push it past the budget: remote, late or not
    loaded = whole_core("d1:1", 200.0, 700.0, received_ns=100 * s, queued=1200)
    late = rule.choose(1400, [busy], loaded, now_ns=100 * s)  # 3.71 s local > 3.5
    assert not late.local and not late.hold_steps
    assert late.local_eta_s == pytest.approx(2600 / 700)
    # no whole-core rate reported, the rule off, or no rate from the pool: remote
    for rule_, worker, pool in ((rule, whole_core("d1:1", 200.0, 0.0, 100 * s), [busy]),
                                (LocalPrefillRule(512, 1024), decode, [busy]),
                                (rule, decode, [rated("p1:1", PREFILL, 0.0, 0, running=1500)])):
        assert not rule_.choose(1400, pool, worker, now_ns=100 * s).local
    # a short prompt the paced rule takes is not held
    short = rule.choose(300, [busy], decode, now_ns=100 * s)
    assert short.local and not short.hold_steps
    with pytest.raises(ValueError, match="hold_ttft_s must be a number of seconds >= 0"):
        LocalPrefillRule(hold_ttft_s=-1)
    # the decode request carries the flag; the worker's report its whole-core rate
    req = RoutedRequest("r1", (1, 2), SamplingOptions(), StopOptions(max_tokens=4))
    assert convert.decode_request(req, [], hold_steps=True).hold_steps_for_prefill
    assert not convert.decode_request(req, ["p1:1"]).hold_steps_for_prefill
    report = pb.WorkerLoad(role=pb.WORKER_ROLE_DECODE, whole_core_prefill_tokens_per_s=650.0)
    assert convert.load_from_proto(report).whole_core_prefill_tokens_per_s == 650.0


def test_a_prompt_is_held_only_where_its_prefill_fits_the_streams_tpot_budget():
    """hold_budget_s: a decode worker reports the stall its running streams can take within
    their TPOT target; a held prompt (with the local prompts ahead) goes at the whole core's
    rate for that long and at the paced local rate after it (held_eta_s), and is held only
    where that still ends within hold_ttft_s. A worker that reports none (nothing limits it,
    or an older worker) is weighed at its whole core's rate; the field travels through the
    load report, absent and present (0 and below included)."""
    s = 10**9
    rule = LocalPrefillRule(max_tokens=512, queue_tokens=1024, hold_ttft_s=3.5)
    busy = rated("p1:1", PREFILL, 600.0, received_ns=100 * s, running=1500)  # 4.83 s remote
    # 1400 tokens, whole core 700 tok/s (2.0 s), paced 200 tok/s
    for budget, eta in ((None, 2.0), (2.5, 2.0), (2.0, 2.0), (1.5, 1.5 + 350 / 200),
                        (1.0, 1.0 + 700 / 200), (0.0, 1400 / 200), (-1.0, 1400 / 200)):
        decode = whole_core("d1:1", 200.0, 700.0, received_ns=100 * s, hold_budget=budget)
        choice = rule.choose(1400, [busy], decode, now_ns=100 * s)
        assert choice.local_eta_s == pytest.approx(eta), budget
        assert (choice.local, choice.hold_steps) == (eta <= 3.5,) * 2, budget
    # the local prompts ahead are held too: they count against the budget
    ahead = whole_core("d1:1", 200.0, 700.0, received_ns=100 * s, queued=700, hold_budget=2.5)
    choice = rule.choose(1400, [busy], ahead, now_ns=100 * s)
    assert not choice.local and choice.local_eta_s == pytest.approx(2.5 + 350 / 200)
    # past the budget with no paced rate known: not weighed, not held
    unpaced = whole_core("d1:1", 0.0, 700.0, received_ns=100 * s, hold_budget=1.0)
    choice = rule.choose(1400, [busy], unpaced, now_ns=100 * s)
    assert not choice.local and choice.note() == "local:-,prefill:4.83s"
    assert convert.load_from_proto(pb.WorkerLoad(role=pb.WORKER_ROLE_DECODE)).hold_budget_s \
        is None
    for budget in (1.25, 0.0, -0.5):
        report = pb.WorkerLoad(role=pb.WORKER_ROLE_DECODE, hold_budget_s=budget)
        assert convert.load_from_proto(report).hold_budget_s == budget


def test_the_local_prefill_rule_reports_both_sides_estimates():
    """choose(): prefill_locally's answer with the estimated seconds to finish the prompt on
    each side where the rule weighed them, as the router's request line shows them."""
    s = 10**9
    rule = LocalPrefillRule(max_tokens=2048, queue_tokens=1000, always_tokens=256)
    remote = rated("p1:1", PREFILL, 600.0, received_ns=100 * s, running=1400)
    soon = rated("p2:1", PREFILL, 1200.0, received_ns=100 * s, running=1000)
    slow_local = rated("d1:1", DECODE, 300.0, received_ns=100 * s)
    choice = rule.choose(500, [remote, soon], slow_local, now_ns=100 * s)
    assert not choice.local  # 1.67 s here against the soonest candidate's 1.25 s
    assert choice.local_eta_s == pytest.approx(500 / 300)
    assert choice.remote_eta_s == pytest.approx((1000 + 500) / 1200)
    assert choice.note() == "local:1.67s,prefill:1.25s"
    taken = rule.choose(500, [remote], slow_local, now_ns=100 * s)
    assert taken.local and taken.note() == "local:1.67s,prefill:3.17s"
    # a side without a measured rate shows as "-"; not weighed at all (short prompts always
    # local, the pool keeping up): no estimates
    unrated = rule.choose(1600, [remote], rated("d1:1", DECODE, 0.0, 100 * s), now_ns=100 * s)
    assert unrated.local and unrated.note() == "local:-,prefill:5.00s"
    assert rule.choose(200, [remote], slow_local, now_ns=100 * s) == LocalChoice(True)
    assert rule.choose(1600, [remote], slow_local, now_ns=103 * s) == LocalChoice(False)
    assert LocalChoice(True).note() == ""
    for args in [(500, [remote, soon], slow_local), (500, [remote], slow_local),
                 (200, [remote], slow_local)]:
        assert rule.prefill_locally(*args, now_ns=100 * s) == rule.choose(
            *args, now_ns=100 * s).local


def test_a_request_line_shows_the_local_prefill_rules_estimates(caplog):
    """A dispatch that weighs the two sides keeps the rule's estimates for the request's line
    on the router.requests logger (eta=local:..,prefill:..); a line without them has no eta."""
    from router.dispatch import _Tracker
    now = time.monotonic_ns()
    rule = LocalPrefillRule(max_tokens=2048, queue_tokens=1000)
    req = RoutedRequest("r1", tuple(range(500)), SamplingOptions(), StopOptions(max_tokens=4))

    async def start():
        registry = Registry({DECODE: ["127.0.0.1:9"], PREFILL: ["127.0.0.1:10"]})
        (d1,), (p1,) = registry.workers(DECODE), registry.workers(PREFILL)
        d1.healthy = p1.healthy = True
        d1.load = rated(d1.address, DECODE, 500.0, received_ns=now).load
        p1.load = rated(p1.address, PREFILL, 500.0, received_ns=now, running=2000).load
        dispatcher = Dispatcher(registry, LeastLoaded(), ServingMetrics("router"),
                                local_prefill=rule)
        try:
            call, first, eta = dispatcher._start(d1, req, [p1], time.monotonic() + 5)
            call.cancel()
            return first, eta
        finally:
            await registry.close()

    first, eta = asyncio.run(start())
    assert first is None  # prefilled locally: no candidate offered
    local_s, remote_s = (float(x.split(":")[1].rstrip("s")) for x in eta.split(","))
    assert eta.startswith("local:") and local_s == pytest.approx(1.0, abs=0.02)
    assert remote_s == pytest.approx(5.0, abs=0.02) and local_s <= remote_s
    tracker = _Tracker(ServingMetrics("router"), 500, time.monotonic())
    tracker.prefill, tracker.eta = "local", eta
    with caplog.at_level(logging.INFO, logger="router.requests"):
        tracker.log("r1", "ok", "127.0.0.1:9", None, "")
        tracker.eta = ""
        tracker.log("r2", "ok", "127.0.0.1:9", None, "")
    lines = [r.getMessage() for r in caplog.records if r.name == "router.requests"]
    assert len(lines) == 2
    assert "prefill=local" in lines[0] and lines[0].endswith(f" eta={eta}")
    assert " eta=" not in lines[1]

def test_a_dispatch_queues_the_prompt_where_it_is_prefilled_counted_down_to_now():
    async def run():
        registry = Registry({DECODE: ["d1:1"], PREFILL: ["p1:1"]})
        (d1,), (p1,) = registry.workers(DECODE), registry.workers(PREFILL)
        d1.healthy = p1.healthy = True
        then = time.monotonic_ns() - 10**9  # polled a second ago
        d1.load = WorkerLoad(kv_blocks_free=100, kv_block_size=16, queued_prompt_tokens=300,
                             prefill_tokens_per_s=100.0, received_ns=then)
        p1.load = WorkerLoad(queued_prompt_tokens=500, running_prompt_tokens=800,
                             prefill_tokens_per_s=600.0, received_ns=then)
        registry.note_dispatch("d1:1", "p1:1", 1000)  # remote
        remote = (d1.load, p1.load)
        registry.note_dispatch("d1:1", None, 150)  # no candidate sent: local
        return remote, d1.load

    (d_remote, p_remote), d_local = asyncio.run(run())
    # the prefill worker did ~600 of its running 800 tokens since the poll; 1000 more queued
    assert p_remote.running_prompt_tokens == pytest.approx(200, abs=15)
    assert p_remote.queued_prompt_tokens == 1500
    assert d_remote.queued_prompt_tokens == pytest.approx(200, abs=5)  # counted down only
    assert d_local.queued_prompt_tokens == pytest.approx(350, abs=5)  # and the local prompt
    assert d_local.running_sequences == 2


def test_prefill_ranking_counts_the_tokens_being_prefilled():
    workers = [busy_prefill("p1:1", queued=100, running=900), busy_prefill("p2:1", queued=500)]
    assert addresses(LeastLoaded().rank_prefill([1], workers)) == ["p2:1", "p1:1"]


def test_prefill_ranking_puts_the_soonest_finisher_first_when_every_rate_is_known():
    """A fast worker with more ahead finishes a 500-token prompt first: (1000 + 500) / 2000 =
    0.75 s against (500 + 500) / 500 = 2 s. Without a rate from every worker the ranking is by
    tokens ahead, as before; the prefix-affinity policy falls back to the same key."""
    now = time.monotonic_ns()
    fast = rated("p1:1", PREFILL, 2000.0, received_ns=now, running=1000)
    slow = rated("p2:1", PREFILL, 500.0, received_ns=now, queued=500)
    prompt = list(range(500))
    assert addresses(LeastLoaded().rank_prefill(prompt, [slow, fast])) == ["p1:1", "p2:1"]
    assert addresses(PrefixAffinity().rank_prefill(prompt[:10], [slow, fast])) == [
        "p1:1", "p2:1"]  # shorter than one block: no affinity, least-loaded order
    new = rated("p3:1", PREFILL, 0.0, received_ns=now, queued=800)  # not measured yet
    assert addresses(LeastLoaded().rank_prefill(prompt, [slow, fast, new])) == [
        "p2:1", "p3:1", "p1:1"]


def test_router_settings_name_a_bad_local_prefill_value():
    from router.server import RouterSettings
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 0, got -5"):
        RouterSettings(local_prefill_max_tokens=-5)


def test_router_command_line_sets_the_local_prefill_rule():
    from router.server import build_parser, settings_from_args
    args = build_parser().parse_args(["--local-prefill-max-tokens", "2048",
                                      "--local-prefill-queue-tokens", "1024",
                                      "--local-prefill-always-tokens", "256"])
    assert settings_from_args(args).local_prefill == LocalPrefillRule(2048, 1024, 256)
    args = build_parser().parse_args(["--local-prefill-hold-ttft-seconds", "3.5"])
    assert settings_from_args(args).local_prefill == LocalPrefillRule(hold_ttft_s=3.5)


def test_router_command_line_takes_a_nice_value(capsys):
    """--nice N (0-19) runs every thread of the router at that OS nice value (apply_nice, as
    the workers'; a worker started with it: test_background_prefill); unset by default, and
    anything else refused naming the option."""
    from router.server import build_parser
    assert build_parser().parse_args([]).nice is None
    assert build_parser().parse_args(["--nice", "12"]).nice == 12
    for bad in ("20", "-3", "x"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--nice", bad])
        assert "--nice must be an integer in [0, 19]" in capsys.readouterr().err


def test_router_command_line_takes_a_wake_interval(capsys):
    """--wake-ms MS wakes the router's event loop every MS ms (wake_every; a spawned router
    with it: test_background_prefill); 0 (off) by default, and values outside [0.1, 1000] or
    not numbers refused naming the option."""
    from router.server import build_parser
    assert build_parser().parse_args([]).wake_ms == 0
    assert build_parser().parse_args(["--wake-ms", "1"]).wake_ms == 1.0
    assert build_parser().parse_args(["--wake-ms", "0"]).wake_ms == 0
    for bad in ("0.05", "-1", "1001", "x", "nan", "inf"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--wake-ms", bad])
        assert "--wake-ms must be 0 (off) or milliseconds in [0.1, 1000]" in \
            capsys.readouterr().err


def test_wake_every_wakes_the_loop_at_its_interval_until_cancelled():
    from router.server import wake_every

    async def run() -> int:
        counter = [0]
        task = asyncio.ensure_future(wake_every(0.002, counter))
        await asyncio.sleep(0.1)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        woken = counter[0]
        await asyncio.sleep(0.02)
        assert counter[0] == woken  # cancelled: no more wake-ups
        return woken

    assert 10 <= asyncio.run(run()) <= 50  # every 2 ms for 0.1 s (timers may run late)
