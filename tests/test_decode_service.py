"""The decode worker as a real process on loopback (tiny model with the bundled tokenizer): local
prefill + continuous batching give transformers' greedy tokens, admission, stop rules, seeded
sampling, cancellation freeing blocks, bad input, and a KV pull from a hostile prefill peer."""
import asyncio
import contextlib
import re
import socket
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

import hf_reference
from hf_reference import greedy
from metrics_page import metric_value
from nxdi_common import kv_transfer
from nxdi_common.serving import kv_socket
from protos.nxdi.serving.v1 import serving_pb2 as pb
from protos.nxdi.serving.v1 import serving_pb2_grpc as pb_grpc

MAX_LEN = 256


@pytest.fixture(scope="module")
def decode(spawn_module, tiny_chat_model):
    return spawn_module("decode_service", "--model", tiny_chat_model, "--dtype", "float32",
                        "--backend", "eager", "--threads", "1", "--max-model-len", MAX_LEN,
                        "--kv-blocks", 24, "--block-size", 16, "--max-batch-size", 4)


@pytest.fixture(scope="module")
def reference(tiny_chat_model):
    return hf_reference.load(tiny_chat_model)


def request(rid, ids, max_tokens=None, **kw):
    stop = pb.StopCriteria(max_tokens=max_tokens, ignore_eos=kw.pop("ignore_eos", True),
                           stop_token_ids=kw.pop("stop_token_ids", ()),
                           stop_strings=kw.pop("stop_strings", ()))
    sampling = pb.SamplingParams(temperature=kw.pop("temperature", 0.0), **kw)
    return pb.DecodeRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling, stop=stop)


async def collect(address, req, **kw):
    async with grpc.aio.insecure_channel(address) as channel:
        return [e async for e in pb_grpc.DecodeStub(channel).Generate(req, **kw)]


async def get_load(address):
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.DecodeStub(channel).GetLoad(pb.GetLoadRequest())


def run(coro):
    return asyncio.run(coro)


PROMPTS = [[1, 504, 3458, 282, 4649, 314], list(range(100, 140)), [7] * 90, [42]]


