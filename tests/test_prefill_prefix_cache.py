"""The prefill worker's prefix cache (prefill_service/prefix_cache.py): a real worker on
127.0.0.1 with a block KV cache; transformers is the reference for first tokens, KV and scores,
the hit counter says what was read instead of computed."""
import threading

import grpc
import pytest
import torch

from nxdi_common.serving.types import PrefillJob, SamplingOptions
from prefill_service.prefix_cache import pieces
from prefill_service.scheduler import PrefillTask, run_batch
from prefill_service.server import PrefillSettings, parse_args, settings_from_args
from protos.nxdi.serving.v1 import serving_pb2 as pb
from tests.test_prefill_service import (GREEDY, LiveWorker, assemble, check_greedy, prompt,
                                        reference, split)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BLOCKS = 80  # the least a 256-token model with the default batch settings takes is 68


@pytest.fixture(scope="module")
def hf(tiny_llama_ckpt):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(tiny_llama_ckpt, dtype=torch.float32).eval()


@pytest.fixture
def make_live(tiny_llama_ckpt, one_torch_thread):
    made = []

    def make(**kw):
        kw.setdefault("prefix_cache_blocks", BLOCKS)
        made.append(LiveWorker(tiny_llama_ckpt, **kw))
        return made[-1]
    yield make
    for w in made:
        w.close()


def hits(w) -> float:
    return w.app.metrics.value("nxdi_prefix_cache_hit_tokens_total")


def prefill(w, ids, request_id="req", **kw):
    return list(w.stub.Prefill(w.request(ids, request_id=request_id, **kw), timeout=20))


def test_pieces_fill_the_largest_size_and_pad_only_the_last():
    sizes = [32, 64, 128, 256, 512]
    assert pieces(16, 300, sizes) == [(16, 272), (272, 300)]  # 256 + 28 (in 32)
    assert pieces(0, 1100, sizes) == [(0, 512), (512, 1024), (1024, 1088), (1088, 1100)]
    assert pieces(96, 100, sizes) == [(96, 100)]
    assert pieces(5, 5, sizes) == []


def test_the_model_has_chunk_sub_models_and_no_mixed_ones(make_live):
    model = make_live().app.engine.model
    assert model.neuron_config.is_block_kv_layout and not model.neuron_config.mixed_steps
    assert sorted(model.chunk_models) == [32, 64, 128]  # PREFILL_PIECE_SIZES under 256
    assert model.mixed_models == {} and model.mixed_model is None
    with pytest.raises(ValueError, match="forward_mixed needs .* and mixed_steps"):
        model.forward_mixed({}, {})


def test_a_shared_prefix_is_read_not_computed_and_the_result_is_transformers(make_live, hf):
    w = make_live()
    base = prompt(150, offset=3)
    check_greedy(w, hf, base, prefill(w, base))
    assert hits(w) == 0
    other = base[:70] + prompt(50, offset=9)  # shares 4 whole blocks (64 tokens)
    check_greedy(w, hf, other, prefill(w, other))
    assert hits(w) == 64
    # the same prompt again: every whole block before its last token (144 of 150)
    check_greedy(w, hf, base, prefill(w, base))
    assert hits(w) == 64 + 144
    # only part of the KV asked for (a decode worker holding the start): tokens 100.. of 1 head
    req = w.request(base, request_id="part", kv_token_start=100, head_start=1, head_end=2)
    first, chunks, _ = split(list(w.stub.Prefill(req, timeout=20)))
    logits, k_ref, v_ref = reference(hf, base)
    assert first.token_id == int(logits.argmax())
    k, v = assemble(chunks, w.fingerprint, "part", len(base), 100, (1, 2))
    torch.testing.assert_close(k, k_ref[:, 100:, 1:2], atol=1e-4, rtol=0)
    torch.testing.assert_close(v, v_ref[:, 100:, 1:2], atol=1e-4, rtol=0)
    assert hits(w) == 64 + 2 * 144
    w.app.engine.cache.blocks.check_integrity()


