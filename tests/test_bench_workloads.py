"""The load generator's arrivals and lengths follow the requested distributions (fixed seeds), and
its prompts have exactly the drawn number of tokens."""
import numpy as np
import pytest
from scipy import stats

from nxdi_bench.arrivals import arrival_times
from nxdi_bench.workloads import (WORKLOADS, PromptBuilder, RequestClass, Workload, draw_lengths,
                                  draw_requests, get_workload)


def test_poisson_arrivals_have_exponential_gaps_at_the_rate():
    t = arrival_times(4000, rate=2.5, seed=7)
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps > 0)
    assert gaps.mean() == pytest.approx(1 / 2.5, rel=0.05)
    assert stats.kstest(gaps, "expon", args=(0, 1 / 2.5)).pvalue > 0.01
    # The test has power: the same gaps are far from a 4x slower process.
    assert stats.kstest(gaps, "expon", args=(0, 1 / 0.625)).pvalue < 1e-6


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_arrivals_keep_the_rate_and_set_the_burstiness(burstiness):
    rate = 3.0
    gaps = np.diff(arrival_times(4000, rate, seed=3, kind="gamma", burstiness=burstiness))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.07)
    cv = gaps.std() / gaps.mean()
    assert cv == pytest.approx(1 / np.sqrt(burstiness), rel=0.1)
    shape, scale = burstiness, 1 / (rate * burstiness)
    assert stats.kstest(gaps, "gamma", args=(shape, 0, scale)).pvalue > 0.01
    assert stats.kstest(gaps, "expon", args=(0, 1 / rate)).pvalue < 1e-6


def test_arrivals_are_reproducible_from_the_seed():
    assert np.array_equal(arrival_times(50, 1.0, seed=5), arrival_times(50, 1.0, seed=5))
    assert not np.array_equal(arrival_times(50, 1.0, seed=5), arrival_times(50, 1.0, seed=6))


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0, rate=1.0, seed=0), "num_requests"), (dict(n=5, rate=0.0, seed=0), "rate"),
    (dict(n=5, rate=1.0, seed=0, kind="uniform"), "kind"),
    (dict(n=5, rate=1.0, seed=0, kind="gamma", burstiness=0), "burstiness")])
def test_bad_arrival_arguments_are_refused_by_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        arrival_times(**kwargs)


