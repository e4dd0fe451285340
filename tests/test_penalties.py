"""OpenAI's presence and frequency penalties (nxdi_common/serving/sampling.py module doc): the
arithmetic on a row of logits, the range check naming the field, the proto round trip, and a
decode engine (tiny model, driven here turn by turn) whose penalized greedy tokens are those of
transformers' logits with the penalties applied by hand, and whose seeded sampled tokens replay."""
import pytest
import torch

import hf_reference
from decode_service import main
from nxdi_common.serving import convert
from nxdi_common.serving.errors import InvalidRequest
from nxdi_common.serving.sampling import penalized_logits, sample_row
from nxdi_common.serving.types import DecodeJob, SamplingOptions, StopOptions

PROMPT = [1, 504, 3458, 282, 4649, 314]


def test_penalties_lower_each_generated_token_by_count_and_once():
    logits = torch.zeros(8)
    s = SamplingOptions(presence_penalty=0.5, frequency_penalty=1.0)
    out = penalized_logits(logits, [3, 3, 5], s)
    assert out.tolist() == [0, 0, 0, -2.5, 0, -1.5, 0, 0]
    assert logits.tolist() == [0] * 8  # a new tensor
    favour = penalized_logits(logits, [2], SamplingOptions(presence_penalty=-1))
    assert favour[2] == 1 and favour.sum() == 1
    assert torch.equal(penalized_logits(logits, [], s), logits)


def test_sample_row_is_the_device_sampler_on_the_host():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    assert sample_row(logits, SamplingOptions(temperature=0), 0.7, 256) == 1
    # temperature 1, top_k 2: tokens 1 and 3 nearly even; the uniform picks one, the same twice
    s = SamplingOptions(temperature=1.0, top_k=2)
    low, high = sample_row(logits, s, 0.01, 256), sample_row(logits, s, 0.99, 256)
    assert {low, high} == {1, 3} and sample_row(logits, s, 0.99, 256) == high


def test_sample_row_picks_what_the_batched_sampler_picks():
    """sample_row's one-row ops against modules/sampling.sample_from_logits: the same token for
    random logits, masked ones (-inf, as a constraint leaves them) included."""
    from nxdi_common.modules.sampling import sample_from_logits
    g = torch.Generator().manual_seed(0)
    configs = [SamplingOptions(temperature=0.7, top_p=0.9), SamplingOptions(temperature=1.3,
               top_k=40), SamplingOptions(temperature=1.0), SamplingOptions(temperature=0.5,
               top_k=5, top_p=0.5), SamplingOptions(temperature=0.0)]
    for trial in range(60):
        logits = torch.randn(4096, generator=g) * 3
        if trial % 3:  # most tokens masked; with trial % 3 == 2 fewer than 256 remain
            drop = torch.rand(4096, generator=g) < (0.9 if trial % 3 == 1 else 0.99)
            logits[drop] = float("-inf")
        for s in configs:
            u = float(torch.rand(1, generator=g))
            want = sample_from_logits(logits[None], torch.tensor([s.as_row()]),
                                      torch.tensor([u]), 256)
            assert sample_row(logits, s, u, 256) == int(want[0]), (trial, s)


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -2.01),
                                         ("presence_penalty", float("nan"))])
def test_penalties_outside_the_range_are_refused_by_name(field, value):
    with pytest.raises(InvalidRequest) as info:
        SamplingOptions(**{field: value}).validate()
    assert info.value.field == field and "[-2, 2]" in str(info.value)


def test_penalties_cross_the_wire():
    s = SamplingOptions(temperature=0.5, presence_penalty=0.25, frequency_penalty=-1.5)
    assert convert.sampling_from_proto(convert.sampling_to_proto(s)) == s


@pytest.fixture(scope="module")
def engine(tiny_chat_model):
    args = main.parse_args(["--model", str(tiny_chat_model), "--dtype", "float32", "--backend",
                            "eager", "--threads", "1", "--max-model-len", "256", "--kv-blocks",
                            "32", "--block-size", "16", "--max-batch-size", "4"])
    return main.build(args)[1]


