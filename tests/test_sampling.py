"""Tests for nxdi_common.modules.sampling: exact greedy checks, RNG reproducibility, tracing,
and chi-square checks of the sampled distributions (fixed seeds, so results are repeatable)."""

import math
from types import SimpleNamespace

import pytest
import torch

from nxdi_common.modules.sampling import (
    Sampler,
    SamplingRandomSource,
    prepare_sampling_params,
    sample_from_logits,
    sampling_params_from_config,
)

NUM_SAMPLES = 20000

# Chi-square critical values at p = 0.001, by degrees of freedom.
CHI2_CRITICAL_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}

# V = 8 vocabulary with known probabilities; rank r (0 = most likely) lives at id RANK_TO_ID[r],
# so the sampler must map candidates back through the top-k indices correctly.
BASE_PROBS = [0.40, 0.25, 0.15, 0.08, 0.05, 0.04, 0.02, 0.01]
RANK_TO_ID = [5, 2, 7, 0, 3, 6, 1, 4]


def _config(**overrides):
    """An OnDeviceSamplingConfig stand-in with NxDI's defaults."""
    fields = dict(do_sample=False, top_k=1, top_p=1.0, temperature=1.0, dynamic=False,
                  deterministic=False, global_topk=256)
    fields.update(overrides)
    return SimpleNamespace(**fields)


def _known_logits() -> torch.Tensor:
    """[8] float32 logits whose softmax is BASE_PROBS placed at RANK_TO_ID."""
    logits = torch.empty(len(BASE_PROBS))
    for rank, token_id in enumerate(RANK_TO_ID):
        logits[token_id] = math.log(BASE_PROBS[rank])
    return logits


def _reference_probs(logits, top_k, top_p, temperature, global_topk=256) -> dict:
    """Independent pure-Python model of the expected distribution: {token_id: probability}."""
    ranked = sorted(enumerate(logits.tolist()), key=lambda item: -item[1])[:global_topk]
    if 0 < top_k < len(ranked):
        ranked = ranked[:top_k]
    weights = [math.exp(value / temperature) for _, value in ranked]
    probs = [w / sum(weights) for w in weights]
    kept, mass = 0, 0.0
    while kept < len(probs) and (kept == 0 or mass < top_p):
        mass += probs[kept]
        kept += 1
    return {ranked[i][0]: probs[i] / mass for i in range(kept)}


def _counts(tokens: torch.Tensor, vocab_size: int) -> list:
    return torch.bincount(tokens, minlength=vocab_size).tolist()


def _assert_follows(counts: list, expected: dict) -> None:
    """Support equals the expected ids exactly and the chi-square statistic is below p=0.001."""
    total = sum(counts)
    observed_ids = {i for i, c in enumerate(counts) if c > 0}
    assert observed_ids == set(expected), (observed_ids, set(expected))
    if len(expected) == 1:
        return
    chi2 = sum((counts[i] - total * p) ** 2 / (total * p) for i, p in expected.items())
    assert chi2 < CHI2_CRITICAL_P001[len(expected) - 1], (chi2, counts, expected)


def _sample_counts(top_k, top_p, temperature, seed=1234, global_topk=256) -> list:
    """Counts over the V=8 vocab of NUM_SAMPLES draws from one batch of identical rows."""
    logits = _known_logits().expand(NUM_SAMPLES, -1)  # [N, 8]
    params = prepare_sampling_params(NUM_SAMPLES, top_k, top_p, temperature)  # [N, 3]
    rand = SamplingRandomSource(seed=seed).draw(NUM_SAMPLES)  # [N]
    tokens = sample_from_logits(logits, params, rand, global_topk=global_topk)
    return _counts(tokens, len(BASE_PROBS))


# ----------------------------------------------------------------------------- greedy (exact)


def test_greedy_config_returns_argmax():
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(_config())
    assert torch.equal(sampler(logits), logits.argmax(dim=-1))
    # sampling_params / rand are ignored entirely.
    params = prepare_sampling_params(16, top_k=50, temperature=2.0)
    assert torch.equal(sampler(logits, params, torch.rand(16)), logits.argmax(dim=-1))