def test_a_batch_of_hits_and_misses_is_all_right(make_live, hf):
    w = make_live(start_engine=False)  # the asks queue up, then run as one batch
    shared = prompt(48, offset=5)
    warm = PrefillJob("warm", tuple(shared + prompt(20, offset=1)), SamplingOptions(0.0))
    run_batch(w.app.engine.model, [PrefillTask(warm, (0, 2), None, None)],
              w.app.engine.cache)  # caches 64 of its 68 tokens
    asks = {"hit-a": shared + prompt(20, offset=1) + [9, 8, 7],  # 64 cached, 7 computed
            "hit-b": shared + prompt(30, offset=2),  # 48 cached
            "miss": prompt(90, offset=11)}  # all three in the 128-token bucket
    results, threads = {}, []
    for rid, ids in asks.items():
        call = w.stub.Prefill(w.request(ids, request_id=rid), timeout=20)
        threads.append(threading.Thread(target=lambda c=call, r=rid: results.update({r: list(c)})))
        threads[-1].start()
        w.wait_load(queued_requests=len(threads))
    before = hits(w)
    w.app.engine.start()
    for t in threads:
        t.join(20)
    firsts = {rid: check_greedy(w, hf, ids, results[rid], rid) for rid, ids in asks.items()}
    assert len({f.compute_ns for f in firsts.values()}) == 1  # one batch
    assert hits(w) - before == 64 + 48
    w.app.engine.cache.blocks.check_integrity()


def test_least_recently_used_prefixes_are_evicted_and_answers_stay_right(make_live, hf):
    w = make_live(prefix_cache_blocks=68)  # the least these settings take
    old = prompt(200, offset=1)
    prefill(w, old, "old")
    for i in range(5):  # 5 x 13 blocks of other prompts push the old one's blocks out
        prefill(w, prompt(200, offset=20 + i), f"fill{i}")
    before = hits(w)
    check_greedy(w, hf, old, prefill(w, old, "old-again"), "old-again")
    assert hits(w) - before < 192  # not all of it is still there
    recent = prompt(200, offset=24)
    before = hits(w)
    check_greedy(w, hf, recent, prefill(w, recent, "recent-again"), "recent-again")
    assert hits(w) - before == 192  # the most recent one is
    w.app.engine.cache.blocks.check_integrity()


def test_a_prompt_to_score_is_computed_whole_and_leaves_the_shared_blocks_alone(make_live, hf):
    w = make_live()
    base = prompt(100, offset=7)
    prefill(w, base, "warm")
    before = hits(w)
    sampling = pb.SamplingParams(temperature=0, prompt_logprobs=0)
    events = prefill(w, base, "scored", sampling=sampling)
    first = check_greedy(w, hf, base, events, "scored")
    assert hits(w) == before  # nothing read: every position's hidden state was needed
    with torch.no_grad():
        logits = hf(torch.tensor([base])).logits[0].float()
    ref = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(base[1:])[:, None])[:, 0]
    got = [p.logprob for p in first.prompt_logprobs]
    assert got == pytest.approx(ref.tolist(), abs=1e-4)
    # the shared blocks still hold the right KV: a hit on them is still transformers'
    other = base[:90] + prompt(10, offset=4)
    check_greedy(w, hf, other, prefill(w, other, "after"), "after")
    assert hits(w) - before == 80


def test_seeded_sampling_draws_the_same_token_with_and_without_a_hit(make_live, hf):
    w = make_live()
    base = prompt(120, offset=2)
    sampling = pb.SamplingParams(temperature=1.0, top_k=0, seed=99, logprobs=True)
    cold = prefill(w, base, "cold", sampling=sampling)[0].first_token
    warm = prefill(w, base, "warm", sampling=sampling)[0].first_token
    assert hits(w) == 112
    assert warm.token_id == cold.token_id
    assert warm.logprob == pytest.approx(cold.logprob, abs=1e-4)
    flat = LiveWorker(hf.config.name_or_path, prefix_cache_blocks=0)
    try:
        assert prefill(flat, base, "flat", sampling=sampling)[0].first_token.token_id == \
            cold.token_id
    finally:
        flat.close()


