"""The prefill worker end to end: a real server on 127.0.0.1 (port 0), a gRPC client, and
transformers as the reference for first tokens, logprobs and the KV cache."""
import asyncio
import dataclasses
import signal
import socket
import threading
import time
import urllib.request

import grpc
import pytest
import torch

from nxdi_common import bucketing, kv_transfer
from nxdi_common.modules.sampling import sample_from_logits
from nxdi_common.serving import kv_socket, worker
from nxdi_common.serving.errors import Overloaded
from nxdi_common.serving.grpc_server import channel_options
from nxdi_common.serving.types import PrefillJob
from prefill_service.scheduler import PrefillScheduler, PrefillTask, copy_kv
from prefill_service.server import DEFAULT_PREFIX_CACHE_BLOCKS, PrefillApp, PrefillSettings
from protos.nxdi.serving.v1 import serving_pb2 as pb
from protos.nxdi.serving.v1 import serving_pb2_grpc

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = pb.SamplingParams(temperature=0)


# ---------------------------------------------------------------------------------------------
# Harness: an in-process worker served from a background event loop
# ---------------------------------------------------------------------------------------------

def load(ckpt, max_model_len: int, settings: PrefillSettings):
    opts = worker.ModelOptions(str(ckpt), "float32", max_model_len, "eager", None, 1)
    config = worker.prefill_neuron_config(opts, settings.max_batch_size, settings.ctx_batch_size,
                                          settings.max_batch_tokens, settings.prefix_cache_blocks,
                                          settings.block_size)
    model = worker.load_model(opts, config)
    return model, worker.model_fingerprint(model, opts)


