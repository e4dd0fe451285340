"""The router's admission queue (router/admission.py): first come first served turns, a timeout
and a bound; and on real processes (tiny model), a request that the decode worker refuses for
room waits for it and is served where --queue-timeout-seconds 0 sheds it with HTTP 429."""
import asyncio
import os
import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nxdi_common.serving.errors import Overloaded
from router.admission import AdmissionQueue
from router.server import RouterSettings

MAX_LEN = 256


def test_turns_go_to_the_head_in_arrival_order():
    async def scenario():
        queue = AdmissionQueue(5, retry_seconds=30)  # only notify() and leaving give turns
        order, holds = [], [asyncio.Event() for _ in range(3)]

        async def waiter(i):
            async with queue.place() as ticket:
                assert await queue.turn(ticket, time.monotonic() + 5)
                order.append(i)
                await holds[i].wait()

        tasks = [asyncio.create_task(waiter(i)) for i in range(3)]
        await asyncio.sleep(0.05)
        assert order == [] and len(queue) == 3  # no room has come yet
        queue.notify()  # a request finished: only the head tries
        await asyncio.sleep(0.05)
        assert order == [0]
        holds[0].set()  # the head leaves (served): the next one's turn at once
        await asyncio.sleep(0.05)
        assert order == [0, 1]
        holds[1].set()
        holds[2].set()
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2] and len(queue) == 0

    asyncio.run(scenario())


def test_the_head_retries_every_retry_seconds_and_others_time_out():
    async def scenario():
        queue = AdmissionQueue(5, max_waiting=2, retry_seconds=0.05)
        async with queue.place() as head, queue.place() as second:
            began = time.monotonic()
            assert await queue.turn(head, began + 5)  # no notify: the retry interval
            assert 0.04 <= time.monotonic() - began < 1
            assert not await queue.turn(second, time.monotonic() + 0.2)  # never the head
            assert not await queue.turn(head, time.monotonic() - 1)  # deadline passed
            with pytest.raises(Overloaded, match="2 requests already wait"):
                async with queue.place():
                    pass
        assert len(queue) == 0

    asyncio.run(scenario())


def test_a_taken_request_leaves_before_its_block_ends_and_can_rejoin_its_turn():
    async def scenario():
        queue = AdmissionQueue(5, retry_seconds=0.05)
        async with queue.place() as head, queue.place() as second:
            assert await queue.turn(head, time.monotonic() + 5)
            assert not await queue.turn(second, time.monotonic() + 0.1)
            queue.leave(head)  # a decode worker took it, still inside its place block
            assert len(queue) == 1
            assert await queue.turn(second, time.monotonic() + 5)  # the head now
            queue.rejoin(head)  # failed before its first token: back ahead of `second`
            assert await queue.turn(head, time.monotonic() + 5)
            assert not await queue.turn(second, time.monotonic() + 0.1)
            queue.leave(head)
            queue.leave(head)  # twice: a no-op
        assert len(queue) == 0

    asyncio.run(scenario())


def test_bad_queue_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="queue_timeout_seconds"):
        RouterSettings(queue_timeout_seconds=-1)
    with pytest.raises(ValueError, match="max_waiting must be >= 1"):
        RouterSettings(max_queued_requests=0)
    assert not AdmissionQueue(0).enabled and AdmissionQueue(0.5).enabled


@pytest.fixture(scope="module")
def workers(spawn_module, tiny_chat_model):
    """A decode worker with 8 blocks of 16 tokens: one 100-token prompt fits, two do not (the
    second also needs a block spare for the first), and a prefill worker."""
    common = ("--model", tiny_chat_model, "--dtype", "float32", "--backend", "eager",
              "--threads", "1", "--max-model-len", MAX_LEN)
    decode = spawn_module("decode_service", *common, "--kv-blocks", 8, "--block-size", 16)
    prefill = spawn_module("prefill_service", *common)
    return decode, prefill


def router(spawn_module, tiny_chat_model, workers, *extra):
    decode, prefill = workers
    return spawn_module("router", "--model", tiny_chat_model, "--max-model-len", MAX_LEN,
                        "--model-name", "tiny", "--http-port", 0, "--grpc-port", 0,
                        "--decode", decode.grpc, "--prefill", prefill.grpc,
                        "--refresh-seconds", 0.5, *extra)