def test_mixed_workload_class_shares_and_uniform_lengths():
    mixed = get_workload("mixed")
    drawn = draw_lengths(mixed, 5000, seed=11)
    kinds = [k for k, _, _ in drawn]
    n_long = kinds.count("long")
    # 20% long: a two-sided binomial test at the stated share.
    assert stats.binomtest(n_long, len(kinds), 0.2).pvalue > 0.01
    for cls in mixed.classes:
        prompts = np.array([p for k, p, _ in drawn if k == cls.name])
        outputs = np.array([o for k, _, o in drawn if k == cls.name])
        for values, (lo, hi) in ((prompts, cls.prompt_tokens), (outputs, cls.output_tokens)):
            assert values.min() >= lo and values.max() <= hi
            # Discrete uniform over [lo, hi]: chi-square over 8 bins of consecutive integers.
            span = hi - lo + 1
            observed = np.bincount((values - lo) * 8 // span, minlength=8)
            per_bin = np.bincount((np.arange(span) * 8) // span, minlength=8)
            expected = len(values) * per_bin / span
            assert stats.chisquare(observed, expected).pvalue > 0.01


def test_named_workloads_have_the_promised_shapes():
    chat, long_ = WORKLOADS["chat"].classes[0], WORKLOADS["long-context"].classes[0]
    assert chat.prompt_tokens[1] < long_.prompt_tokens[0]           # chat prompts are short
    assert chat.output_tokens[1] > long_.output_tokens[1]           # and outputs longer
    assert {c.name for c in WORKLOADS["mixed"].classes} == {"chat", "long"}
    assert WORKLOADS["mixed"].probabilities.tolist() == pytest.approx([0.8, 0.2])
    for w in WORKLOADS.values():
        assert w.max_total_tokens <= 2048
    with pytest.raises(ValueError, match="workload"):
        get_workload("nope")


def test_fit_scales_a_workload_down_to_the_context():
    w = get_workload("long-context").fit(512)
    assert w.max_total_tokens <= 512
    assert get_workload("chat").fit(4096) == get_workload("chat")   # never scaled up
    with pytest.raises(ValueError, match="prompt_tokens"):
        RequestClass("x", 1.0, prompt_tokens=(10, 5), output_tokens=(1, 2))


@pytest.fixture(scope="module")
def builder(bundled_model_path):
    from transformers import AutoTokenizer
    return PromptBuilder(AutoTokenizer.from_pretrained(bundled_model_path))


def test_prompts_have_exactly_the_drawn_token_count(builder):
    w = Workload("t", (RequestClass("a", 1.0, (1, 300), (1, 4)),))
    requests = draw_requests(w, 40, builder, seed=2)
    for r in requests:
        assert len(builder.tokenizer(r.prompt)["input_ids"]) == r.prompt_tokens
    lengths = [(r.kind, r.prompt_tokens, r.output_tokens) for r in requests]
    assert lengths == draw_lengths(w, 40, seed=2)


def test_requests_are_reproducible_and_seeds_differ(builder):
    w = get_workload("chat")
    a, b = draw_requests(w, 5, builder, 1), draw_requests(w, 5, builder, 1)
    c = draw_requests(w, 5, builder, 2)
    assert a == b
    assert [r.prompt for r in a] != [r.prompt for r in c]
    # Prompts share no long prefix (no accidental prefix-cache hits between requests).
    first_words = {r.prompt.split()[0] + r.prompt.split()[1] for r in a}
    assert len(first_words) == len(a)


def test_shared_prefix_prompts_open_with_one_of_the_prefixes_token_for_token(builder):
    """Each prompt is one of the class's shared prefixes (its tokens exactly, so a prefix
    cache can hold them) and then its own drawn tokens; the prefixes are picked uniformly and
    a seed names the same requests."""
    w = Workload("t", (RequestClass("s", 1.0, (5, 40), (1, 4), shared_prefixes=3,
                                    prefix_tokens=48),))
    requests = draw_requests(w, 60, builder, seed=4)
    assert requests == draw_requests(w, 60, builder, seed=4)
    assert [(r.kind, r.prompt_tokens, r.output_tokens) for r in requests] == \
        draw_lengths(w, 60, seed=4)
    encode = builder.tokenizer.encode
    heads = {}
    for r in requests:
        ids = encode(r.prompt, add_special_tokens=False)
        assert len(ids) == r.prompt_tokens and 53 <= r.prompt_tokens <= 88
        heads.setdefault(r.prefix, set()).add(tuple(ids[:48]))
    assert sorted(heads) == [0, 1, 2] and all(len(h) == 1 for h in heads.values())
    assert len({next(iter(h)) for h in heads.values()}) == 3  # three different prefixes
    counts = np.bincount([r.prefix for r in requests], minlength=3)
    assert stats.chisquare(counts).pvalue > 0.01
    tails = {r.prompt[len(r.prompt) // 2:] for r in requests}
    assert len(tails) == 60  # the rest is each request's own


def test_shared_prefix_workload_fits_and_scales_its_prefix():
    w = get_workload("shared-prefix")
    (cls,) = w.classes
    assert cls.shared_prefixes == 4 and cls.prefix_tokens == 1024
    assert w.max_total_tokens == 1024 + 256 + 192
    small = w.fit(512).classes[0]
    assert small.prefix_tokens < 1024 and small.max_total_tokens <= 512
    with pytest.raises(ValueError, match="shared_prefixes and prefix_tokens"):
        RequestClass("x", 1.0, (1, 2), (1, 2), shared_prefixes=2)