def test_temperature_zero_is_argmax():
    logits = torch.randn(32, 1000, generator=torch.Generator().manual_seed(1))
    params = prepare_sampling_params(32, top_k=[0, 5, 50, 300] * 8, top_p=0.9, temperature=0.0)
    rand = SamplingRandomSource(seed=2).draw(32)
    tokens = Sampler(_config(dynamic=True))(logits, params, rand)
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_top_k_one_is_argmax():
    logits = torch.randn(32, 1000, generator=torch.Generator().manual_seed(3))
    params = prepare_sampling_params(32, top_k=1, top_p=[0.3, 1.0] * 16,
                                     temperature=[0.5, 5.0] * 16)
    rand = SamplingRandomSource(seed=4).draw(32)
    tokens = Sampler(_config(dynamic=True))(logits, params, rand)
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_greedy_rows_break_ties_like_argmax():
    # bf16 logits tie often; greedy rows come from the top-K candidates and must still pick
    # argmax's first index among the tied maxima, in eager and traced graphs.
    logits = torch.zeros(6, 3000)
    for row, ids in enumerate([[7], [2999, 5], [40, 41, 39], [1000, 3, 2000], [0, 2999], [17]]):
        logits[row, ids] = 2.0
    logits[5] = 1.0  # every logit tied: more maxima than the K candidates
    params = prepare_sampling_params(6, top_k=1, temperature=0.0)
    rand = torch.rand(6)
    sampler = Sampler(_config(dynamic=True))
    tokens = sampler(logits, params, rand)
    assert tokens[:5].tolist() == [7, 5, 39, 3, 0] == logits[:5].argmax(dim=-1).tolist()
    # Past K tied maxima the row still gets one of its maxima (which one is not argmax's rule).
    assert 0 <= int(tokens[5]) < 3000 and logits[5, tokens[5]] == logits[5].max()
    logits = logits[:5]
    params, rand = params[:5], rand[:5]
    traced = torch.jit.trace(sampler, (logits, params, rand))
    shuffled = logits[:, torch.randperm(3000, generator=torch.Generator().manual_seed(5))]
    assert torch.equal(traced(shuffled, params, rand), shuffled.argmax(dim=-1))


def test_greedy_and_sampled_rows_mix_in_one_batch():
    logits = _known_logits().expand(4, -1)
    params = prepare_sampling_params(4, top_k=[1, 0, 0, 0], temperature=[1.0, 0.0, 1.0, 1.0])
    rand = torch.tensor([0.999, 0.999, 0.0, 0.999])
    tokens = sample_from_logits(logits, params, rand)
    # Greedy rows give rank 0; rand 0 gives rank 0; rand ~1 gives the last candidate (rank 7).
    assert tokens.tolist() == [RANK_TO_ID[0], RANK_TO_ID[0], RANK_TO_ID[0], RANK_TO_ID[7]]


def test_inverse_cdf_boundaries_are_exact():
    logits = _known_logits().expand(5, -1)
    params = prepare_sampling_params(5, top_k=0, top_p=1.0, temperature=1.0)
    # Cumulative probabilities are 0.40, 0.65, 0.80, ...; pick just below/above each boundary.
    rand = torch.tensor([0.39, 0.41, 0.64, 0.66, 0.79])
    tokens = sample_from_logits(logits, params, rand)
    assert tokens.tolist() == [RANK_TO_ID[r] for r in (0, 1, 1, 2, 2)]


# ----------------------------------------------------------------------------- random source


def test_fixed_seed_reproduces_draws_and_seeds_differ():
    first = SamplingRandomSource(seed=7)
    second = SamplingRandomSource(seed=7)
    draws = [first.draw(4) for _ in range(3)]
    assert all(torch.equal(a, second.draw(4)) for a in draws)
    assert not torch.equal(SamplingRandomSource(seed=8).draw(4), draws[0])
    assert draws[0].dtype == torch.float32 and draws[0].shape == (4,)
    assert bool(((draws[0] >= 0) & (draws[0] < 1)).all())