def two_at_once(http: str) -> list[httpx.Response]:
    async def both():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(f"http://{http}/v1/completions", json={
                "model": "tiny", "prompt": [300 + i] * 100, "max_tokens": 20,
                "temperature": 0}) for i in range(2)))
    return asyncio.run(both())


def waits(http: str) -> float:
    text = httpx.get(f"http://{http}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "nxdi_admission_waits_total")


def test_a_request_without_room_waits_for_it(spawn_module, tiny_chat_model, workers):
    http = router(spawn_module, tiny_chat_model, workers).info["http"]
    responses = two_at_once(http)
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
    assert all(r.json()["usage"]["completion_tokens"] >= 1 for r in responses)
    assert waits(http) >= 1


def test_without_the_queue_it_is_shed_with_429(spawn_module, tiny_chat_model, workers):
    http = router(spawn_module, tiny_chat_model, workers, "--queue-timeout-seconds", 0).info["http"]
    codes = sorted(r.status_code for r in two_at_once(http))
    assert codes == [200, 429]
    assert waits(http) == 0


def test_a_queued_request_leaves_the_queue_when_a_worker_takes_it(spawn, tiny_chat_model):
    """Room for two requests comes while two wait: both are taken at once. The prefill worker is
    paused (SIGSTOP), so a taken request has no first token yet; until the head left the queue
    only at its first token, the second waited behind it (one queued request let in per time
    to first token), and a briefly full worker drained its queue one request at a time."""
    import grpc

    from protos.nxdi.serving.v1 import serving_pb2 as pb
    from protos.nxdi.serving.v1 import serving_pb2_grpc as pb_grpc

    common = ("--model", tiny_chat_model, "--dtype", "float32", "--backend", "eager",
              "--threads", "1", "--max-model-len", MAX_LEN)
    # 16 blocks of 16 tokens: two 100-token prompts (7 blocks each, one spare a live sequence)
    decode = spawn("decode_service", *common, "--kv-blocks", 16, "--block-size", 16)
    prefill = spawn("prefill_service", *common)
    router = spawn("router", "--model", tiny_chat_model, "--max-model-len", MAX_LEN,
                   "--model-name", "tiny", "--http-port", 0, "--grpc-port", 0,
                   "--decode", decode.grpc, "--prefill", prefill.grpc,
                   "--refresh-seconds", 60)  # the paused prefill worker stays listed healthy

    def blocks_used() -> int:
        with grpc.insecure_channel(decode.grpc) as channel:
            return pb_grpc.DecodeStub(channel).GetLoad(pb.GetLoadRequest(), timeout=10) \
                .kv_blocks_used

    def wait_until(check, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if check():
                return True
            time.sleep(0.05)
        return False

    def holder(i: int) -> None:  # taken, waits for the paused prefill, gives up at its deadline
        with grpc.insecure_channel(router.grpc) as channel, pytest.raises(grpc.RpcError):
            list(pb_grpc.RouterStub(channel).Generate(pb.GenerateRequest(
                prompt_token_ids=pb.TokenIds(ids=[200 + i] * 100),
                stop=pb.StopCriteria(max_tokens=4)), timeout=3))

    async def scenario():
        loop = asyncio.get_running_loop()
        holders = [loop.run_in_executor(None, holder, i) for i in range(2)]
        assert await loop.run_in_executor(None, wait_until, lambda: blocks_used() >= 14, 10)
        async with httpx.AsyncClient(timeout=120) as client:
            queued = [asyncio.create_task(client.post(
                f"http://{router.info['http']}/v1/completions", json={
                    "model": "tiny", "prompt": [300 + i] * 100, "max_tokens": 4,
                    "temperature": 0})) for i in range(2)]
            assert await loop.run_in_executor(
                None, wait_until, lambda: waits(router.info["http"]) >= 2, 10)
            await asyncio.gather(*holders)  # their deadlines passed: the room is back
            # both queued requests taken while neither can have a first token
            both = await loop.run_in_executor(None, wait_until, lambda: blocks_used() >= 14, 5)
            os.kill(prefill.proc.pid, signal.SIGCONT)
            return both, await asyncio.gather(*queued)

    os.kill(prefill.proc.pid, signal.SIGSTOP)
    try:
        both, responses = asyncio.run(scenario())
    finally:
        os.kill(prefill.proc.pid, signal.SIGCONT)
    assert both, "the second queued request was not taken before the first one's first token"
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