def test_local_prefill_and_batching_match_transformers(decode, reference):
    async def all_at_once():
        reqs = [request(f"r{i}", ids, max_tokens=12 + 3 * i) for i, ids in enumerate(PROMPTS)]
        return await asyncio.gather(*(collect(decode.grpc, r) for r in reqs))

    results = run(all_at_once())
    for i, (ids, events) in enumerate(zip(PROMPTS, results)):
        assert [e.token_id for e in events] == greedy(reference, ids, 12 + 3 * i)
        assert [e.index for e in events] == list(range(12 + 3 * i))
        assert events[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert all(e.finish_reason == pb.FINISH_REASON_UNSPECIFIED for e in events[:-1])
        assert (events[-1].usage.prompt_tokens, events[-1].usage.completion_tokens) == \
            (len(ids), 12 + 3 * i)
    load = run(get_load(decode.grpc))
    assert (load.kv_blocks_used, load.running_sequences, load.queued_requests) == (0, 0, 0)


def test_text_is_incremental_detokenization(decode):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(decode_model_dir(decode))
    events = run(collect(decode.grpc, request("t", PROMPTS[0], max_tokens=20)))
    assert "".join(e.text for e in events) == tok.decode([e.token_id for e in events],
                                                         skip_special_tokens=True)


def decode_model_dir(service):
    args = service.proc.args
    return args[args.index("--model") + 1]


def test_stop_token_ids_and_strings(decode, reference):
    expected = greedy(reference, PROMPTS[1], 10)
    stop_id = expected[4]
    events = run(collect(decode.grpc, request("s", PROMPTS[1], 10, stop_token_ids=[stop_id])))
    first = expected.index(stop_id)
    assert [e.token_id for e in events] == expected[:first + 1]
    assert events[-1].finish_reason == pb.FINISH_REASON_STOP_TOKEN

    full = run(collect(decode.grpc, request("s2", PROMPTS[1], 10)))
    text = "".join(e.text for e in full)
    needle = text[len(text) // 2:len(text) // 2 + 3]
    if not needle.strip():
        pytest.skip("random model produced whitespace-only text here")
    cut = run(collect(decode.grpc, request("s3", PROMPTS[1], 10, stop_strings=[needle])))
    assert "".join(e.text for e in cut) == text[:text.index(needle)]
    assert cut[-1].finish_reason == pb.FINISH_REASON_STOP_STRING


def test_eos_stops_unless_ignored(decode, reference):
    # Make the model's own greedy token an EOS by declaring it a stop... EOS proper: id 2.
    events = run(collect(decode.grpc, request("e", PROMPTS[0], 30, ignore_eos=False)))
    tokens = [e.token_id for e in events]
    expected = greedy(reference, PROMPTS[0], 30)
    if 2 in expected:
        assert tokens == expected[:expected.index(2) + 1]
        assert events[-1].finish_reason == pb.FINISH_REASON_EOS_TOKEN
    else:
        assert tokens == expected and events[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_seeded_sampling_is_reproducible(decode):
    def sample(seed):
        req = request("x", PROMPTS[1], 16, temperature=1.0, top_k=50, top_p=0.9, seed=seed)
        return [e.token_id for e in run(collect(decode.grpc, req))]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_logprobs(decode, reference):
    req = request("lp", PROMPTS[0], 3, logprobs=True, top_logprobs=3)
    events = run(collect(decode.grpc, req))
    with torch.no_grad():
        logits = reference(torch.tensor([PROMPTS[0]])).logits[0, -1]
    logp = torch.log_softmax(logits, -1)
    first = events[0]
    assert first.logprob == pytest.approx(float(logp[first.token_id]), abs=1e-4)
    assert [x.token_id for x in first.top_logprobs] == torch.topk(logp, 3).indices.tolist()
    assert first.top_logprobs[0].token_id == first.token_id


def test_sequences_past_the_pool_are_preempted_and_finish_with_transformers_tokens(
        decode, reference):
    """24 blocks of 16 tokens; two 90-token prompts generating 166 tokens need 16 blocks each by
    their end. Both are admitted (blocks come as tokens do), the newer is preempted when the pool
    runs out, and both streams get transformers' greedy tokens."""
    before = _metric(decode, "nxdi_preemptions_total")
    prompts = [PROMPTS[2], [8] * 90]

    async def both():
        return await asyncio.gather(*(collect(decode.grpc, request(f"big{i}", ids, MAX_LEN - 90))
                                      for i, ids in enumerate(prompts)))

    for ids, events in zip(prompts, run(both())):
        assert [e.token_id for e in events] == greedy(reference, ids, MAX_LEN - 90)
    assert _metric(decode, "nxdi_preemptions_total") > before
    wait_for_idle(decode.grpc)


def wait_for_idle(address, timeout=10.0):
    async def poll():
        for _ in range(int(timeout / 0.1)):
            load = await get_load(address)
            if load.kv_blocks_used == 0 and load.running_sequences == 0 \
                    and load.queued_requests == 0 and load.open_transfers == 0:
                return load
            await asyncio.sleep(0.1)
        raise AssertionError(f"worker did not go idle: {load}")
    return run(poll())


def test_cancel_mid_stream_frees_blocks(decode):
    async def cancel_after(n):
        async with grpc.aio.insecure_channel(decode.grpc) as channel:
            call = pb_grpc.DecodeStub(channel).Generate(request("c", PROMPTS[1], 200))
            for _ in range(n):
                await call.read()
            load = await pb_grpc.DecodeStub(channel).GetLoad(pb.GetLoadRequest())
            call.cancel()
            return load

    during = run(cancel_after(3))
    # blocks as tokens come: at least the prompt's and 3 tokens', less than 200 tokens' worth
    assert -(-(40 + 3) // 16) <= during.kv_blocks_used < -(-(40 + 200) // 16)
    assert during.running_sequences == 1
    wait_for_idle(decode.grpc)


def test_a_request_id_reused_after_it_finished_keeps_its_own_blocks(tiny_chat_model, reference):
    """The engine frees a finished sequence at once, and its stream's end then queues a drop
    for it; a client may send the same request id again before the engine thread sees that
    drop. The late drop must not free the new sequence's blocks or ignore its commands (it did:
    the id alone decided, and the new request waited forever)."""
    import threading

    from decode_service.main import build, parse_args
    from nxdi_common.serving.types import DecodeJob, SamplingOptions
    _, engine, _, _ = build(parse_args(
        ["--model", str(tiny_chat_model), "--dtype", "float32", "--backend", "eager",
         "--threads", "1", "--max-model-len", str(MAX_LEN), "--kv-blocks", "24",
         "--block-size", "16", "--max-batch-size", "4"]))
    job = DecodeJob("same-id", tuple(range(300, 330)), SamplingOptions(temperature=0.0))
    first = engine.admit(job, 4, lambda item: None)
    engine.release(first)  # finished: freed by the engine thread
    engine.drop(first)  # the stream's end: a drop, not yet applied
    tokens, done = [], threading.Event()

    def emit(item):
        tokens.append(item.token_id)
        if len(tokens) == 4:
            done.set()
    second = engine.admit(job, 4, emit)
    engine.submit_local_prefill(second)
    used = engine.load()["kv_blocks_used"]
    engine._apply_commands(block=False)  # the old drop, then the new prefill, on this thread
    assert engine.load()["kv_blocks_used"] == used == 2  # the prompt and a token: 31 in blocks of 16
    engine.start()
    try:
        assert done.wait(60)
    finally:
        engine.stop()
    assert tokens == greedy(reference, list(job.prompt_ids), 4)
    assert engine.load()["kv_blocks_used"] == 0


@pytest.mark.parametrize("req, field", [
    (request("b1", [], 5), "prompt_token_ids"),
    (request("b2", [1] * MAX_LEN, 5), "prompt_token_ids"),
    (request("b3", [1, 2, 3], MAX_LEN), "max_tokens"),
    (request("b4", [1, 2, 3], 0), "max_tokens"),
    (request("b5", [1, 49152], 5), "prompt_token_ids"),
    (request("b6", [1, 2], 5, top_p=0.0), "top_p"),
    (request("b7", [1, 2], 5, temperature=-1.0), "temperature"),
    (request("b8", [1, 2], 5, top_k=-2), "top_k"),
    (request("", [1, 2], 5), "request_id"),
    (request("b9", [1, 2], 5, logit_bias={49152: 1.0}), "sampling_params.logit_bias"),
    (request("b10", [1, 2], 5, logit_bias={5: 200.0}), "logit_bias"),
    (request("b11", [1, 2], 5, structured_output=pb.StructuredOutput(regex="[0-")),
     "sampling_params.structured_output"),
    (request("b12", [1, 2], 5, structured_output=pb.StructuredOutput(
        json_schema='{"type": "object", "required": 5}')), "sampling_params.structured_output"),
])
def test_bad_input_is_invalid_argument(decode, req, field):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(collect(decode.grpc, req))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field)
    assert run(get_load(decode.grpc)).kv_blocks_used == 0


# ---- a hostile prefill peer: the decode worker must validate every chunk ---------------------

class HostilePrefill(pb_grpc.PrefillServicer):
    """Answers with a first token and one corrupted chunk (how: 'length', 'range' or 'crc'),
    a good chunk again after done ('after_done'), or done with no chunk at all ('missing')."""

    def __init__(self, fingerprint, how):
        self.fingerprint, self.how = fingerprint, how

    async def Prefill(self, request, context):
        yield pb.PrefillEvent(first_token=pb.FirstToken(token_id=5))
        if self.how == "missing":
            yield pb.PrefillEvent(done=pb.PrefillDone(num_chunks=0))
            return
        fp, n = self.fingerprint, len(request.prompt_token_ids)
        end = n + 1 if self.how == "range" else n
        k = torch.zeros(fp.num_layers, end, fp.num_kv_heads, fp.head_dim)
        chunk = next(iter(kv_transfer.encode_chunks(request.request_id, k, k.clone())))
        msg = kv_transfer.chunk_to_proto(chunk)
        if self.how == "length":
            msg.k = msg.k[:-4]
        if self.how == "crc":
            msg.crc32c ^= 1
        yield pb.PrefillEvent(kv_chunk=msg)
        yield pb.PrefillEvent(done=pb.PrefillDone(num_chunks=1))
        if self.how == "after_done":
            yield pb.PrefillEvent(kv_chunk=msg)


@contextlib.asynccontextmanager
async def hostile_server(fingerprint, how):
    server = grpc.aio.server()
    pb_grpc.add_PrefillServicer_to_server(HostilePrefill(fingerprint, how), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


@pytest.mark.parametrize("how, field", [("length", "k"), ("range", "token_end"), ("crc", "crc32c"),
                                        ("after_done", "kv_chunk after done"),
                                        ("missing", "KV values missing")])
def test_bad_kv_chunk_fails_the_request_cleanly(decode, how, field):
    async def scenario():
        fp = kv_transfer.fingerprint_from_proto((await get_load(decode.grpc)).fingerprint)
        async with hostile_server(fp, how) as address:
            req = request("h", PROMPTS[0], 5)
            req.prefill_candidates.append(address)
            events = []
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for e in pb_grpc.DecodeStub(grpc.aio.insecure_channel(decode.grpc)) \
                        .Generate(req):
                    events.append(e)
            return events, err.value

    events, err = run(scenario())
    assert [e.token_id for e in events] == [5]  # the first token arrived before the KV
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    if how == "missing":  # the message counts what is missing
        assert re.search(r"ended with [1-9]\d* KV values missing", err.details()), err.details()
    assert f"{field}:" in err.details() or f"'{field}'" in err.details() or field in err.details()
    wait_for_idle(decode.grpc)


class HostileSocketPrefill(pb_grpc.PrefillServicer):
    """Offers a KV socket and sends one bad frame on it: 'crc' (a corrupted chunk), 'oversize'
    (a length past the decode worker's bound) or 'event' (a first_token event, not a chunk)."""

    def __init__(self, fingerprint, how):
        self.fingerprint, self.how = fingerprint, how

    async def Prefill(self, request, context):
        yield pb.PrefillEvent(first_token=pb.FirstToken(token_id=5))
        fp, n = self.fingerprint, len(request.prompt_token_ids)
        k = torch.zeros(fp.num_layers, n, fp.num_kv_heads, fp.head_dim)
        msg = kv_transfer.chunk_to_proto(next(iter(kv_transfer.encode_chunks(
            request.request_id, k, k.clone()))))
        msg.crc32c ^= 1
        event = {"crc": pb.PrefillEvent(kv_chunk=msg).SerializeToString(),
                 "event": pb.PrefillEvent(first_token=pb.FirstToken(token_id=6))
                 .SerializeToString()}.get(self.how, b"")
        frame = (kv_socket.FRAME.pack(1 << 30) if self.how == "oversize"
                 else kv_socket.FRAME.pack(len(event)) + event)
        listener = socket.create_server(("127.0.0.1", 0))
        token = b"k" * kv_socket.TOKEN_BYTES

        def serve_one():
            conn, _ = listener.accept()
            with conn:
                conn.recv(len(kv_socket.HELLO) + len(token), socket.MSG_WAITALL)
                conn.sendall(frame)
            listener.close()
        threading.Thread(target=serve_one, daemon=True).start()
        yield pb.PrefillEvent(kv_socket=pb.KVSocket(port=listener.getsockname()[1], token=token))
        await asyncio.sleep(5)  # the decode worker gives up on its own
        yield pb.PrefillEvent(done=pb.PrefillDone(num_chunks=1))


@pytest.mark.parametrize("how, field", [("crc", "crc32c"), ("oversize", "kv_socket"),
                                        ("event", "first_token event")])
def test_bad_kv_socket_frame_fails_the_request_cleanly(decode, how, field):
    async def scenario():
        fp = kv_transfer.fingerprint_from_proto((await get_load(decode.grpc)).fingerprint)
        server = grpc.aio.server()
        pb_grpc.add_PrefillServicer_to_server(HostileSocketPrefill(fp, how), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            req = request("hs", PROMPTS[0], 5)
            req.prefill_candidates.append(f"127.0.0.1:{port}")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(decode.grpc, req)
            return err.value
        finally:
            await server.stop(0)

    started = time.monotonic()
    err = run(scenario())
    assert time.monotonic() - started < 4  # refused on the frame, not when the stream ended
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert field in err.details()
    wait_for_idle(decode.grpc)


class UnreachableSocketPrefill(pb_grpc.PrefillServicer):
    """Offers a KV socket on a port where nothing listens (a blocked port), then, as a real
    prefill worker does once its offer times out, sends the chunk on the stream."""

    def __init__(self, fingerprint):
        self.fingerprint, self.asked = fingerprint, []

    async def Prefill(self, request, context):
        self.asked.append(request.accept_kv_socket)
        yield pb.PrefillEvent(first_token=pb.FirstToken(token_id=5))
        if request.accept_kv_socket:
            with socket.create_server(("127.0.0.1", 0)) as closed:
                port = closed.getsockname()[1]
            yield pb.PrefillEvent(kv_socket=pb.KVSocket(port=port, token=b"u" * 16))
            await asyncio.sleep(0.2)
        fp, n = self.fingerprint, len(request.prompt_token_ids)
        k = torch.zeros(fp.num_layers, n, fp.num_kv_heads, fp.head_dim)
        chunk = next(iter(kv_transfer.encode_chunks(request.request_id, k, k.clone())))
        yield pb.PrefillEvent(kv_chunk=kv_transfer.chunk_to_proto(chunk))
        yield pb.PrefillEvent(done=pb.PrefillDone(num_chunks=1))


def test_unreachable_kv_socket_falls_back_to_the_stream_and_is_not_asked_again(decode):
    async def scenario():
        fp = kv_transfer.fingerprint_from_proto((await get_load(decode.grpc)).fingerprint)
        servicer = UnreachableSocketPrefill(fp)
        server = grpc.aio.server()
        pb_grpc.add_PrefillServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            results = []
            for i in range(2):
                req = request(f"u{i}", PROMPTS[0], 3)
                req.prefill_candidates.append(f"127.0.0.1:{port}")
                results.append(await collect(decode.grpc, req))
            return servicer.asked, results
        finally:
            await server.stop(0)

    asked, results = run(scenario())
    assert asked == [True, False]  # the failed connection stops the offers for a while
    for events in results:
        assert len(events) == 3 and events[0].token_id == 5
        assert events[-1].finish_reason == pb.FINISH_REASON_LENGTH
    wait_for_idle(decode.grpc)


@pytest.fixture(scope="module")
def prefill_worker(spawn_module, tiny_chat_model):
    return spawn_module("prefill_service", "--model", tiny_chat_model, "--dtype", "float32",
                        "--backend", "eager", "--threads", "1", "--max-model-len", MAX_LEN,
                        "--max-chunk-bytes", 2048, "--kv-socket-min-bytes", 0)


def _metric(service, name) -> float:
    return metric_value(service.info["metrics"], name)


def _thread_nice_values(pid: int) -> list[int]:
    """The OS nice value of each thread of process ``pid`` (/proc/PID/task/TID/stat, field 19)."""
    values = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        with contextlib.suppress(OSError):  # a thread may end meanwhile
            values.append(int(stat.read_text().rsplit(")", 1)[1].split()[16]))
    return values


@pytest.mark.parametrize("socket_on", [True, False])
def test_kv_over_the_socket_or_the_stream_gives_transformers_tokens(
        spawn_module, tiny_chat_model, prefill_worker, reference, socket_on):
    """A real prefill worker: the decode worker takes the prompt's KV (many chunks) over the KV
    socket by default, or on the stream with --kv-socket off; the tokens are transformers' either
    way and the prefill worker counts which path carried it. The socket's receiving thread runs
    at --kv-receive-nice (7 here; threads of that nice exist only once a transfer ran)."""
    decode = spawn_module("decode_service", "--model", tiny_chat_model, "--dtype", "float32",
                          "--backend", "eager", "--threads", "1", "--max-model-len", MAX_LEN,
                          "--kv-blocks", 24, "--block-size", 16, "--max-batch-size", 4,
                          "--kv-socket", "on" if socket_on else "off", "--kv-receive-nice", 7)
    assert 7 not in _thread_nice_values(decode.proc.pid)
    before = _metric(prefill_worker, "nxdi_kv_socket_transfers_total")
    ids = PROMPTS[2]
    req = request("sock" if socket_on else "stream", ids, 8)
    req.prefill_candidates.append(prefill_worker.grpc)
    assert [e.token_id for e in run(collect(decode.grpc, req))] == greedy(reference, ids, 8)
    assert _metric(prefill_worker, "nxdi_kv_socket_transfers_total") - before == int(socket_on)
    assert (7 in _thread_nice_values(decode.proc.pid)) == socket_on
    assert _metric(prefill_worker, "nxdi_kv_socket_fallbacks_total") == 0
    wait_for_idle(decode.grpc)


def test_unreachable_prefill_falls_back_to_local_when_asked(decode, reference):
    fresh = list(range(9100, 9140))  # nothing of it cached, so the prefill worker is asked
    req = request("f", fresh, 6)
    req.prefill_candidates.append("127.0.0.1:1")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(collect(decode.grpc, req))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    req.local_prefill_fallback = True
    events = run(collect(decode.grpc, req))
    assert [e.token_id for e in events] == greedy(reference, fresh, 6)
    wait_for_idle(decode.grpc)


def test_a_failed_prefill_candidate_is_passed_over_for_the_next(decode, prefill_worker,
                                                                reference):
    """Candidates ranked [nothing listening, a real prefill worker]: the pull fails at the first,
    takes the KV from the second (transformers' tokens), and counts one failover."""
    fresh = list(range(9200, 9240))
    before = _metric(decode, "nxdi_kv_pull_failovers_total")
    req = request("failover", fresh, 6)
    req.prefill_candidates.extend(["127.0.0.1:1", prefill_worker.grpc])
    assert [e.token_id for e in run(collect(decode.grpc, req))] == greedy(reference, fresh, 6)
    assert _metric(decode, "nxdi_kv_pull_failovers_total") - before == 1
    wait_for_idle(decode.grpc)


@pytest.mark.parametrize("hold", [True, False])
def test_a_held_first_token_is_sent_as_its_sequence_joins_the_batch(
        spawn_module, tiny_chat_model, prefill_worker, reference, hold):
    """--hold-first-token: a prompt's first token reaches the client when its sequence joins the
    running batch. With one batch slot held by a long stream A, B's first token (prefilled by
    the prefill worker, then by the decode worker itself) comes only with A's last; without the
    flag it comes while A still runs. Every stream is transformers' greedy tokens either way."""
    decode = spawn_module("decode_service", "--model", tiny_chat_model, "--dtype", "float32",
                          "--backend", "eager", "--threads", "1", "--max-model-len", MAX_LEN,
                          "--kv-blocks", 24, "--block-size", 16, "--max-batch-size", 1,
                          *(["--hold-first-token"] if hold else []))
    long_ids = PROMPTS[0]

    async def a_then_b(b_ids, remote):
        arrivals = []  # (stream, token index), in the order they reached us
        async with grpc.aio.insecure_channel(decode.grpc) as channel:
            stub = pb_grpc.DecodeStub(channel)

            async def stream(name, req, started=None):
                tokens = []
                async for e in stub.Generate(req):
                    arrivals.append((name, e.index))
                    tokens.append(e.token_id)
                    if started is not None and len(tokens) == 2:
                        started.set()
                return tokens

            started = asyncio.Event()
            a = asyncio.create_task(stream("a", request("a", long_ids, 240), started))
            await started.wait()
            b_req = request("b", b_ids, 8)
            if remote:
                b_req.prefill_candidates.append(prefill_worker.grpc)
            b = await stream("b", b_req)
            return await a, b, arrivals

    for b_ids, remote in ((list(range(9200, 9240)), True), (list(range(9300, 9330)), False)):
        a, b, arrivals = run(a_then_b(b_ids, remote))
        assert a == greedy(reference, long_ids, 240) and b == greedy(reference, b_ids, 8)
        # A's last token and B's first leave the worker in the same step, on two streams the
        # client may read in either order, and a step of this tiny model is short enough that
        # the client has also read B's first before A's token before its last (CI, session 63);
        # A's token two before its last is two steps earlier. Without the hold B's first comes
        # while A is still far from its end.
        b_first, a_two_before_last = arrivals.index(("b", 0)), arrivals.index(("a", 237))
        assert (b_first > a_two_before_last) == hold, (remote, arrivals[:20])
        wait_for_idle(decode.grpc)


@pytest.fixture(scope="module", params=["sdpa", "paged"])
def decode_mixed(request, spawn_module, tiny_chat_model):
    """A decode worker per attention path; with sdpa it runs short and long sequences apart
    whenever that attends less (split call cost 0)."""
    return request.param, spawn_module(
        "decode_service", "--model", tiny_chat_model, "--dtype", "float32", "--backend", "eager",
        "--threads", "1", "--max-model-len", MAX_LEN, "--kv-blocks", 64, "--block-size", 16,
        "--max-batch-size", 4, "--split-call-cost", 0, "--attention-kernel", request.param)


def test_short_and_long_sequences_decode_together_and_match_transformers(decode_mixed, reference):
    """Three short prompts and a long one. sdpa: length buckets 128 and 256, so each step is two
    token-generation calls (short rows, long rows). paged: one length bucket, one call per step,
    each row reading only its own blocks. Either way every token is transformers' token."""
    kernel, decode_split = decode_mixed
    prompts = [[1, 504, 3458], list(range(300, 330)), [9] * 12, list(range(1000, 1200))]

    async def all_at_once():
        reqs = [request(f"s{i}", ids, max_tokens=16) for i, ids in enumerate(prompts)]
        return await asyncio.gather(*(collect(decode_split.grpc, r) for r in reqs))

    for ids, events in zip(prompts, run(all_at_once())):
        assert [e.token_id for e in events] == greedy(reference, ids, 16)
    steps = _metric(decode_split, "nxdi_decode_steps_total")
    calls = _metric(decode_split, "nxdi_token_generation_calls_total")
    assert steps >= 16
    assert calls > steps if kernel == "sdpa" else calls == steps
    # every step and every call timed: a step's time holds its calls' and the host work on them
    mixed = _metric(decode_split, "nxdi_mixed_steps_total")
    assert _metric(decode_split, "nxdi_decode_step_duration_seconds_count") == steps - mixed
    assert _metric(decode_split, "nxdi_token_generation_forward_seconds_count") == calls
    forward_s = _metric(decode_split, "nxdi_token_generation_forward_seconds_sum")
    assert 0 < forward_s < _metric(decode_split, "nxdi_decode_step_duration_seconds_sum")


# ---------------------------------------------------------------------------------------------
# A float8 KV cache (--kv-cache-dtype fp8) on both workers
# ---------------------------------------------------------------------------------------------

FP8_ARGS = ("--dtype", "float32", "--backend", "eager", "--threads", "1",
            "--max-model-len", MAX_LEN, "--kv-cache-dtype", "fp8")


@pytest.fixture(scope="module")
def fp8_pair(spawn_module, tiny_chat_model):
    prefill = spawn_module("prefill_service", "--model", tiny_chat_model, *FP8_ARGS)
    decode = spawn_module("decode_service", "--model", tiny_chat_model, *FP8_ARGS,
                          "--kv-blocks", 24, "--block-size", 16, "--max-batch-size", 4)
    return prefill, decode


def test_fp8_kv_moves_as_fp8_and_decodes_like_local_prefill(fp8_pair):
    """The prompt's KV crosses as one byte per value (2 layers x K,V x 2 KV heads x 16 dims = 128
    bytes a token, a quarter of float32), lands in the decode worker's float8 cache unchanged, and
    the tokens equal those of a local prefill on the same worker (same cache contents)."""
    prefill, decode = fp8_pair
    ids = list(range(200, 237))
    before = _metric(decode, "nxdi_kv_transfer_bytes_total")
    remote = request("fp8-remote", ids, 10)
    remote.prefill_candidates.append(prefill.grpc)
    remote_tokens = [e.token_id for e in run(collect(decode.grpc, remote))]
    assert _metric(decode, "nxdi_kv_transfer_bytes_total") - before == len(ids) * 128
    local_tokens = [e.token_id for e in run(collect(decode.grpc, request("fp8-local", ids, 10)))]
    assert remote_tokens == local_tokens and len(remote_tokens) == 10
    wait_for_idle(decode.grpc)


def test_fp8_and_full_precision_workers_refuse_each_other(fp8_pair, decode):
    """A decode worker keeping float32 KV refuses a prefill worker that sends float8, with
    FAILED_PRECONDITION naming the KV quantization; nothing stays reserved."""
    prefill, _ = fp8_pair
    req = request("fp8-mismatch", [5, 6, 7, 8], 2)
    req.prefill_candidates.append(prefill.grpc)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(collect(decode.grpc, req))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "quant" in err.value.details()
    wait_for_idle(decode.grpc)


# ---------------------------------------------------------------------------------------------
# Chunked local prefill (--prefill-chunk-tokens)
# ---------------------------------------------------------------------------------------------

CHUNK = 16


@pytest.fixture(scope="module")
def decode_chunked(spawn_module, tiny_chat_model):
    return spawn_module("decode_service", "--model", tiny_chat_model, "--dtype", "float32",
                        "--backend", "eager", "--threads", "1", "--max-model-len", 512,
                        "--kv-blocks", 96, "--block-size", 16, "--max-batch-size", 4,
                        "--prefill-chunk-tokens", CHUNK)


def test_chunked_prefill_and_a_cached_prefix_match_transformers(decode_chunked, reference):
    """Prompts of several pieces, and prompts whose leading blocks are cached (the prefill
    starts past them, reading them through the block table), give transformers' tokens."""
    first = list(range(2000, 2200))
    prompts = [first, first[:160] + list(range(5000, 5040)), first, list(range(300, 317))]
    hits = _metric(decode_chunked, "nxdi_prefix_cache_hit_tokens_total")
    for i, ids in enumerate(prompts):  # one after the other: the later ones hit the cache
        events = run(collect(decode_chunked.grpc, request(f"c{i}", ids, max_tokens=10)))
        assert [e.token_id for e in events] == greedy(reference, ids, 10), i
        cached = events[-1].usage.cached_prompt_tokens
        assert cached == (0, 160, 192, 0)[i], (i, cached)
    assert _metric(decode_chunked, "nxdi_prefix_cache_hit_tokens_total") - hits == 160 + 192


def test_the_next_turn_finds_the_previous_answers_kv_in_the_prefix_cache(decode_chunked,
                                                                        reference):
    """A finished sequence's generated tokens (all but the last, whose KV was never written)
    join the prefix cache: a prompt that repeats prompt + answer and goes on (a chat's next
    turn) is cached through the answer's full blocks, and still gives transformers' tokens."""
    prompt = list(range(7000, 7100))
    answer = [e.token_id for e in run(collect(decode_chunked.grpc, request("turn1", prompt, 30)))]
    assert answer == greedy(reference, prompt, 30)
    turn2 = prompt + answer + list(range(8000, 8020))
    events = run(collect(decode_chunked.grpc, request("turn2", turn2, max_tokens=10)))
    assert [e.token_id for e in events] == greedy(reference, turn2, 10)
    # 100 prompt + 29 fed-back answer tokens have KV: 8 full blocks of 16
    assert events[-1].usage.cached_prompt_tokens == (100 + 29) // 16 * 16 == 128


def test_a_chunked_prefill_lets_running_sequences_step(decode_chunked, reference):
    """While a 320-token prompt is prefilled in 20 pieces, a running sequence keeps getting
    tokens: its decode step rides in each piece's model call (one prefill would stall it
    throughout), and both get transformers' tokens."""
    long_prompt, short_prompt = list(range(3000, 3320)), [5, 6, 7]
    mixed_before = _metric(decode_chunked, "nxdi_mixed_steps_total")

    async def both():
        arrivals, tokens = [], {"run": [], "long": []}
        started = asyncio.Event()

        async def one(rid, ids, max_tokens, after=None):
            if after is not None:
                await after.wait()
                arrivals.append("submitted")
            async with grpc.aio.insecure_channel(decode_chunked.grpc) as channel:
                stream = pb_grpc.DecodeStub(channel).Generate(request(rid, ids, max_tokens))
                async for event in stream:
                    arrivals.append(rid)
                    tokens[rid].append(event.token_id)
                    started.set()

        await asyncio.gather(one("run", short_prompt, 180), one("long", long_prompt, 4, started))
        return arrivals, tokens

    arrivals, tokens = run(both())
    window = arrivals[arrivals.index("submitted"):arrivals.index("long")]
    pieces = -(-len(long_prompt) // CHUNK)
    assert window.count("run") >= pieces // 2, (window.count("run"), pieces)
    mixed = _metric(decode_chunked, "nxdi_mixed_steps_total") - mixed_before
    assert mixed >= pieces // 2, (mixed, pieces)
    assert tokens["run"] == greedy(reference, short_prompt, 180)
    assert tokens["long"] == greedy(reference, long_prompt, 4)


def test_a_prompt_shorter_than_a_piece_is_not_mixed(decode_chunked, reference):
    """A 10-token prompt prefilled while a sequence runs is a context-encoding call of its own
    (a mixed call would pad it to a whole piece); both still get transformers' tokens."""
    mixed_before = _metric(decode_chunked, "nxdi_mixed_steps_total")

    async def both():
        async def short_later():
            await asyncio.sleep(0.05)
            return await collect(decode_chunked.grpc, request("short", list(range(40, 50)), 3))
        return await asyncio.gather(collect(decode_chunked.grpc, request("run", [8, 9], 40)),
                                    short_later())

    running, short = run(both())
    assert [e.token_id for e in running] == greedy(reference, [8, 9], 40)
    assert [e.token_id for e in short] == greedy(reference, list(range(40, 50)), 3)
    assert _metric(decode_chunked, "nxdi_mixed_steps_total") == mixed_before


def first_token_order(server, sends) -> list[str]:
    """Send (request id, prompt, delay s) each on its own stream; the ids in the order of their
    first (only) token."""
    async def all_of():
        order = []

        async def one(rid, ids, delay):
            await asyncio.sleep(delay)
            async with grpc.aio.insecure_channel(server.grpc) as channel:
                async for _ in pb_grpc.DecodeStub(channel).Generate(request(rid, ids, 1)):
                    order.append(rid)

        await asyncio.gather(*(one(*send) for send in sends))
        return order

    return run(all_of())


def test_a_begun_long_prefill_is_not_overtaken_by_a_shorter_long_one(decode_chunked):
    """First come first served among prompts longer than a piece: a 200-token prompt sent
    while a 480-token prompt is being prefilled waits for it, though it has fewer tokens left
    (shortest remaining first would run it first)."""
    assert first_token_order(decode_chunked, [("first", list(range(6000, 6480)), 0.0),
                                              ("second", list(range(7000, 7200)), 0.02)]) \
        == ["first", "second"]


def test_a_short_local_prefill_goes_before_the_rest_of_a_long_one(decode_chunked):
    """A prompt that fits in one piece overtakes: a 10-token prompt sent while a 480-token
    prompt is being prefilled (30 pieces) gets its first token before the long one does."""
    assert first_token_order(decode_chunked, [("long", list(range(4000, 4480)), 0.0),
                                              ("short", list(range(20, 30)), 0.02)]) \
        == ["short", "long"]