def test_deterministic_reset_ignores_global_rng():
    source = SamplingRandomSource(deterministic=True)
    assert source.initial_seed == 0
    torch.manual_seed(123)
    first = source.draw(6)
    torch.manual_seed(456)
    torch.rand(10)
    source.reset()
    assert torch.equal(source.draw(6), first)
    assert torch.equal(SamplingRandomSource.from_config(_config(deterministic=True)).draw(6), first)


def test_nondeterministic_source_seeding():
    torch.manual_seed(99)
    assert SamplingRandomSource().initial_seed == 99
    source = SamplingRandomSource(seed=5)
    first = source.draw(3)
    source.reset()  # a no-op when not deterministic: the stream keeps going
    assert not torch.equal(source.draw(3), first)
    source.seed(5)
    assert torch.equal(source.draw(3), first)


def test_same_inputs_same_tokens_when_deterministic():
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(5))
    params = prepare_sampling_params(8, top_k=40, top_p=0.9, temperature=1.3)
    sampler = Sampler(_config(do_sample=True, dynamic=True, deterministic=True))
    source = SamplingRandomSource.from_config(_config(deterministic=True))
    first = sampler(logits, params, source.draw(8))
    source.reset()
    assert torch.equal(sampler(logits, params, source.draw(8)), first)


# ----------------------------------------------------------------------------- statistical


def test_top_k_three_matches_renormalized_softmax():
    counts = _sample_counts(top_k=3, top_p=1.0, temperature=1.0)
    assert {i for i, c in enumerate(counts) if c} == set(RANK_TO_ID[:3])
    _assert_follows(counts, _reference_probs(_known_logits(), 3, 1.0, 1.0))


def test_top_p_keeps_exact_nucleus():
    counts = _sample_counts(top_k=0, top_p=0.6, temperature=1.0)
    # Cumulative 0.40 < 0.6 <= 0.65: the nucleus is exactly the two best ids, 0.4/0.65 vs 0.25/0.65.
    assert {i for i, c in enumerate(counts) if c} == set(RANK_TO_ID[:2])
    _assert_follows(counts, {RANK_TO_ID[0]: 0.40 / 0.65, RANK_TO_ID[1]: 0.25 / 0.65})


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_scales_distribution(temperature):
    counts = _sample_counts(top_k=-1, top_p=1.0, temperature=temperature)
    _assert_follows(counts, _reference_probs(_known_logits(), 0, 1.0, temperature))


@pytest.mark.parametrize("top_k,top_p,temperature", [(5, 0.8, 1.0), (0, 0.9, 0.5), (4, 1.0, 2.0),
                                                     (6, 0.95, 1.5)])
def test_combined_parameters(top_k, top_p, temperature):
    counts = _sample_counts(top_k, top_p, temperature, seed=top_k * 100 + 7)
    _assert_follows(counts, _reference_probs(_known_logits(), top_k, top_p, temperature))


def test_dynamic_rows_follow_their_own_distribution():
    settings = [(3, 1.0, 1.0), (0, 0.6, 1.0), (0, 1.0, 2.0), (1, 1.0, 1.0)]
    batch = NUM_SAMPLES * len(settings)
    top_k, top_p, temperature = (list(column) * NUM_SAMPLES for column in zip(*settings))
    params = prepare_sampling_params(batch, top_k, top_p, temperature)  # rows interleave settings
    rand = SamplingRandomSource(seed=11).draw(batch)
    logits = _known_logits().expand(batch, -1)
    tokens = Sampler(_config(dynamic=True))(logits, params, rand)
    for offset, setting in enumerate(settings):
        counts = _counts(tokens[offset::len(settings)], len(BASE_PROBS))
        _assert_follows(counts, _reference_probs(_known_logits(), *setting))


def test_static_do_sample_config_uses_config_params():
    config = _config(do_sample=True, top_k=3, top_p=1.0, temperature=1.0)
    logits = _known_logits().expand(NUM_SAMPLES, -1)
    rand = SamplingRandomSource(seed=12).draw(NUM_SAMPLES)
    greedy_params = prepare_sampling_params(NUM_SAMPLES, top_k=1)  # ignored: not dynamic
    tokens = Sampler(config)(logits, greedy_params, rand)
    _assert_follows(_counts(tokens, 8), _reference_probs(_known_logits(), 3, 1.0, 1.0))
    assert sampling_params_from_config(config, 2).tolist() == [[3.0, 1.0, 1.0]] * 2


