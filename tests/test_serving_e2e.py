"""End to end on real processes and loopback sockets: router + prefill + decode workers started
by the launcher, the bundled SmolLM2 in fp32 for truth against transformers, the tiny chat model for
load. No mocks: every request crosses the HTTP gateway or the gRPC Router, the decode worker pulls
KV from a prefill worker (Prefill stream for control, the KV socket it offers for the bytes)."""
import asyncio
import re
import time

import grpc
import pytest
import torch

from nxdi_common.serving.launcher import Cluster, LaunchSpec, connectable
from protos.nxdi.serving.v1 import serving_pb2 as pb
from protos.nxdi.serving.v1 import serving_pb2_grpc as pb_grpc

TEXT = ("The history of astronomy spans thousands of years. Early civilizations watched the sky to "
        "keep calendars, plan harvests and navigate the seas. Babylonian scribes recorded the "
        "positions of planets on clay tablets, Greek philosophers proposed geometric models of "
        "the heavens, and Islamic scholars refined those models and preserved ancient texts. ")


@pytest.fixture(scope="module")
def tokenizer(bundled_model_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(bundled_model_path)


@pytest.fixture(scope="module")
def hf_model(bundled_model_path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(bundled_model_path, dtype=torch.float32).eval()


def reference(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False)
    return out[0, len(ids):].tolist()


def prompt_of(tokenizer, n, offset=0):
    ids = tokenizer((TEXT * 40)[offset:]).input_ids
    return ids[:n]


async def router_generate(address, ids, max_tokens, **sampling):
    async with grpc.aio.insecure_channel(address) as channel:
        req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids),
                                 sampling=pb.SamplingParams(temperature=0.0, **sampling),
                                 stop=pb.StopCriteria(max_tokens=max_tokens, ignore_eos=True))
        return [e async for e in pb_grpc.RouterStub(channel).Generate(req)]


@pytest.fixture(scope="module")
def fp32_cluster(bundled_model_path):
    spec = LaunchSpec(dtype="float32", backend="eager", max_model_len=1024, prefill_workers=2,
                      decode_workers=2, threads=1, decode_args=["--kv-blocks", "1100"])
    with Cluster(spec) as cluster:
        yield cluster


def test_every_service_freezes_its_startup_heap_before_it_serves(fp32_cluster):
    """Each service, loaded, takes its startup objects out of the garbage collector's passes
    (grpc_server.freeze_startup_heap) and logs how many; the first test on the cluster, while the
    start-up lines are still in the output tails. The log line goes to stderr and the ready line to
    stdout, drained by two threads, so the tail does not keep their order: the line is looked for
    anywhere in the tail, waiting a moment for the stderr thread (that the freeze comes before the
    ready line is the services' code, and test_grpc_server checks what it freezes)."""
    for child in [*fp32_cluster.workers, fp32_cluster.router]:
        pattern = re.compile(rf"{child.role}: ([0-9]+) startup objects frozen")
        deadline = time.monotonic() + 10
        while not (found := [m for line in child.tail.lines() if (m := pattern.search(line))]):
            assert time.monotonic() < deadline, (child.role, child.tail.lines()[-10:])
            time.sleep(0.05)
        assert len(found) == 1 and int(found[0].group(1)) >= 1000, (child.role, found)


def test_grpc_router_greedy_matches_transformers_2p2d_16_concurrent(fp32_cluster, tokenizer,
                                                                      hf_model):
    lengths = [32 + (900 - 32) * i // 15 for i in range(16)]
    prompts = [prompt_of(tokenizer, n, offset=7 * i) for i, n in enumerate(lengths)]
    assert [len(p) for p in prompts] == lengths

    async def all_at_once():
        return await asyncio.gather(*(router_generate(fp32_cluster.grpc_address, p, 6)
                                      for p in prompts))

    before = prefill_outcomes(fp32_cluster)
    results = asyncio.run(all_at_once())
    for ids, events in zip(prompts, results):
        assert [e.token_id for e in events] == reference(hf_model, ids, 6)
        assert events[-1].usage.prompt_tokens == len(ids)
    # Every transfer ended as delivered on the prefill side: the decode worker reads each stream
    # to its end instead of cancelling it once the done message arrives.
    # Every prompt's KV (fp32: 46 KB a token, so >= 1.4 MB, above the KV socket's default
    # threshold) crossed on a KV socket, none fell back.
    moved = {k: v - before[k] for k, v in prefill_outcomes(fp32_cluster).items()}
    assert moved == {"ok": 16, "cancelled": 0, "socket": 16, "fallback": 0}, moved


def prefill_outcomes(cluster) -> dict[str, float]:
    """Prefill streams ended ok / cancelled, and KV sent on a KV socket / fallen back to the
    stream, summed over the cluster's prefill workers."""
    urls = [f"http://{connectable(w.ready['metrics'])}/metrics" for w in cluster.workers
            if w.role == "prefill"]
    names = {o: f'nxdi_requests_total{{outcome="{o}",role="prefill"}}' for o in ("ok", "cancelled")}
    names.update(socket='nxdi_kv_socket_transfers_total{role="prefill"}',
                 fallback='nxdi_kv_socket_fallbacks_total{role="prefill"}')
    return {key: sum(metric(url, name) for url in urls) for key, name in names.items()}


def test_http_greedy_matches_transformers(fp32_cluster, tokenizer, hf_model):
    import httpx
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        ids = tokenizer(prompt).input_ids
        body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 12,
                "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{fp32_cluster.http_url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == tokenizer.decode(reference(hf_model, ids, 12),
                                                  skip_special_tokens=True)
        assert r.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12,
                                     "total_tokens": len(ids) + 12}


