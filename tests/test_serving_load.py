"""Load and faults on real processes (tiny chat model, eager): 200 streamed requests with a quarter
cancelled mid-stream by closing the HTTP connection leave no KV blocks or transfers behind and no
memory growth; a prefill worker killed with requests in flight loses none of them; a chat's next
turn finds its history; the router's view of each worker's prefix cache follows its reports."""
import asyncio
import random

import grpc
import httpx
import pytest

from metrics_page import metric_value
from nxdi_common.cache_journal import MASK64
from nxdi_common.serving.launcher import Cluster, LaunchSpec, connectable
from protos.nxdi.serving.v1 import serving_pb2 as pb
from protos.nxdi.serving.v1 import serving_pb2_grpc as pb_grpc
from router.policies import DECODE, PREFILL
from router.prefix_index import block_hashes
from router.registry import Registry


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


async def loads(cluster):
    out = []
    for w in cluster.workers:
        async with grpc.aio.insecure_channel(w.grpc) as channel:
            stub = (pb_grpc.PrefillStub if w.role == "prefill" else pb_grpc.DecodeStub)(channel)
            out.append((w.role, w.index, await stub.GetLoad(pb.GetLoadRequest())))
    return out


async def wait_idle(cluster, timeout=20.0):
    for _ in range(int(timeout / 0.2)):
        state = await loads(cluster)
        if all(x.kv_blocks_used == 0 and x.open_transfers == 0 and x.running_sequences == 0
               and x.queued_requests == 0 for _, _, x in state):
            return state
        await asyncio.sleep(0.2)
    raise AssertionError(f"workers still busy: {state}")


async def stream_one(client, url, i, cancel: bool, rng):
    body = {"model": "tiny", "prompt": "word " * rng.randint(5, 300), "max_tokens": 24,
            "temperature": 0.8, "seed": i, "stream": True, "ignore_eos": True}
    async with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200, await response.aread()
        events = 0
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events += 1
                if cancel and events == 3:
                    return "cancelled"  # leaving the block closes the connection mid-stream
                if line == "data: [DONE]":
                    return "done"
    return "truncated"


async def run_load(cluster, n, concurrency, seed):
    rng = random.Random(seed)
    url = f"{cluster.http_url}/v1/completions"
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)

    async def one(i, client):
        async with sem:
            return await stream_one(client, url, i, i % 4 == 0, rng)

    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        # An overall bound (the loads here take ~10 s): a stalled stream fails the test with the
        # requests still open named, instead of hanging the suite.
        tasks = [asyncio.ensure_future(one(i, client)) for i in range(n)]
        done, pending = await asyncio.wait(tasks, timeout=240)
        for task in pending:
            task.cancel()
        assert not pending, f"{len(pending)} of {n} requests still open after 240 s: " \
            f"{sorted(tasks.index(t) for t in pending)[:20]}"
        return [t.result() for t in tasks]


@pytest.fixture(scope="module")
def tiny_cluster(tiny_chat_model):
    spec = LaunchSpec(model=str(tiny_chat_model), dtype="float32", backend="eager",
                      max_model_len=512, prefill_workers=2, decode_workers=2, threads=1,
                      decode_args=["--kv-blocks", "256"], router_args=["--model-name", "tiny"])
    with Cluster(spec) as cluster:
        yield cluster


def test_cancelled_streams_leave_nothing_behind_and_memory_holds(tiny_cluster):
    warm = asyncio.run(run_load(tiny_cluster, 40, 8, seed=1))
    assert warm.count("done") == 30 and warm.count("cancelled") == 10
    asyncio.run(wait_idle(tiny_cluster))
    before = {w.pid: rss_kib(w.pid) for w in tiny_cluster.workers}
    outcomes = asyncio.run(run_load(tiny_cluster, 200, 16, seed=2))
    assert outcomes.count("done") == 150 and outcomes.count("cancelled") == 50
    state = asyncio.run(wait_idle(tiny_cluster))
    assert all(x.kv_blocks_used == 0 and x.open_transfers == 0 for _, _, x in state)
    after = {w.pid: rss_kib(w.pid) for w in tiny_cluster.workers}
    for pid, kib in before.items():
        assert after[pid] <= kib * 1.05, f"worker {pid} grew from {kib} to {after[pid]} KiB"
    metrics = httpx.get(f"{tiny_cluster.http_url}/metrics").text
    assert "nxdi_requests_total" in metrics


def test_killed_prefill_worker_loses_no_request(bundled_model_path):
    spec = LaunchSpec(dtype="float32", backend="eager", max_model_len=1024, prefill_workers=2,
                      decode_workers=1, threads=1, decode_args=["--kv-blocks", "600"],
                      router_args=["--policy", "round-robin"])
    with Cluster(spec) as cluster:
        results = asyncio.run(kill_during_load(cluster))
        failovers = metric_value(connectable(cluster.worker("decode", 0).ready["metrics"]),
                                 "nxdi_kv_pull_failovers_total")
    assert all(len(events) == 4 for events in results)
    assert all(events[-1].finish_reason == pb.FINISH_REASON_LENGTH for events in results)
    assert failovers >= 1  # the victim's prompts in flight were pulled from the other worker