def test_fp8_kv_is_gathered_out_of_the_blocks_as_the_flat_cache_holds_it(tiny_llama_ckpt):
    from nxdi_common.serving import worker
    from prefill_service.server import PrefillApp

    def kv(blocks):
        settings = PrefillSettings(prefix_cache_blocks=blocks)
        opts = worker.ModelOptions(str(tiny_llama_ckpt), "float32", 256, "eager", None, 1,
                                   kv_cache_dtype="fp8")
        config = worker.prefill_neuron_config(opts, 4, 4, 2048, blocks)
        model = worker.load_model(opts, config)
        app = PrefillApp(model, worker.model_fingerprint(model, opts), settings)
        assert (app.engine.cache is not None) == bool(blocks)
        outs = []
        for rid in ("a", "b"):  # the second one hits the cache
            job = PrefillJob(rid, tuple(prompt(90, offset=1)), SamplingOptions(0.0))
            task = PrefillTask(job, (0, 2), None, None)
            outs.append(run_batch(model, [task], app.engine.cache)[0])
        return outs
    flat, cached = kv(0), kv(BLOCKS)
    assert cached[1].first.cached_tokens == 80
    for f, c in zip(flat, cached):
        assert c.k.dtype == torch.float8_e4m3fn and c.k.shape == f.k.shape
        assert f.first.token_id == c.first.token_id
        torch.testing.assert_close(c.k.float(), f.k.float(), atol=0.07, rtol=0.07)
        torch.testing.assert_close(c.v.float(), f.v.float(), atol=0.07, rtol=0.07)


def test_the_pool_must_hold_a_batch_and_the_flags_reach_the_settings(make_live):
    with pytest.raises(ValueError, match=r"prefix_cache_blocks 60 cannot hold a batch: at "
                                         r"least 68 blocks of 16 tokens"):
        PrefillSettings(prefix_cache_blocks=60).check_prefix_cache(256)
    PrefillSettings(prefix_cache_blocks=0).check_prefix_cache(256)  # off: nothing to hold
    with pytest.raises(ValueError, match="prefix_cache_blocks must be >= 0"):
        PrefillSettings(prefix_cache_blocks=-1)
    args = parse_args(["--prefix-cache-blocks", "300", "--block-size", "32"])
    settings = settings_from_args(args)
    assert (settings.prefix_cache_blocks, settings.block_size) == (300, 32)
    assert settings_from_args(parse_args([])).prefix_cache_blocks == 1024  # on by default


def test_the_load_report_counts_only_the_tokens_to_compute(make_live):
    """Queued and running prompt tokens in GetLoad leave out the leading blocks the cache holds
    (the router's ETA divides them by the rate of computed tokens); a prompt to score counts
    whole, as it runs. (The cache is seeded by hand, its blocks sealed without KV: the requests
    are cancelled before the engine starts.)"""
    w = make_live(start_engine=False)
    cache = w.app.engine.cache
    held = prompt(48, offset=100)
    cache.release(cache.admit("seed", held, whole=False), computed=True)  # 3 blocks sealed
    scoring = pb.SamplingParams(temperature=0, prompt_logprobs=0)
    calls = [w.stub.Prefill(w.request(held + prompt(10), request_id="hit"), timeout=20),
             w.stub.Prefill(w.request(prompt(20, offset=50), request_id="miss"), timeout=20),
             w.stub.Prefill(w.request(held + prompt(10), request_id="scored", sampling=scoring),
                            timeout=20)]
    report = w.wait_load(queued_requests=3)
    assert report.queued_prompt_tokens == 10 + 20 + 58
    for call in calls:
        call.cancel()
    assert w.wait_load(queued_requests=0).queued_prompt_tokens == 0