def generate(engine, rid, sampling, n):
    out = []
    seq = engine.admit(DecodeJob(rid, tuple(PROMPT), sampling, StopOptions(n, ignore_eos=True)),
                       n, out.append)
    engine.submit_local_prefill(seq)
    for _ in range(500):
        if seq.finished:
            return [o.token_id for o in out]
        engine._iterate()
    raise AssertionError("the sequence did not finish")


def test_penalized_greedy_tokens_are_transformers_logits_penalized_by_hand(engine,
                                                                           tiny_chat_model):
    model = hf_reference.load(tiny_chat_model)
    sampling = SamplingOptions(temperature=0.0, presence_penalty=0.5, frequency_penalty=1.5)
    ids, generated = list(PROMPT), []
    with torch.no_grad():
        for _ in range(24):
            logits = model(torch.tensor([ids])).logits[0, -1]
            token = int(penalized_logits(logits, generated, sampling).argmax())
            generated.append(token)
            ids.append(token)
    assert generate(engine, "pen", sampling, 24) == generated
    plain = generate(engine, "plain", SamplingOptions(temperature=0.0), 24)
    assert plain != generated  # the penalties changed the tokens (the test is not vacuous)
    assert len(set(generated)) > len(set(plain))


def test_seeded_penalized_sampling_replays(engine):
    sampling = SamplingOptions(temperature=1.0, top_p=0.9, seed=7, frequency_penalty=2.0)
    first = generate(engine, "a", sampling, 16)
    assert generate(engine, "b", sampling, 16) == first
    assert engine.blocks.num_used_blocks == 0



# --- repetition penalty and min_p (vLLM's / Hugging Face's) ------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -4.0])
    s = SamplingOptions(repetition_penalty=2.0)
    # prompt token 0, generated token 1 twice (counted once), token 4 in both
    out = penalized_logits(logits, [1, 1, 4], s, prompt=(0, 4))
    assert out.tolist() == [1.0, -2.0, 0.5, 3.0, -8.0]
    # with OpenAI's penalties too: repetition first, then the generated tokens lowered
    both = penalized_logits(logits, [1], SamplingOptions(repetition_penalty=2.0,
                                                         presence_penalty=1.0), prompt=(0,))
    assert both.tolist() == [1.0, -3.0, 0.5, 3.0, -4.0]


def test_repetition_penalty_is_transformers_processor():
    from transformers import RepetitionPenaltyLogitsProcessor
    g = torch.Generator().manual_seed(1)
    logits, seen = torch.randn(1, 500, generator=g), torch.randint(0, 500, (1, 40), generator=g)
    want = RepetitionPenaltyLogitsProcessor(1.3)(seen, logits.clone())[0]
    got = penalized_logits(logits[0], seen[0, 30:].tolist(), SamplingOptions(
        repetition_penalty=1.3), prompt=tuple(seen[0, :30].tolist()))
    torch.testing.assert_close(got, want)


def test_min_p_drops_candidates_below_its_share_of_the_most_likely():
    """Over many uniforms, min_p=0.2 at temperature 1 samples only tokens with probability >=
    0.2 x the top one's, each in proportion to its probability among them."""
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.09, 0.06]))
    s = SamplingOptions(temperature=1.0, min_p=0.2)
    counts = torch.zeros(5)
    for u in torch.linspace(0.0005, 0.9995, 2000).tolist():
        counts[sample_row(logits, s, u, 256)] += 1
    assert counts[3] == 0 and counts[4] == 0  # 0.09 and 0.06 < 0.2 x 0.5
    kept = torch.tensor([0.5, 0.2, 0.15])
    torch.testing.assert_close(counts[:3] / 2000, kept / kept.sum(), atol=2e-3, rtol=0)
    # min_p 0 and greedy are untouched; min_p 1 keeps only the top token
    assert sample_row(logits, SamplingOptions(temperature=1.0, min_p=1.0), 0.99, 256) == 0
    plain = SamplingOptions(temperature=1.0)
    assert {sample_row(logits, plain, 0.999, 256)} == {4}