async def kill_during_load(cluster):
    async def one(i):
        async with grpc.aio.insecure_channel(cluster.grpc_address) as channel:
            req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[100 + i] * 700),
                                     sampling=pb.SamplingParams(temperature=0),
                                     stop=pb.StopCriteria(max_tokens=4, ignore_eos=True))
            return [e async for e in pb_grpc.RouterStub(channel).Generate(req)]

    tasks = [asyncio.create_task(one(i)) for i in range(6)]
    victim = cluster.worker("prefill", 0)
    for _ in range(300):  # until the victim is working on a prompt
        async with grpc.aio.insecure_channel(victim.grpc) as channel:
            load = await pb_grpc.PrefillStub(channel).GetLoad(pb.GetLoadRequest())
        if load.running_sequences or load.queued_requests or load.open_transfers:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the prefill worker never got a request")
    cluster.kill_worker("prefill", 0)
    return await asyncio.gather(*tasks)


def test_a_chats_next_turn_goes_back_to_the_decode_worker_holding_its_history(tiny_cluster):
    """The router's default cache-aware policy, two decode workers: turn 1's prompt is cached on
    the worker that served it (W); a long answer to a prompt sharing 16 of its 25 blocks then
    runs on W too, so W holds more KV blocks than the other worker; turn 2 (turn 1's prompt and
    40 new tokens) still goes to W, which computes only the new tokens (usage: cached_tokens
    400). With --policy least-loaded the same requests cached 0 or 256 of turn 2's tokens
    (it went to the worker with more free blocks)."""
    asyncio.run(wait_idle(tiny_cluster))
    turn1 = [1000 + (i * 37) % 3000 for i in range(400)]  # 25 full blocks of 16
    asyncio.run(a_chat_with_a_busy_worker(tiny_cluster, turn1))


async def a_chat_with_a_busy_worker(cluster, turn1):
    url = f"{cluster.http_url}/v1/completions"

    def body(prompt, max_tokens, stream=False):
        return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": stream}

    async with httpx.AsyncClient(timeout=120) as client:
        first = (await client.post(url, json=body(turn1, 4))).json()
        assert first["usage"]["prompt_tokens"] == 400
        busy = turn1[:256] + [4321] * 16  # shares 16 of turn 1's blocks: the same worker
        async with client.stream("POST", url, json=body(busy, 150, stream=True)) as stream:
            assert stream.status_code == 200
            lines = stream.aiter_lines()
            while not (await anext(lines)).startswith("data: "):
                pass  # its first token: it is running, its blocks held
            second = (await client.post(url, json=body(turn1 + [4000 + i for i in range(40)],
                                                        4))).json()
            async for _ in lines:  # let it finish
                pass
    assert second["usage"]["prompt_tokens"] == 440
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 400, second["usage"]


def test_the_router_learns_what_each_worker_caches_and_evicts(tiny_cluster):
    """The router's registry polling the real workers (GetLoad with a cache cursor): after a
    400-token prompt, exactly one decode worker and a prefill worker report its 25 chained block
    hashes (as the router computes them from the token ids); after other prompts fill the decode
    workers' 256-block pools, the holder reports them evicted; and the view built from report
    after report equals a snapshot a new registry takes."""
    asyncio.run(wait_idle(tiny_cluster))
    asyncio.run(reports_follow_the_caches(tiny_cluster))


async def reports_follow_the_caches(cluster):
    addresses = {role: [w.grpc for w in cluster.workers if w.role == role]
                 for role in (PREFILL, DECODE)}
    registry = Registry(addresses)
    url = f"{cluster.http_url}/v1/completions"

    async def complete(client, prompt):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
        response = await client.post(url, json=body)
        assert response.status_code == 200, response.text

    try:
        await registry.refresh()
        workers = registry.workers(PREFILL) + registry.workers(DECODE)
        assert all(w.healthy and w.cache is not None and w.cache.instance for w in workers)
        prompt = [3000 + (i * 53) % 2000 for i in range(400)]
        hashes = {h & MASK64 for h in block_hashes(prompt, 16)}
        async with httpx.AsyncClient(timeout=120) as client:
            await complete(client, prompt)
            await registry.refresh()
            holders = [w for w in registry.workers(DECODE) if hashes <= w.cache.blocks]
            assert len(holders) == 1, [len(hashes & w.cache.blocks) for w in workers]
            assert any(hashes <= w.cache.blocks for w in registry.workers(PREFILL))
            for i in range(24):  # 24 x 25 blocks: more than both pools hold
                await complete(client, [6000 + 97 * i + j for j in range(400)])
                if i % 4 == 3:
                    await registry.refresh()
        await registry.refresh()
        assert not hashes & holders[0].cache.blocks
        fresh = Registry(addresses)
        try:
            await fresh.refresh()
            for role in (PREFILL, DECODE):
                for w, f in zip(registry.workers(role), fresh.workers(role)):
                    assert w.cache.blocks == f.cache.blocks and w.cache.cursor == f.cache.cursor
        finally:
            await fresh.close()
    finally:
        await registry.close()