def test_global_topk_limits_candidates():
    counts = _sample_counts(top_k=0, top_p=1.0, temperature=1.0, global_topk=4)
    _assert_follows(counts, _reference_probs(_known_logits(), 0, 1.0, 1.0, global_topk=4))


# ----------------------------------------------------------------------------- tracing & dtypes


def test_traced_matches_eager_on_new_values():
    sampler = Sampler(_config(dynamic=True, global_topk=64))
    gen = torch.Generator().manual_seed(21)
    example = (torch.randn(8, 500, generator=gen), prepare_sampling_params(8, top_k=10),
               torch.rand(8, generator=gen))
    traced = torch.jit.trace(sampler, example)
    for trial in range(5):
        logits = torch.randn(8, 500, generator=gen)
        params = prepare_sampling_params(8, top_k=[0, 1, 2, 5, 20, 64, 100, -1],
                                         top_p=[1.0, 0.5, 0.9, 0.3, 0.95, 1.0, 0.7, 0.8],
                                         temperature=[1.0, 0.0, 0.7, 1.5, 1.0, 3.0, 0.2, 1.0])
        params = params[torch.randperm(8, generator=gen)]  # shuffle settings across rows
        rand = torch.rand(8, generator=gen)
        assert torch.equal(traced(logits, params, rand), sampler(logits, params, rand)), trial


def test_traced_greedy_and_static_configs():
    logits, params, rand = torch.randn(4, 50), prepare_sampling_params(4), torch.rand(4)
    for config in (_config(), _config(do_sample=True, top_k=5, temperature=0.8)):
        sampler = Sampler(config)
        traced = torch.jit.trace(sampler, (logits, params, rand))
        new_logits, new_rand = torch.randn(4, 50), torch.rand(4)
        expected = sampler(new_logits, params, new_rand)
        assert torch.equal(traced(new_logits, params, new_rand), expected)


def test_bfloat16_logits():
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(31)).to(torch.bfloat16)
    assert torch.equal(Sampler(_config())(logits), logits.float().argmax(dim=-1))
    params = prepare_sampling_params(8, top_k=5, top_p=1.0, temperature=1.0)
    tokens = Sampler(_config(dynamic=True))(logits, params, SamplingRandomSource(seed=3).draw(8))
    assert tokens.dtype == torch.int64
    top5 = torch.topk(logits.float(), 5).indices
    assert bool((top5 == tokens.unsqueeze(-1)).any(dim=-1).all())


def test_vocab_smaller_than_global_topk():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0, 0.5]]).expand(3, -1)
    params = prepare_sampling_params(3, top_k=[0, 300, 2], top_p=1.0, temperature=1.0)
    rand = torch.tensor([0.9999, 0.9999, 0.9999])
    tokens = Sampler(_config(dynamic=True, global_topk=256))(logits, params, rand)
    assert tokens.tolist() == [3, 3, 2]  # last of all 5 candidates; last of the top 2


# ----------------------------------------------------------------------------- params validation


def test_prepare_sampling_params_values():
    params = prepare_sampling_params(2, top_k=[50, 5], top_p=[0.5, 1.0], temperature=[0.75, 1.0])
    assert params.dtype == torch.float32
    assert params.tolist() == [[50.0, 0.5, 0.75], [5.0, 1.0, 1.0]]
    assert prepare_sampling_params(3).tolist() == [[1.0, 1.0, 1.0]] * 3


@pytest.mark.parametrize("kwargs,match", [
    (dict(top_k=-2), r"top_k must be an integer >= -1"),
    (dict(top_k=2.5), r"top_k must be an integer >= -1"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(temperature=-0.1), r"temperature must be a finite number >= 0"),
    (dict(temperature=[1.0, 1.0, 1.0]), r"temperature has 3 values"),
])
def test_prepare_sampling_params_rejects_invalid(kwargs, match):
    with pytest.raises(ValueError, match=match):
        prepare_sampling_params(2, **kwargs)