@pytest.mark.parametrize("field,value,message", [
    ("repetition_penalty", 0.0, "(0, 10]"), ("repetition_penalty", 10.5, "(0, 10]"),
    ("repetition_penalty", float("inf"), "(0, 10]"), ("min_p", -0.1, "[0, 1]"),
    ("min_p", 1.5, "[0, 1]"), ("min_p", float("nan"), "[0, 1]")])
def test_repetition_penalty_and_min_p_outside_their_range_are_refused(field, value, message):
    with pytest.raises(InvalidRequest) as info:
        SamplingOptions(**{field: value}).validate()
    assert info.value.field == field and message in str(info.value)


def test_repetition_penalty_and_min_p_cross_the_wire():
    s = SamplingOptions(temperature=0.5, repetition_penalty=1.25, min_p=0.125)
    assert convert.sampling_from_proto(convert.sampling_to_proto(s)) == s
    plain = SamplingOptions()
    msg = convert.sampling_to_proto(plain)
    assert not msg.HasField("repetition_penalty") and msg.min_p == 0
    assert convert.sampling_from_proto(msg) == plain


def test_repetition_penalty_greedy_tokens_are_transformers_generate(engine, tiny_chat_model):
    """The decode engine's greedy tokens with a repetition penalty (local prefill: the first
    token too) are transformers' generate() with its repetition_penalty."""
    model = hf_reference.load(tiny_chat_model)
    with torch.no_grad():
        want = model.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False,
                              repetition_penalty=1.5, min_new_tokens=24,
                              pad_token_id=2)[0, len(PROMPT):].tolist()
    got = generate(engine, "rep", SamplingOptions(temperature=0.0, repetition_penalty=1.5), 24)
    assert got == want
    assert generate(engine, "plain-rep", SamplingOptions(temperature=0.0), 24) != want


# --- min_tokens ----------------------------------------------------------------------------------


def test_min_tokens_range_wire_and_stop_strings_held_off():
    from nxdi_common.serving.detokenize import StopStringMatcher
    for stop, message in ((StopOptions(min_tokens=-1), "must be an integer >= 0"),
                          (StopOptions(max_tokens=4, min_tokens=5), "at most max_tokens (4)")):
        with pytest.raises(InvalidRequest) as info:
            stop.validate()
        assert info.value.field == "min_tokens" and message in str(info.value)
    s = StopOptions(max_tokens=9, min_tokens=3, stop_token_ids=(7,))
    assert convert.stop_from_proto(convert.stop_to_proto(s)) == s
    m = StopStringMatcher(["END"])
    assert m.feed("xEN", active=False) == "xEN" and m.feed("D", active=False) == "D"
    assert m.matched is None and m.feed("a EN") == "a " and m.feed("D!") == "" and m.matched


def test_min_tokens_hold_off_eos_then_let_it_stop(engine):
    """logit_bias +100 on EOS makes every token EOS; min_tokens 5 bans it (and the stop token)
    for the first 5, so the 6th ends the sequence."""
    def run(rid, min_tokens, stop_ids=()):
        out = []
        job = DecodeJob(rid, tuple(PROMPT), SamplingOptions(temperature=0.0,
                                                            logit_bias=((2, 100.0),)),
                        StopOptions(20, stop_token_ids=stop_ids, min_tokens=min_tokens))
        seq = engine.admit(job, 20, out.append)
        engine.submit_local_prefill(seq)
        while not seq.finished:
            engine._iterate()
        return [o.token_id for o in out], out[-1].finish_reason

    assert run("m0", 0) == ([2], "eos_token")
    tokens, reason = run("m5", 5)
    assert len(tokens) == 6 and 2 not in tokens[:5] and (tokens[5], reason) == (2, "eos_token")
    # a stop token is held off too: ban the plain greedy 2nd token's and it never comes early
    plain = run("m5b", 5)[0]
    tokens, _ = run("m5s", 5, stop_ids=(plain[1],))
    assert plain[1] not in tokens[:5] and len(tokens) == 6
