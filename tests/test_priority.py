"""vLLM's request priority (lower first), with the router's --scheduling-policy priority: the
router's admission queue, a prefill worker's queue, a decode worker's batch slots and its choice
of whom to preempt all serve the best priority first, equal priorities in their usual order;
and end to end on real processes (tiny model), a request of a better priority that arrives
later runs before one waiting for the same batch slot. Without the policy a non-zero priority
is refused by name, as vLLM does."""
import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import pytest

import hf_reference
from decode_service.scheduler import DecodeScheduler
from hf_reference import greedy
from nxdi_common.serving.errors import InvalidRequest
from nxdi_common.serving.types import (DecodeJob, PrefillJob, SamplingOptions, StopOptions,
                                       check_priority)
from prefill_service.scheduler import PrefillScheduler, PrefillTask
from router.admission import AdmissionQueue
from router.server import RouterSettings

MAX_LEN = 512


def test_the_admission_queue_turns_go_to_the_best_priority_first():
    async def scenario():
        queue = AdmissionQueue(5, retry_seconds=30)  # only notify() and leaving give turns
        order, done = [], asyncio.Event()

        async def waiter(name, priority):
            async with queue.place(priority) as ticket:
                assert await queue.turn(ticket, time.monotonic() + 5)
                order.append(name)
                await done.wait()

        tasks = []
        for name, priority in (("a", 0), ("b", 3), ("c", 0), ("d", -2)):
            tasks.append(asyncio.create_task(waiter(name, priority)))
            await asyncio.sleep(0.01)
        assert [queue.ahead_of(p) for p in (-3, -2, 0, 3, 9)] == [0, 1, 3, 4, 4]
        queue.notify()
        await asyncio.sleep(0.05)
        done.set()  # each leaves once served: the next one's turn at once
        await asyncio.gather(*tasks)
        assert order == ["d", "a", "c", "b"]

    asyncio.run(scenario())


def prefill_task(rid: str, length: int, priority: int, arrival_ns: int) -> PrefillTask:
    job = PrefillJob(rid, tuple(range(1, length + 1)), priority=priority)
    return PrefillTask(job, (0, 0), None, None, arrival_ns=arrival_ns)


def test_the_prefill_queue_takes_the_best_priority_first():
    """Arrival order, then shortest-first, both within the best priority waiting."""
    for order in ("arrival", "shortest"):
        sched = PrefillScheduler([128, 256], ctx_batch_size=1, max_queued=8, order=order,
                                 clock=lambda: 10)
        for rid, length, priority, at in (("long-0", 200, 0, 1), ("short-5", 20, 5, 2),
                                          ("long-1", 200, -1, 3), ("short-0", 20, 0, 4),
                                          ("short-1", 20, -1, 5)):
            sched.add(prefill_task(rid, length, priority, at))
        taken = [sched.next_batch()[0].job.request_id for _ in range(5)]
        expect = {"arrival": ["long-1", "short-1", "long-0", "short-0", "short-5"],
                  "shortest": ["short-1", "long-1", "short-0", "long-0", "short-5"]}[order]
        assert taken == expect, order
        assert sched.next_batch() == []


def test_a_free_batch_slot_goes_to_the_best_priority_ready():
    sched = DecodeScheduler(max_batch_size=1)
    seqs = [SimpleNamespace(name=n, priority=p, slot=-1) for n, p in
            (("a", 0), ("b", 2), ("c", -1), ("d", -1))]
    for seq in seqs:
        sched.add_ready(seq)
    ran = []
    while sched.ready or sched.running:
        (seq,) = sched.next_batch()
        ran.append(seq.name)
        sched.remove(seq)
    assert ran == ["c", "d", "a", "b"]


def test_priority_values_are_checked_by_name():
    assert check_priority(-5) == -5 and check_priority(2 ** 31 - 1) == 2 ** 31 - 1
    for bad in (2 ** 31, 1.0, True, "1"):
        with pytest.raises(InvalidRequest, match="priority"):
            check_priority(bad)
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        RouterSettings(scheduling_policy="lifo")