class LiveWorker:
    """PrefillApp on 127.0.0.1:0 in a background event loop, with a client stub."""

    def __init__(self, ckpt, max_model_len=256, start_engine=True, **settings):
        self.settings = PrefillSettings(**settings)
        model, self.fingerprint = load(ckpt, max_model_len, self.settings)
        self.app = PrefillApp(model, self.fingerprint, self.settings)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = self.run(self.app.start("127.0.0.1", 0, start_engine=start_engine))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}",
                                             options=channel_options(64 << 20))
        self.stub = serving_pb2_grpc.PrefillStub(self.channel)

    def run(self, coro, timeout=30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def request(self, ids, **kw) -> pb.PrefillRequest:
        kw.setdefault("sampling", GREEDY)
        kw.setdefault("request_id", "req")
        kw.setdefault("fingerprint", kv_transfer.fingerprint_to_proto(self.fingerprint))
        return pb.PrefillRequest(prompt_token_ids=list(ids), **kw)

    def load(self) -> pb.WorkerLoad:
        return self.stub.GetLoad(pb.GetLoadRequest(), timeout=5)

    def wait_load(self, **expected) -> pb.WorkerLoad:
        """Poll GetLoad until every given field has the given value (5 s at most)."""
        deadline = time.monotonic() + 5
        while True:
            report = self.load()
            if all(getattr(report, k) == v for k, v in expected.items()):
                return report
            assert time.monotonic() < deadline, f"load never reached {expected}: {report}"
            time.sleep(0.02)

    def outcomes(self) -> dict[str, float]:
        return {o: self.app.metrics.value("nxdi_requests_total", outcome=o)
                for o in ("ok", "cancelled", "error", "rejected", "invalid")}

    def close(self):
        self.channel.close()
        self.run(self.app.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture(scope="module", params=[0, 80], ids=["flat", "prefix-cache"])
def live(request, tiny_llama_ckpt, one_torch_thread):
    """A worker with a flat KV cache, and one with a prefix cache (block KV cache): each test
    runs on both."""
    w = LiveWorker(tiny_llama_ckpt, prefix_cache_blocks=request.param)
    yield w
    w.close()


@pytest.fixture
def make_live(tiny_llama_ckpt, one_torch_thread):
    made = []

    def make(ckpt=None, **kw):
        made.append(LiveWorker(ckpt or tiny_llama_ckpt, **kw))
        return made[-1]
    yield make
    for w in made:
        w.close()


@pytest.fixture(scope="module")
def hf(tiny_llama_ckpt):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(tiny_llama_ckpt, dtype=torch.float32).eval()


# ---------------------------------------------------------------------------------------------
# Reference and stream helpers
# ---------------------------------------------------------------------------------------------

def reference(hf, ids):
    """transformers' last-position logits [V] and K, V [layers, tokens, kv_heads, head_dim]."""
    with torch.no_grad():
        out = hf(torch.tensor([list(ids)]), use_cache=True)
    cache = out.past_key_values.layers
    k = torch.stack([layer.keys[0].permute(1, 0, 2) for layer in cache])
    v = torch.stack([layer.values[0].permute(1, 0, 2) for layer in cache])
    return out.logits[0, -1].float(), k, v


def split(events):
    """(first_token, [KVChunkData], done) of a complete stream, checking the event order."""
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds == ["first_token"] + ["kv_chunk"] * (len(kinds) - 2) + ["done"]
    chunks = [kv_transfer.chunk_from_proto(e.kv_chunk) for e in events[1:-1]]
    return events[0].first_token, chunks, events[-1].done


def assemble(chunks, fp, request_id, num_tokens, token_start, heads):
    """Decode and validate the chunks into K, V [layers, tokens, heads, head_dim] (the requested
    part only); checks that they cover that part exactly once."""
    res = kv_transfer.Reservation.for_model(fp, request_id, num_tokens, token_start)
    coverage = kv_transfer.KVCoverage(res)
    shape = (fp.num_layers, num_tokens - token_start, heads[1] - heads[0], fp.head_dim)
    k, v = torch.zeros(shape), torch.zeros(shape)
    for chunk in chunks:
        write = kv_transfer.decode_chunk(chunk, res)
        coverage.add(write)
        tokens = slice(write.tokens.start - token_start, write.tokens.stop - token_start)
        heads_rel = slice(write.heads.start - heads[0], write.heads.stop - heads[0])
        k[write.layers, tokens, heads_rel] = write.k
        v[write.layers, tokens, heads_rel] = write.v
    outside = fp.num_layers * (num_tokens - token_start) * (fp.num_kv_heads - heads[1] + heads[0])
    assert coverage.missing() == outside
    return k, v


def prompt(n, offset=0):
    return [(7 * i + 3 + offset) % 256 for i in range(n)]


def check_greedy(live, hf, ids, events, request_id="req"):
    """The stream carries transformers' greedy token and the prompt's whole KV."""
    first, chunks, done = split(events)
    logits, k_ref, v_ref = reference(hf, ids)
    assert first.token_id == int(logits.argmax())
    k, v = assemble(chunks, live.fingerprint, request_id, len(ids), 0, (0, 2))
    torch.testing.assert_close(k, k_ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(v, v_ref, atol=1e-4, rtol=0)
    assert done.num_chunks == len(chunks)
    assert done.payload_bytes == sum(len(c.k) + len(c.v) for c in chunks)
    return first


# ---------------------------------------------------------------------------------------------
# The rand argument of NeuronBaseForCausalLM.forward (the sampler's uniforms)
# ---------------------------------------------------------------------------------------------

def test_forward_rand_picks_the_sampled_token(tiny_llama_ckpt, hf):
    model, _ = load(tiny_llama_ckpt, 64, PrefillSettings(1, 1))
    ids = torch.tensor([prompt(9)])
    top2 = reference(hf, ids[0].tolist())[0].topk(2).indices.tolist()
    params = torch.tensor([[2.0, 1.0, 1.0]])  # top_k 2, top_p 1, temperature 1
    picks = [int(model.forward(ids, sampling_params=params, rand=torch.tensor([u])).tokens[0])
             for u in (0.0, 0.9999)]
    assert picks == top2  # the lowest uniform takes the likeliest token, the highest the other
    with pytest.raises(ValueError, match=r"rand must be \[batch\] = \[1\]"):
        model.forward(ids, sampling_params=params, rand=torch.zeros(2))


# ---------------------------------------------------------------------------------------------
# Scheduler
# ---------------------------------------------------------------------------------------------

def test_scheduler_batches_the_oldest_bucket_fifo():
    sched = PrefillScheduler([128, 256], ctx_batch_size=2, max_queued=5)
    tasks = {n: PrefillTask(PrefillJob(f"r{n}", (1,) * n), (0, 2), None, None)
             for n in (3, 200, 17, 150, 1)}
    for task in tasks.values():
        sched.add(task)
    with pytest.raises(Overloaded, match="prefill queue is full"):
        sched.add(PrefillTask(PrefillJob("extra", (1,)), (0, 2), None, None))
    assert sched.queued_prompt_tokens == 3 + 200 + 17 + 150 + 1
    assert sched.remove(tasks[17]) and not sched.remove(tasks[17])
    batches = []
    while batch := sched.next_batch():
        batches.append([t.job.request_id for t in batch])
    assert batches == [["r3", "r1"], ["r200", "r150"]]
    assert [tasks[n].bucket for n in (3, 200, 1)] == [128, 256, 128]


def test_scheduler_shortest_first_until_the_oldest_has_waited_its_bound():
    now = [0]
    sched = PrefillScheduler([128, 256, 512], ctx_batch_size=2, max_queued=9,
                             order="shortest", max_overtaken_s=1.0, clock=lambda: now[0])

    def add(name, n, at_s):
        sched.add(PrefillTask(PrefillJob(name, (1,) * n), (0, 2), None, None,
                              arrival_ns=int(at_s * 1e9)))

    add("long", 500, 0.0)
    add("mid", 200, 0.1)
    add("chat1", 50, 0.2)
    add("chat2", 60, 0.3)
    now[0] = int(0.5e9)
    assert [t.job.request_id for t in sched.next_batch()] == ["chat1", "chat2"]
    add("chat3", 40, 0.6)
    now[0] = int(0.9e9)  # the oldest has waited 0.9 s: still overtaken
    assert [t.job.request_id for t in sched.next_batch()] == ["chat3"]
    add("chat4", 30, 0.95)
    now[0] = int(1.0e9)  # 1.0 s: the long prompt goes next, then the shortest again
    assert [t.job.request_id for t in sched.next_batch()] == ["long"]
    assert [t.job.request_id for t in sched.next_batch()] == ["chat4"]
    assert [t.job.request_id for t in sched.next_batch()] == ["mid"]
    assert sched.next_batch() == []


def test_scheduler_deadline_order_skips_the_prompts_already_late():
    """Order "deadline": the oldest prompt that can still be encoded within the TTFT target of
    its arrival (at the measured time per token of its bucket) goes next, so a burst of long
    prompts makes late only those that were late anyway; when none can, or once the oldest has
    waited max_overtaken_s, the oldest goes. Until a batch has been timed every prompt counts
    as in time (arrival order)."""
    now = [0]
    sched = PrefillScheduler([128, 1024], ctx_batch_size=2, max_queued=9, order="deadline",
                             max_overtaken_s=8.0, ttft_target_s=3.5, clock=lambda: now[0])

    def add(name, n, at_s):
        task = PrefillTask(PrefillJob(name, (1,) * n), (0, 2), None, None,
                           arrival_ns=int(at_s * 1e9))
        sched.add(task)
        return task

    def ids():
        return [t.job.request_id for t in sched.next_batch()]

    def timed(n, seconds):  # a batch of one prompt of n tokens took `seconds`
        task = add("timed", n, 0.0)
        sched.remove(task)
        sched.observe([task], seconds)

    add("long0", 1000, 0.0)
    add("long1", 900, 0.5)
    assert ids() == ["long0", "long1"]  # nothing timed yet: oldest first, its bucket batched
    timed(1000, 1.0)  # the 1024-token bucket takes 1 s (its padded tokens, not the prompt's)
    assert sched.ns_per_token == {1024: pytest.approx(1e9 / 1024)}
    for name, at_s in (("late", 0.0), ("ontime", 0.5), ("later", 1.0)):
        add(name, 1000, at_s)
    add("chat", 100, 1.5)
    now[0] = int(3.0e9)  # "late" would end at 4.0 > 3.5, "ontime" at 4.0 <= 4.0
    assert sched.in_time(sched.waiting[1], now[0]) and not sched.in_time(sched.waiting[0], now[0])
    assert ids() == ["ontime", "late"]  # the lead first, then its bucket in arrival order
    now[0] = int(4.2e9)  # "later" ends at 5.2 > 4.5; "chat" (bucket 128 at the nearest
    assert ids() == ["chat"]  # measured bucket's time per token: 0.125 s) at 4.325 <= 5.0
    add("late2", 1000, 4.3)
    now[0] = int(7.0e9)  # neither long prompt can end in time: the oldest, with its bucket
    assert ids() == ["later", "late2"]
    timed(100, 1.0)  # the 128-token bucket measured: 1 s
    add("old", 1000, 8.0)
    add("chat2", 100, 14.0)
    now[0] = int(14.5e9)
    assert ids() == ["chat2"]  # ends at 15.5 <= 17.5; "old" at 15.5 > 11.5
    add("chat3", 100, 15.9)
    now[0] = int(16.0e9)  # "old" has waited max_overtaken_s: it goes, in time or not
    assert ids() == ["old"]
    assert ids() == ["chat3"] and ids() == []


def test_scheduler_arrival_order_ignores_length_and_bad_orders_are_refused():
    sched = PrefillScheduler([128, 512], ctx_batch_size=2, max_queued=9, order="arrival")
    for name, n in (("long", 500), ("chat", 50)):
        sched.add(PrefillTask(PrefillJob(name, (1,) * n), (0, 2), None, None))
    assert [t.job.request_id for t in sched.next_batch()] == ["long"]
    with pytest.raises(ValueError,
                       match="order must be one of arrival, shortest, deadline, got 'lifo'"):
        PrefillScheduler([128], 1, 1, order="lifo")
    with pytest.raises(ValueError, match="max_overtaken_s must be >= 0 seconds, got -1"):
        PrefillScheduler([128], 1, 1, order="shortest", max_overtaken_s=-1)
    with pytest.raises(ValueError, match="order must be one of arrival, shortest"):
        PrefillSettings(order="short")
    with pytest.raises(ValueError, match="ttft_target_s must be > 0 seconds, got 0"):
        PrefillSettings(order="deadline", ttft_target_s=0)


def test_the_order_flags_reach_the_workers_scheduler(make_live):
    from prefill_service.server import parse_args, settings_from_args
    args = parse_args(["--order", "shortest", "--max-overtaken-seconds", "2.5"])
    settings = settings_from_args(args)
    assert (settings.order, settings.max_overtaken_s) == ("shortest", 2.5)
    assert settings_from_args(parse_args([])).order == "arrival"
    w = make_live(start_engine=False, order="shortest", max_overtaken_s=2.5)
    assert w.app.engine.scheduler.order == "shortest"
    assert w.app.engine.scheduler.max_overtaken_ns == 2_500_000_000
    settings = settings_from_args(parse_args(["--order", "deadline",
                                              "--ttft-target-seconds", "2"]))
    assert (settings.order, settings.ttft_target_s) == ("deadline", 2.0)
    assert settings_from_args(parse_args([])).ttft_target_s == 3.5
    w = make_live(start_engine=False, order="deadline", ttft_target_s=2.0)
    assert w.app.engine.scheduler.ttft_target_ns == 2_000_000_000
    assert w.app.engine.scheduler.max_overtaken_ns == 4_000_000_000  # 2x the target
    assert PrefillScheduler([128], 1, 1, order="shortest").max_overtaken_ns == 1_000_000_000


def test_scheduler_keeps_long_buckets_to_their_batch_limit():
    sched = PrefillScheduler([128, 256, 512], ctx_batch_size=4, max_queued=9,
                             batch_limits={128: 4, 256: 2, 512: 1})
    for i, n in enumerate((300, 400, 200, 250, 210, 100, 90, 80, 70)):
        sched.add(PrefillTask(PrefillJob(f"r{i}", (1,) * n), (0, 2), None, None))
    batches = []
    while batch := sched.next_batch():
        batches.append([t.job.request_id for t in batch])
    assert batches == [["r0"], ["r1"], ["r2", "r3"], ["r4"], ["r5", "r6", "r7", "r8"]]


def test_context_buckets_under_a_batch_token_budget(tiny_llama_ckpt):
    """Batches of several prompts only within max_context_batch_tokens: the buckets built, the
    limit the worker schedules by, and a clear error for a batch past it."""
    opts = worker.ModelOptions(str(tiny_llama_ckpt), "float32", 256, "eager", None, 1,
                               context_buckets=(64, 128, 256))
    model = worker.load_model(opts, worker.prefill_neuron_config(opts, 4, 4, 256))
    cte = model.context_encoding_model
    assert cte.bucket_keys() == [(1, 64), (1, 128), (1, 256), (2, 64), (2, 128), (4, 64)]
    assert [cte.max_batch(n) for n in (64, 128, 256)] == [4, 2, 1]
    assert cte.select_bucket(3, 50) == (4, 64) and cte.select_bucket(2, 100) == (2, 128)
    with pytest.raises(ValueError, match="batch size 2 of 256-token prompts is over "
                                         r"max_context_batch_tokens \(256\)"):
        cte.select_bucket(2, 200)
    unlimited = worker.load_model(opts, worker.prefill_neuron_config(opts, 4, 4))
    assert len(unlimited.context_encoding_model.bucket_keys()) == 9
    with pytest.raises(ValueError, match="max_batch_tokens must be at least 1"):
        PrefillSettings(max_batch_tokens=0)


# ---------------------------------------------------------------------------------------------
# Prefill streams
# ---------------------------------------------------------------------------------------------

def test_greedy_first_token_logprobs_and_whole_kv(live, hf):
    ids = prompt(20)
    sampling = pb.SamplingParams(temperature=0, logprobs=True, top_logprobs=3)
    events = list(live.stub.Prefill(live.request(ids, sampling=sampling), timeout=10))
    first = check_greedy(live, hf, ids, events)
    assert len(events) == 3  # one chunk: 2 layers x 20 tokens x 256 bytes fit the default bound
    ref = torch.log_softmax(reference(hf, ids)[0], -1)
    assert first.logprob == pytest.approx(float(ref.max()), abs=1e-4)
    assert [t.token_id for t in first.top_logprobs] == ref.topk(3).indices.tolist()
    assert [t.logprob for t in first.top_logprobs] == pytest.approx(ref.topk(3).values.tolist(),
                                                                    abs=1e-4)
    assert first.compute_ns > 0 and events[-1].done.transfer_ns > 0


def test_kv_token_start_head_range_and_small_chunks(live, hf):
    ids = prompt(20, offset=1)
    # one token of one layer of one head is 2 x 16 x 4 = 128 bytes: 3 tokens per chunk
    req = live.request(ids, request_id="part", kv_token_start=5, head_start=1, head_end=2,
                       max_chunk_bytes=3 * 128 + 100)
    first, chunks, done = split(list(live.stub.Prefill(req, timeout=10)))
    assert len(chunks) == done.num_chunks == 2 * 5  # per layer: tokens 5..20 in steps of 3
    assert all(len(c.k) + len(c.v) <= 3 * 128 for c in chunks)
    assert {(c.head_start, c.head_end) for c in chunks} == {(1, 2)}
    assert [(c.layer_start, c.token_start, c.token_end) for c in chunks[:5]] == \
        [(0, 5, 8), (0, 8, 11), (0, 11, 14), (0, 14, 17), (0, 17, 20)]
    k, v = assemble(chunks, live.fingerprint, "part", len(ids), 5, (1, 2))
    logits, k_ref, v_ref = reference(hf, ids)
    assert first.token_id == int(logits.argmax()) and not first.HasField("logprob")
    torch.testing.assert_close(k, k_ref[:, 5:, 1:2], atol=1e-4, rtol=0)
    torch.testing.assert_close(v, v_ref[:, 5:, 1:2], atol=1e-4, rtol=0)


def test_queued_prompts_are_batched_by_bucket_and_all_correct(make_live, hf):
    w = make_live(start_engine=False)
    lengths = [3, 200, 17, 1, 230, 64]  # buckets 32, 256, 32, 32, 256, 64 (the worker's default)
    results, threads = {}, []
    for n in lengths:
        req = w.request(prompt(n, offset=n), request_id=f"r{n}")
        call = w.stub.Prefill(req, timeout=20)
        threads.append(threading.Thread(target=lambda c=call, n=n: results.update({n: list(c)})))
        threads[-1].start()
        w.wait_load(queued_requests=len(threads))  # queue them in this order
    report = w.wait_load(queued_requests=6)
    assert report.queued_prompt_tokens == sum(lengths)
    w.app.engine.start()
    for t in threads:
        t.join(20)
    firsts = {n: check_greedy(w, hf, prompt(n, offset=n), results[n], f"r{n}") for n in lengths}
    batch_times = {n: f.compute_ns for n, f in firsts.items()}  # shared by one batch's requests
    assert len({batch_times[n] for n in (3, 17, 1)}) == 1
    assert len({batch_times[n] for n in (200, 230)}) == 1
    assert len({batch_times[n] for n in (3, 64, 200)}) == 3
    assert w.wait_load(queued_requests=0, open_transfers=0).running_sequences == 0


def test_seeded_sampling_is_reproducible(live, hf):
    ids = prompt(12, offset=2)
    logits = reference(hf, ids)[0]

    def sample(seed, temperature=1.0):
        sampling = pb.SamplingParams(temperature=temperature, top_k=0, seed=seed, logprobs=True)
        events = list(live.stub.Prefill(live.request(ids, sampling=sampling), timeout=10))
        return events[0].first_token
    first = sample(1234)
    assert sample(1234).token_id == first.token_id
    u = torch.rand(1, generator=torch.Generator().manual_seed(1234))
    expected = sample_from_logits(logits[None], torch.tensor([[0.0, 1.0, 1.0]]), u)
    assert first.token_id == int(expected)
    assert len({sample(seed).token_id for seed in range(6)}) > 1
    hot = sample(7, temperature=0.5)
    ref = torch.log_softmax(logits / 0.5, -1)[hot.token_id]
    assert hot.logprob == pytest.approx(float(ref), abs=1e-4)


# ---------------------------------------------------------------------------------------------
# Refusals, queue bound, cancellation, load
# ---------------------------------------------------------------------------------------------

def refusal(w, req):
    with pytest.raises(grpc.RpcError) as info:
        list(w.stub.Prefill(req, timeout=5))
    return info.value.code(), info.value.details()


def test_refusals_name_the_field_and_queue_nothing(make_live):
    w = make_live(start_engine=False)  # anything queued would stay visible in GetLoad
    other = dataclasses.replace(w.fingerprint, dtype="bfloat16")
    code, details = refusal(w, w.request(prompt(4), fingerprint=kv_transfer.fingerprint_to_proto(
        other)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert details == "model fingerprint mismatch: dtype: local='float32' remote='bfloat16'"
    no_fp = pb.PrefillRequest(request_id="x", prompt_token_ids=[1], sampling=GREEDY)
    assert refusal(w, no_fp)[0] == grpc.StatusCode.FAILED_PRECONDITION
    cases = [
        (dict(ids=[]), "prompt_token_ids: must not be empty"),
        (dict(ids=[1, 256]), "prompt_token_ids: token id 256 is outside [0, 256)"),
        (dict(ids=prompt(256)), "prompt_token_ids: is 256 tokens"),
        (dict(ids=prompt(4), kv_token_start=4), "kv_token_start: 4 must be below"),
        (dict(ids=prompt(4), sampling=pb.SamplingParams(top_p=0)), "top_p: must be in (0, 1]"),
        (dict(ids=prompt(4), head_start=1, head_end=3), "head_start: heads [1, 3)"),
        (dict(ids=prompt(4), max_chunk_bytes=255), "max_chunk_bytes: 255 bytes cannot hold"),
        (dict(ids=prompt(4), request_id=""), "request_id: must be 1..256"),
        (dict(ids=prompt(4), banned_first_token_ids=[2, 256]),
         "banned_first_token_ids: fewer than 256 ids in [0, 256), got 2 ([256] out)"),
    ]
    for kw, message in cases:
        code, details = refusal(w, w.request(kw.pop("ids"), **kw))
        assert (code, details[:len(message)]) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    report = w.load()
    assert (report.queued_requests, report.queued_prompt_tokens) == (0, 0)
    assert w.outcomes() == {"ok": 0, "cancelled": 0, "error": 0, "rejected": 0, "invalid": 11}


def test_queue_bound_load_report_and_cancel_while_queued(make_live, hf):
    w = make_live(start_engine=False, max_queued_requests=2, ctx_batch_size=3)
    calls = [w.stub.Prefill(w.request(prompt(n), request_id=f"q{n}"), timeout=20)
             for n in (5, 9)]
    before = time.time_ns()
    report = w.wait_load(queued_requests=2)
    assert report.role == pb.WORKER_ROLE_PREFILL
    assert report.address == f"127.0.0.1:{w.port}"
    assert report.fingerprint == kv_transfer.fingerprint_to_proto(w.fingerprint)
    assert (report.queued_prompt_tokens, report.running_sequences,
            report.max_running_sequences, report.open_transfers) == (14, 0, 3, 0)
    assert w.app.metrics.value("nxdi_queued_prompt_tokens") == 14
    # the default prefix cache's blocks: queued prompts hold none yet
    assert (report.kv_blocks_used, report.kv_blocks_free, report.kv_block_size) == \
        (0, DEFAULT_PREFIX_CACHE_BLOCKS, 16)
    assert before <= report.reported_at_unix_ns <= time.time_ns()
    code, details = refusal(w, w.request(prompt(3)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "prefill queue is full" in details
    calls[0].cancel()  # still queued: dropped from the queue, never run
    assert w.wait_load(queued_requests=1).queued_prompt_tokens == 9
    w.app.engine.start()
    check_greedy(w, hf, prompt(9), list(calls[1]), "q9")
    w.wait_load(queued_requests=0, open_transfers=0)
    assert w.outcomes() == {"ok": 1, "cancelled": 1, "error": 0, "rejected": 1, "invalid": 0}
    assert w.app.metrics.value("nxdi_prompt_tokens_total") == 9


def test_load_report_counts_the_prompt_being_prefilled(make_live, hf):
    """While a batch is encoded its prompt tokens are reported as running_prompt_tokens (what a
    request sent now waits behind, with the queued ones), and they go back to 0 after."""
    w = make_live()
    model, gate = w.app.engine.model, threading.Event()
    forward = model.forward

    def held_forward(*args, **kwargs):  # the real forward, after the test has read the report
        assert gate.wait(20)
        return forward(*args, **kwargs)

    model.forward = held_forward
    call = w.stub.Prefill(w.request(prompt(11), request_id="held"), timeout=30)
    report = w.wait_load(running_sequences=1)
    assert (report.running_prompt_tokens, report.queued_prompt_tokens) == (11, 0)
    gate.set()
    check_greedy(w, hf, prompt(11), list(call), "held")
    assert w.wait_load(running_sequences=0).running_prompt_tokens == 0


def test_load_report_counts_down_the_running_prompt_at_the_measured_rate(make_live, hf):
    """After a batch the worker reports its prefill rate (prompt tokens per second of batch
    time); while the next batch runs, its prompt tokens still to compute are estimated from the
    batch's time so far at that rate (a router weighs a local prefill against this worker by
    it), never below 0 while the batch is still running."""
    w = make_live()
    began = time.perf_counter()
    check_greedy(w, hf, prompt(11), list(w.stub.Prefill(w.request(prompt(11)), timeout=30)),
                 "req")
    rate = w.wait_load(running_sequences=0).prefill_tokens_per_s
    assert rate == pytest.approx(w.app.engine.rate.tokens_per_s)
    # the same batch timed for order "deadline", by its bucket's padded tokens
    bucket = bucketing.select_bucket(11, w.app.engine.scheduler.length_buckets)
    assert list(w.app.engine.scheduler.ns_per_token) == [bucket]
    assert w.app.engine.scheduler.ns_per_token[bucket] * bucket == pytest.approx(
        1e9 * 11 / rate)
    assert w.app.metrics.value("nxdi_prefill_tokens_per_second") == pytest.approx(rate)
    assert 0 < 11 / rate <= time.perf_counter() - began  # the batch within the call's time
    model, gate = w.app.engine.model, threading.Event()
    forward = model.forward

    def held_forward(*args, **kwargs):
        assert gate.wait(20)
        return forward(*args, **kwargs)

    model.forward = held_forward
    w.app.engine.rate.s_per_token = 0.1  # 10 tokens a second, for round figures
    call = w.stub.Prefill(w.request(prompt(12), request_id="held"), timeout=30)
    first = w.wait_load(running_sequences=1).running_prompt_tokens
    assert 10 <= first <= 12
    time.sleep(0.5)
    assert 5 <= w.load().running_prompt_tokens <= first - 4
    time.sleep(0.9)
    report = w.load()
    assert (report.running_sequences, report.running_prompt_tokens) == (1, 0)
    assert report.prefill_tokens_per_s == pytest.approx(10.0)
    gate.set()
    check_greedy(w, hf, prompt(12), list(call), "held")


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory):
    """8 layers' worth of KV per token (4 layers x 8 KV heads x 64 x fp32 = 16 KiB): a long prompt's
    KV (24 MiB) is far more than gRPC and the sockets buffer, so an unread stream stalls."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=256, num_attention_heads=8,
                         num_key_value_heads=8, num_hidden_layers=4, vocab_size=256)
    path = tmp_path_factory.mktemp("wide")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_cancel_mid_transfer_frees_everything(make_live, wide_ckpt):
    w = make_live(wide_ckpt, max_model_len=1536, max_chunk_bytes=1 << 16)
    call = w.stub.Prefill(w.request(prompt(1500), request_id="big"), timeout=30)
    events = iter(call)
    assert next(events).WhichOneof("event") == "first_token"
    assert next(events).WhichOneof("event") == "kv_chunk"
    assert w.wait_load(open_transfers=1).queued_requests == 0  # stalled: we are not reading
    cancel_and_check_freed(w, call)


def cancel_and_check_freed(w, call):
    """Cancel a stalled transfer's stream; the worker ends it as cancelled and holds nothing."""
    call.cancel()
    w.wait_load(open_transfers=0, queued_requests=0, running_sequences=0)
    deadline = time.monotonic() + 5
    while w.outcomes()["cancelled"] != 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert w.outcomes() == {"ok": 0, "cancelled": 1, "error": 0, "rejected": 0, "invalid": 0}
    assert w.app.metrics.value("nxdi_open_kv_transfers") == 0


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------

def test_cli_serves_reports_ready_and_stops_on_sigterm(spawn, tiny_llama_ckpt, hf):
    service = spawn("prefill_service", "--host", "127.0.0.1", "--port", 0, "--metrics-port", 0,
                    "--model", tiny_llama_ckpt, "--backend", "eager", "--dtype", "float32",
                    "--threads", 1, "--max-model-len", 64, "--model-name", "tiny")
    assert service.info["role"] == "prefill"
    with grpc.insecure_channel(service.grpc) as channel:
        stub = serving_pb2_grpc.PrefillStub(channel)
        report = stub.GetLoad(pb.GetLoadRequest(), timeout=5)
        assert report.address == service.grpc and report.fingerprint.model_name == "tiny"
        ids = prompt(10)
        req = pb.PrefillRequest(request_id="cli", prompt_token_ids=ids, sampling=GREEDY,
                                fingerprint=report.fingerprint)
        events = list(stub.Prefill(req, timeout=10))
    assert events[0].first_token.token_id == int(reference(hf, ids)[0].argmax())
    with urllib.request.urlopen(f"http://{service.info['metrics']}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert 'nxdi_requests_total{outcome="ok",role="prefill"} 1.0' in text
    service.proc.send_signal(signal.SIGTERM)
    assert service.proc.wait(timeout=20) == 0, service.output()


@pytest.mark.parametrize("layers, kv_heads", [(1, 1), (2, 3)])
def test_copy_kv_never_returns_a_view_of_the_cache(layers, kv_heads):
    """The sent chunks are views of copy_kv's tensors (kv_transfer), so these must own their
    memory: the next batch reuses the cache rows while they are still being sent. With one
    layer and one KV head the permuted slice is already contiguous (contiguous() is a view)."""
    cache = torch.randn(layers, 2, 3, kv_heads, 16, 4)  # [L, K/V, rows + 1, H, seq, D]
    k, v = copy_kv(cache, 1, (2, 9), (0, kv_heads))
    assert torch.equal(k, cache[:, 0, 1, :, 2:9].permute(0, 2, 1, 3))
    assert torch.equal(v, cache[:, 1, 1, :, 2:9].permute(0, 2, 1, 3))
    assert k.is_contiguous() and v.is_contiguous()
    cache.zero_()
    assert k.abs().sum() > 0 and v.abs().sum() > 0


# ---------------------------------------------------------------------------------------------
# The KV socket: the chunks on a direct TCP connection, the stream as the control path
# ---------------------------------------------------------------------------------------------

def receive_chunks(port, token, max_frame_bytes=1 << 22):
    """The chunks a KV socket carries, read as the decode worker reads them (each frame copied
    out of the receive buffer, which the next frame reuses)."""
    chunks = []

    def keep(frame):
        chunk = kv_transfer.chunk_from_event_bytes(bytes(frame))
        assert chunk is not None, "a frame that is not a kv_chunk event"
        chunks.append(chunk)
        return len(chunk.k) + len(chunk.v)
    frames, payload = asyncio.run(kv_socket.receive("127.0.0.1", port, token, keep,
                                                    max_frame_bytes))
    assert frames == len(chunks) and payload == sum(len(c.k) + len(c.v) for c in chunks)
    return chunks


def as_events(chunks):
    return [pb.PrefillEvent(kv_chunk=kv_transfer.chunk_to_proto(c)) for c in chunks]


def test_kv_socket_carries_the_whole_kv_and_the_stream_ends_with_done(make_live, hf):
    live = make_live(kv_socket_min_bytes=0)
    ids = prompt(30, offset=2)
    before = live.app.metrics.value("nxdi_kv_socket_transfers_total")
    # 2 heads x 16 dims x fp32 x K,V = 256 bytes a token of a layer: 4 a chunk, 2 x 8 chunks
    req = live.request(ids, request_id="sock", accept_kv_socket=True, max_chunk_bytes=1024)
    events = iter(live.stub.Prefill(req, timeout=10))
    first, offer = next(events), next(events)
    assert offer.WhichOneof("event") == "kv_socket"
    assert offer.kv_socket.port == live.app.servicer.kv_socket.port
    assert len(offer.kv_socket.token) == kv_socket.TOKEN_BYTES
    chunks = receive_chunks(offer.kv_socket.port, offer.kv_socket.token)
    rest = list(events)
    assert [e.WhichOneof("event") for e in rest] == ["done"]  # no chunk on the stream
    assert len(chunks) == 16
    check_greedy(live, hf, ids, [first, *as_events(chunks), rest[0]], request_id="sock")
    assert live.app.metrics.value("nxdi_kv_socket_transfers_total") == before + 1
    live.wait_load(open_transfers=0)


def test_unclaimed_kv_socket_falls_back_to_the_stream_and_wrong_tokens_claim_nothing(make_live,
                                                                                      hf):
    w = make_live(kv_socket_accept_seconds=0.5, kv_socket_min_bytes=0)
    ids = prompt(25, offset=3)
    events = iter(w.stub.Prefill(w.request(ids, request_id="late", accept_kv_socket=True),
                                 timeout=10))
    first, offer = next(events), next(events)
    assert offer.WhichOneof("event") == "kv_socket"
    wrong = bytes(a ^ 1 for a in offer.kv_socket.token)
    assert receive_chunks(offer.kv_socket.port, wrong) == []  # closed at once, nothing sent
    rest = list(events)  # the offer times out: the chunks come on the stream
    check_greedy(w, hf, ids, [first, *rest], request_id="late")
    assert w.app.metrics.value("nxdi_kv_socket_fallbacks_total") == 1
    assert w.app.metrics.value("nxdi_kv_socket_transfers_total") == 0
    # The token was single-use: claiming it after the fallback gets a closed connection too.
    assert receive_chunks(offer.kv_socket.port, offer.kv_socket.token) == []


def test_kv_socket_off_sends_every_chunk_on_the_stream(make_live, hf):
    w = make_live(kv_socket=False)
    assert w.app.servicer.kv_socket is None
    ids = prompt(12, offset=4)
    events = list(w.stub.Prefill(w.request(ids, request_id="off", accept_kv_socket=True),
                                 timeout=10))
    check_greedy(w, hf, ids, events, request_id="off")


def test_kv_below_the_socket_threshold_goes_on_the_stream(make_live, hf):
    # 2 layers x 2 heads x 16 dims x fp32 x K,V = 512 bytes a token
    w = make_live(kv_socket_min_bytes=512 * 12 + 1)
    events = list(w.stub.Prefill(w.request(prompt(12), request_id="small",
                                           accept_kv_socket=True), timeout=10))
    check_greedy(w, hf, prompt(12), events, request_id="small")  # no kv_socket event
    events = iter(w.stub.Prefill(w.request(prompt(13), request_id="big", accept_kv_socket=True),
                                 timeout=10))
    assert next(events).WhichOneof("event") == "first_token"
    offer = next(events)
    assert offer.WhichOneof("event") == "kv_socket"  # 13 tokens reach the threshold
    assert len(receive_chunks(offer.kv_socket.port, offer.kv_socket.token)) == 1
    assert [e.WhichOneof("event") for e in events] == ["done"]


def test_cancel_mid_socket_transfer_frees_everything_and_closes_the_socket(make_live, wide_ckpt):
    w = make_live(wide_ckpt, max_model_len=1536, max_chunk_bytes=1 << 16)  # 24 MiB of KV
    call = w.stub.Prefill(w.request(prompt(1500), request_id="big", accept_kv_socket=True),
                          timeout=30)
    events = iter(call)
    assert next(events).WhichOneof("event") == "first_token"
    offer = next(events).kv_socket
    with socket.create_connection(("127.0.0.1", offer.port), timeout=10) as conn:
        conn.sendall(kv_socket.HELLO + offer.token)
        assert conn.recv(4096)  # the transfer started; 24 MiB stalls on the unread socket
        w.wait_load(open_transfers=1)
        cancel_and_check_freed(w, call)
        with pytest.raises((ConnectionResetError, EOFError)):
            while True:  # what was in flight drains, then the connection ends
                if not conn.recv(1 << 20):
                    raise EOFError


def test_kv_socket_settings_are_checked():
    with pytest.raises(ValueError, match="kv_socket_port"):
        PrefillSettings(kv_socket_port=70000)
    with pytest.raises(ValueError, match="kv_socket_accept_seconds"):
        PrefillSettings(kv_socket_accept_seconds=0)
    with pytest.raises(ValueError, match="kv_socket_min_bytes"):
        PrefillSettings(kv_socket_min_bytes=-1)


def test_load_report_gives_the_prefix_caches_blocks(make_live, hf):
    """The router sizes its memory of a prefill worker's cache by these (router/prefix_index.py):
    the prefix cache's blocks, which a finished prompt leaves cached and free to evict; a flat
    worker reports none."""
    flat = make_live(prefix_cache_blocks=0)
    report = flat.load()
    assert (report.kv_blocks_used, report.kv_blocks_free, report.kv_block_size) == (0, 0, 0)
    w = make_live(prefix_cache_blocks=80)
    report = w.load()
    assert (report.kv_blocks_used, report.kv_blocks_free, report.kv_block_size) == (0, 80, 16)
    events = list(w.stub.Prefill(w.request(prompt(40)), timeout=20))
    assert events[-1].HasField("done")
    report = w.load()  # its 2 full blocks stay cached, free to evict
    assert (report.kv_blocks_used + report.kv_blocks_free, report.kv_block_size) == (80, 16)
    assert report.kv_blocks_used == 0