def test_streaming_is_incremental(fp32_cluster, tokenizer):
    """The first token reaches the client while the decode worker is still generating."""
    async def scenario():
        async with grpc.aio.insecure_channel(fp32_cluster.grpc_address) as channel:
            req = pb.GenerateRequest(prompt="Tell me a long story.",
                                     sampling=pb.SamplingParams(temperature=0),
                                     stop=pb.StopCriteria(max_tokens=200, ignore_eos=True))
            call = pb_grpc.RouterStub(channel).Generate(req)
            first = await call.read()
            loads = [await decode_load(w.grpc) for w in fp32_cluster.workers
                     if w.role == "decode"]
            rest = []
            while (event := await call.read()) != grpc.aio.EOF:
                rest.append(event)
            return first, loads, rest

    first, loads, rest = asyncio.run(scenario())
    assert first.index == 0 and first.finish_reason == pb.FINISH_REASON_UNSPECIFIED
    # Still in the decode worker (pulling its KV, which follows the first token, or generating)
    assert sum(load.running_sequences + load.queued_requests for load in loads) == 1
    assert len(rest) == 199 and rest[-1].finish_reason == pb.FINISH_REASON_LENGTH


async def decode_load(address):
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.DecodeStub(channel).GetLoad(pb.GetLoadRequest())


async def prefill_load(address):
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.PrefillStub(channel).GetLoad(pb.GetLoadRequest())


def test_openai_client_completions_and_chat(fp32_cluster):
    from openai import OpenAI
    client = OpenAI(base_url=f"{fp32_cluster.http_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    done = client.completions.create(model=model, prompt="Paris is", max_tokens=5, temperature=0)
    streamed = client.completions.create(model=model, prompt="Paris is", max_tokens=5,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text
    assert done.usage.completion_tokens == 5 or done.choices[0].finish_reason == "stop"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                          temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                                 temperature=0, stream=True))
    streamed_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chat.choices[0].message.role == "assistant"
    assert streamed_text == chat.choices[0].message.content and "Paris" in streamed_text


def test_reflection_lists_every_service(fp32_cluster):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import \
        ProtoReflectionDescriptorDatabase
    expected = {"router": "nxdi.serving.v1.Router", "prefill": "nxdi.serving.v1.Prefill",
                "decode": "nxdi.serving.v1.Decode"}
    targets = [("router", fp32_cluster.grpc_address)] + \
        [(w.role, w.grpc) for w in fp32_cluster.workers]
    for role, address in targets:
        with grpc.insecure_channel(address) as channel:
            services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert {expected[role], "grpc.health.v1.Health",
                "grpc.reflection.v1alpha.ServerReflection"} <= services, (role, services)


def test_fingerprint_mismatch_is_failed_precondition(fp32_cluster, spawn, bundled_model_path):
    other = spawn("prefill_service", "--model", bundled_model_path, "--dtype", "bfloat16",
                  "--backend", "eager", "--threads", "1", "--max-model-len", "1024")
    decode = fp32_cluster.worker("decode", 0).grpc

    async def scenario():
        async with grpc.aio.insecure_channel(decode) as channel:
            req = pb.DecodeRequest(request_id="fp", prompt_token_ids=[1, 2, 3, 4],
                                   prefill_candidates=[other.grpc],
                                   stop=pb.StopCriteria(max_tokens=2))
            return [e async for e in pb_grpc.DecodeStub(channel).Generate(req)]

    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(scenario())
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "dtype" in err.value.details()
    assert asyncio.run(decode_load(decode)).kv_blocks_used == 0