def test_a_preemption_takes_the_worst_priority_and_every_stream_matches_transformers(
        tiny_chat_model):
    """12 blocks, three sequences that cannot all hold their KV (as test_kv_on_demand's): the
    newest has the best priority, so it is never the one preempted (the newest would be without
    priorities), and every stream still gets transformers' greedy tokens."""
    from test_kv_on_demand import build, preemptions
    engine = build(tiny_chat_model, 12)
    reference = hf_reference.load(tiny_chat_model)
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(200, 240)), [7] * 20]
    priorities = [1, 0, -1]
    outs = [[], [], []]
    before = preemptions(engine)
    seqs = []
    for i, (prompt, priority) in enumerate(zip(prompts, priorities)):
        job = DecodeJob(f"s{i}", tuple(prompt), SamplingOptions(temperature=0.0),
                        StopOptions(100, ignore_eos=True), priority=priority)
        seqs.append(engine.admit(job, 100, outs[i].append))
        engine.submit_local_prefill(seqs[-1])
    swapped = set()
    for _ in range(2000):
        if all(s.finished for s in seqs):
            break
        engine._iterate()
        swapped.update(s.request_id for s in engine._swapped)
    assert preemptions(engine) > before and swapped and "s2" not in swapped
    for prompt, out in zip(prompts, outs):
        assert [o.token_id for o in out] == greedy(reference, prompt, 100)
    assert engine.blocks.num_used_blocks == 0
    engine.blocks.check_integrity()


@pytest.fixture(scope="module")
def cluster(spawn_module, tiny_chat_model):
    """One batch slot on the decode worker, so that requests wait for it in the ready queue."""
    common = ("--model", tiny_chat_model, "--dtype", "float32", "--backend", "eager",
              "--threads", "1", "--max-model-len", MAX_LEN)
    decode = spawn_module("decode_service", *common, "--kv-blocks", 128, "--max-batch-size", 1)
    prefill = spawn_module("prefill_service", *common)
    args = ("--model", tiny_chat_model, "--max-model-len", MAX_LEN, "--model-name", "tiny",
            "--http-port", 0, "--grpc-port", 0, "--decode", decode.grpc,
            "--prefill", prefill.grpc)
    with_policy = spawn_module("router", *args, "--scheduling-policy", "priority")
    plain = spawn_module("router", *args)
    return with_policy, plain


async def timed_stream(client, http: str, prompt, max_tokens: int, priority: int) -> list[float]:
    """The arrival time of each streamed token of a greedy completion."""
    times = []
    async with client.stream("POST", f"http://{http}/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "priority": priority}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                assert "error" not in json.loads(line[6:]), line
                times.append(time.monotonic())
    return times


def test_a_later_request_of_a_better_priority_takes_the_slot_first(cluster):
    """A long answer holds the one batch slot; a priority-1 request and then a priority -1 one
    are prefilled and wait for it; when it frees the later, better one runs first."""
    http = cluster[0].info["http"]

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            holder = asyncio.create_task(timed_stream(client, http, [11] * 8, 400, 0))
            await asyncio.sleep(0.3)
            low = asyncio.create_task(timed_stream(client, http, [12] * 8, 20, 1))
            await asyncio.sleep(0.2)
            high = asyncio.create_task(timed_stream(client, http, [13] * 8, 20, -1))
            return await asyncio.gather(holder, low, high)

    holder, low, high = asyncio.run(scenario())
    assert len(low) == len(high) == 20
    # both had their first token (from the prefill worker) while the holder still ran
    assert max(low[0], high[0]) < holder[-1]
    # one slot: whichever runs first streams its later tokens before the other's second one.
    # (Not high[-1] < low[1]: the two streams reach the client over two connections, and the
    # router may pass high's last chunk a millisecond after the low one's next token.)
    assert high[1] < low[1] and high[-1] < low[-1], \
        "the priority -1 request should run before the priority 1 one"
    assert sum(t < high[-1] for t in low[1:]) <= 1, "the two shared the slot"


def test_a_priority_needs_the_priority_policy(cluster):
    """HTTP and gRPC alike."""
    import grpc

    from protos.nxdi.serving.v1 import serving_pb2 as pb
    from protos.nxdi.serving.v1 import serving_pb2_grpc as pb_grpc

    def generate(router, priority):
        with grpc.insecure_channel(router.grpc) as channel:
            return list(pb_grpc.RouterStub(channel).Generate(pb.GenerateRequest(
                prompt="hi", stop=pb.StopCriteria(max_tokens=2), priority=priority), timeout=60))

    with pytest.raises(grpc.RpcError) as info:
        generate(cluster[1], 3)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "priority" in info.value.details()
    assert len(generate(cluster[0], -3)) == 2
    with_policy, plain = (router.info["http"] for router in cluster)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "priority": 3}
    bad = httpx.post(f"http://{plain}/v1/completions", json=body, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority", bad.text
    assert "--scheduling-policy priority" in bad.json()["error"]["message"]
    assert httpx.post(f"http://{plain}/v1/completions", timeout=60,
                      json={**body, "priority": 0}).status_code == 200
    ok = httpx.post(f"http://{with_policy}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "priority": -7})
    assert ok.status_code == 200, ok.text
    bad = httpx.post(f"http://{with_policy}/v1/completions", json={**body, "priority": 2 ** 31},
                     timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