def test_seeded_sampling_same_with_remote_or_local_prefill(fp32_cluster, tokenizer):
    """Draw 0 of the request's random stream samples the first token on whichever worker
    prefills; so a seeded request gives the same tokens either way (and different seeds differ)."""
    decode = fp32_cluster.worker("decode", 0).grpc
    ids = prompt_of(tokenizer, 40)

    async def sample(seed, candidates):
        async with grpc.aio.insecure_channel(decode) as channel:
            req = pb.DecodeRequest(
                request_id=f"seed-{seed}-{len(candidates)}", prompt_token_ids=ids,
                prefill_candidates=candidates,
                sampling=pb.SamplingParams(temperature=1.0, top_k=40, seed=seed),
                stop=pb.StopCriteria(max_tokens=12, ignore_eos=True))
            return [e.token_id async for e in pb_grpc.DecodeStub(channel).Generate(req)]

    remote = [fp32_cluster.worker("prefill", 0).grpc]
    assert asyncio.run(sample(11, remote)) == asyncio.run(sample(11, []))
    assert asyncio.run(sample(11, remote)) != asyncio.run(sample(12, remote))


def metric(url: str, name: str) -> float:
    """One sample's value from a Prometheus /metrics page (0 when absent)."""
    import httpx
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_conditional_disaggregation_prefills_short_prompts_on_the_decode_worker(
        bundled_model_path, tokenizer, hf_model):
    """Router --local-prefill-max-tokens 32 with a queue threshold of 0 (the prefill worker always
    counts as busy): a 20-token prompt is prefilled by the decode worker (both counters move, the
    prefill worker serves nothing), a 100-token prompt still goes to the prefill worker; both give
    transformers' greedy tokens."""
    spec = LaunchSpec(dtype="float32", backend="eager", max_model_len=512, prefill_workers=1,
                      decode_workers=1, threads=1, router_args=[
                          "--local-prefill-max-tokens", "32", "--local-prefill-queue-tokens", "0"])
    with Cluster(spec) as cluster:
        decode_metrics, prefill_metrics = (
            f"http://{connectable(cluster.worker(role, 0).ready['metrics'])}/metrics"
            for role in ("decode", "prefill"))
        router_metrics = f"{cluster.http_url}/metrics"
        served = 'nxdi_requests_total{outcome="ok",role="prefill"}'
        for n, local in ((20, 1), (100, 0)):
            ids = prompt_of(tokenizer, n)
            before = [metric(router_metrics, "nxdi_local_prefills_total"),
                      metric(decode_metrics, "nxdi_local_prefills_total"),
                      metric(prefill_metrics, served)]
            events = asyncio.run(router_generate(cluster.grpc_address, ids, 8))
            assert [e.token_id for e in events] == reference(hf_model, ids, 8)
            deadline = time.monotonic() + 10  # the prefill stream is counted when it closes
            while True:
                after = [metric(router_metrics, "nxdi_local_prefills_total"),
                         metric(decode_metrics, "nxdi_local_prefills_total"),
                         metric(prefill_metrics, served)]
                moved = [a - b for a, b in zip(after, before)]
                if moved == [local, local, 1 - local] or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert moved == [local, local, 1 - local], (n, moved)


def test_a_prompt_mostly_in_the_decode_workers_prefix_cache_is_prefilled_there(
        bundled_model_path, tokenizer, hf_model):
    """The decode worker's --local-prefill-uncached-tokens (default 64): a prompt whose leading
    blocks it still holds from an earlier request is prefilled there when at most 64 of its
    tokens are not cached, and no more than are (the prefill worker, which keeps no cache,
    would compute all of them again); with more uncached tokens, fewer cached than not, or none
    cached, the prefill worker does it. Greedy tokens are transformers' either way."""
    spec = LaunchSpec(dtype="float32", backend="eager", max_model_len=512, prefill_workers=1,
                      decode_workers=1, threads=1)
    first = prompt_of(tokenizer, 120)
    cases = [(first, 0),  # nothing cached yet: the prefill worker
             (first[:112] + prompt_of(tokenizer, 20, offset=7), 1),  # 112 cached, 20 not: here
             (first[:48] + prompt_of(tokenizer, 100, offset=3), 0),  # 48 cached, 100 not
             (first[:16] + prompt_of(tokenizer, 40, offset=5), 0)]  # 16 cached, 40 not
    with Cluster(spec) as cluster:
        decode_metrics, prefill_metrics = (
            f"http://{connectable(cluster.worker(role, 0).ready['metrics'])}/metrics"
            for role in ("decode", "prefill"))
        served = 'nxdi_requests_total{outcome="ok",role="prefill"}'
        for ids, local in cases:
            before = [metric(decode_metrics, "nxdi_local_prefills_total"),
                      metric(prefill_metrics, served)]
            events = asyncio.run(router_generate(cluster.grpc_address, ids, 8))
            assert [e.token_id for e in events] == reference(hf_model, ids, 8)
            deadline = time.monotonic() + 10  # the prefill stream is counted when it closes
            while True:
                moved = [a - b for a, b in zip([metric(decode_metrics, "nxdi_local_prefills_total"),
                                                metric(prefill_metrics, served)], before)]
                if moved == [local, 1 - local] or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert moved == [local, 1 - local], (len(ids), moved)
