"""Bucket lists and bucket selection (feature guide: Bucketing, Bucketing with Prefix Caching)."""

from types import SimpleNamespace

import pytest

from nxdi_common.bucketing import (
    PrefixBucketChoice,
    context_encoding_buckets,
    decode_batch_buckets,
    generate_buckets,
    mixed_batch_buckets,
    pad_batch_to_bucket,
    pad_to_bucket,
    prefix_caching_bucket_grid,
    prefix_caching_buckets,
    prefill_buckets,
    quartered_buckets,
    select_bucket,
    select_prefix_caching_bucket,
    token_generation_batch_buckets,
    token_generation_buckets,
)


def config(**overrides):
    """A NeuronConfig stand-in holding only the attributes bucketing reads."""
    values = dict(enable_bucketing=True, seq_len=2048, max_context_length=None,
                  context_encoding_buckets=None, token_generation_buckets=None,
                  prefix_buckets=None, tkg_batch_size=None, max_batch_size=1,
                  token_generation_batch_buckets=None, is_prefix_caching=False)
    values.update(overrides)
    return SimpleNamespace(**values)


# ---- generate_buckets / automatic buckets -------------------------------------------------

@pytest.mark.parametrize("max_length, expected", [
    (128, [128]),
    (1000, [128, 256, 512, 1000]),
    (2048, [128, 256, 512, 1024, 2048]),
    (4096, [128, 256, 512, 1024, 2048, 4096]),
])
def test_generate_buckets_exact(max_length, expected):
    assert generate_buckets(128, max_length) == expected


@pytest.mark.parametrize("max_length, expected", [
    (512, [128, 256, 512]),
    (1000, [128, 256, 512, 1000]),
    (1500, [128, 256, 512, 1024, 1280, 1500]),
    (2048, [128, 256, 512, 1024, 1280, 1536, 1792, 2048]),
    (4096, [128, 256, 512, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096]),
])
def test_quartered_buckets_pad_long_prompts_by_at_most_a_quarter(max_length, expected):
    buckets = quartered_buckets(128, max_length)
    assert buckets == expected
    for n in range(1025, max_length + 1):  # past 1024: the chosen bucket is < 1.25 n
        assert select_bucket(n, buckets) < 1.25 * n


@pytest.mark.parametrize("max_length, expected", [
    (96, [32, 64, 96]),
    (512, [32, 64, 128, 192, 256, 384, 512]),
    (1500, [32, 64, 128, 192, 256, 384, 512, 768, 1024, 1152, 1280, 1408, 1500]),
    (2048, [32, 64, 128, 192, 256, 384, 512, 768, 1024, 1152, 1280, 1408, 1536, 1664, 1792,
            1920, 2048]),
])
def test_prefill_buckets_pad_by_under_half_then_under_an_eighth(max_length, expected):
    buckets = prefill_buckets(32, max_length)
    assert buckets == expected
    for n in range(129, max_length + 1):  # 129-1023: under 1.5 n; past 1024: under 1.125 n
        assert select_bucket(n, buckets) < (1.125 if n > 1024 else 1.5) * n


def test_generate_buckets_max_not_above_min():
    assert generate_buckets(128, 64) == [64]
    assert generate_buckets(1, 1) == [1]
    assert generate_buckets(1, 6) == [1, 2, 4, 6]


@pytest.mark.parametrize("min_length, max_length", [(0, 128), (100, 128), (128, 0)])
def test_generate_buckets_rejects_bad_bounds(min_length, max_length):
    with pytest.raises(ValueError):
        generate_buckets(min_length, max_length)


@pytest.mark.parametrize("seq_len, expected", [
    (128, [128]),
    (1000, [128, 256, 512, 1000]),
    (2048, [128, 256, 512, 1024, 2048]),
    (4096, [128, 256, 512, 1024, 2048, 4096]),
])
def test_automatic_cte_and_tkg_buckets(seq_len, expected):
    nc = config(seq_len=seq_len)
    assert context_encoding_buckets(nc) == expected
    assert token_generation_buckets(nc) == expected


def test_max_context_length_limits_cte_only():
    nc = config(seq_len=4096, max_context_length=1000)
    assert context_encoding_buckets(nc) == [128, 256, 512, 1000]
    assert token_generation_buckets(nc) == [128, 256, 512, 1024, 2048, 4096]


def test_bucketing_disabled_gives_single_bucket():
    nc = config(enable_bucketing=False, seq_len=4096, max_context_length=1024,
                context_encoding_buckets=[512, 1024])
    assert context_encoding_buckets(nc) == [1024]
    assert token_generation_buckets(nc) == [4096]


# ---- explicit buckets ----------------------------------------------------------------------

def test_explicit_buckets_from_the_guide():
    nc = config(seq_len=8192, context_encoding_buckets=[1024, 2048, 4096],
                token_generation_buckets=[8192])
    assert context_encoding_buckets(nc) == [1024, 2048, 4096]
    assert token_generation_buckets(nc) == [8192]


@pytest.mark.parametrize("buckets", [[], [0, 128], [-1], [256, 128], [128, 128]])
def test_explicit_buckets_invalid(buckets):
    nc = config(context_encoding_buckets=buckets)
    with pytest.raises(ValueError, match="context_encoding_buckets"):
        context_encoding_buckets(nc)


def test_explicit_bucket_above_limit_names_field_and_limit():
    nc = config(seq_len=2048, token_generation_buckets=[1024, 4096])
    with pytest.raises(ValueError, match="token_generation_buckets.*4096.*seq_len 2048"):
        token_generation_buckets(nc)
    nc = config(seq_len=2048, max_context_length=1024, context_encoding_buckets=[2048])
    with pytest.raises(ValueError, match="max_context_length 1024"):
        context_encoding_buckets(nc)


# ---- batch buckets -------------------------------------------------------------------------

def test_tkg_batch_buckets():
    assert token_generation_batch_buckets(config(tkg_batch_size=8)) == [1, 2, 4, 8]
    assert token_generation_batch_buckets(config(tkg_batch_size=6)) == [1, 2, 4, 6]
    assert token_generation_batch_buckets(config(max_batch_size=4)) == [1, 2, 4]
    assert token_generation_batch_buckets(config(enable_bucketing=False, tkg_batch_size=8)) == [8]
    nc = config(tkg_batch_size=8, token_generation_batch_buckets=[2, 8])
    assert token_generation_batch_buckets(nc) == [2, 8]
    with pytest.raises(ValueError, match="token_generation_batch_buckets"):
        token_generation_batch_buckets(config(tkg_batch_size=4, token_generation_batch_buckets=[8]))


def test_decode_batch_buckets_pad_a_step_by_under_a_quarter_of_its_rows():
    assert decode_batch_buckets(32) == [1, 2, 4, 8, 10, 12, 14, 16, 20, 24, 28, 32]
    assert decode_batch_buckets(8) == [1, 2, 4, 8]
    assert decode_batch_buckets(12) == [1, 2, 4, 8, 10, 12]
    assert decode_batch_buckets(6) == [1, 2, 4, 6]
    assert decode_batch_buckets(1) == [1]
    for rows in range(9, 65):  # past 8 rows a step's padding stays under a quarter
        padded = select_bucket(rows, decode_batch_buckets(64))
        assert padded - rows < padded / 4, rows


def test_mixed_calls_keep_the_power_of_two_batch_buckets():
    dense = config(tkg_batch_size=32, token_generation_batch_buckets=decode_batch_buckets(32))
    assert mixed_batch_buckets(dense) == [1, 2, 4, 8, 16, 32]
    assert mixed_batch_buckets(config(tkg_batch_size=12, token_generation_batch_buckets=[
        1, 2, 4, 6, 8, 12])) == [1, 2, 4, 8, 12]
    assert mixed_batch_buckets(config(tkg_batch_size=6, token_generation_batch_buckets=[3, 6])) \
        == [6]
    assert mixed_batch_buckets(config(tkg_batch_size=8)) == [1, 2, 4, 8]


# ---- selection and padding -----------------------------------------------------------------

def test_select_bucket_smallest_fit():
    buckets = [128, 256, 512, 1000]
    assert select_bucket(1, buckets) == 128
    assert select_bucket(128, buckets) == 128
    assert select_bucket(129, buckets) == 256
    assert select_bucket(1000, buckets) == 1000


def test_select_bucket_too_long_message():
    buckets = [128, 256, 512, 1024, 2048, 4096]
    with pytest.raises(ValueError) as err:
        select_bucket(5000, buckets, "prompt length", "context-encoding")
    assert str(err.value) == (
        "prompt length 5000 exceeds the largest context-encoding bucket 4096; "
        "raise max_context_length/seq_len or shorten the input")


def test_select_bucket_rejects_empty_input():
    with pytest.raises(ValueError, match="at least 1"):
        select_bucket(0, [128])


def test_pad_to_bucket():
    assert pad_to_bucket([5, 6, 7], 4) == [5, 6, 7, 0]
    assert pad_to_bucket([5, 6], 2, pad_id=9) == [5, 6]
    assert pad_batch_to_bucket([[1], [2, 3]], 3, pad_id=-1) == [[1, -1, -1], [2, 3, -1]]
    with pytest.raises(ValueError, match="do not fit bucket 2"):
        pad_to_bucket([1, 2, 3], 2)


# ---- prefix caching: bucket lists ----------------------------------------------------------

GUIDE_PREFILL = [512, 1024, 2048]
GUIDE_PREFIX = [0, 512, 1024]


def test_prefix_caching_buckets_explicit_from_the_guide():
    nc = config(seq_len=2048, context_encoding_buckets=[512, 1024, 2048],
                prefix_buckets=[512, 1024], token_generation_buckets=[2048])
    assert prefix_caching_buckets(nc) == (GUIDE_PREFILL, GUIDE_PREFIX)


@pytest.mark.parametrize("seq_len, prefill", [
    (128, [128]),
    (1000, [512, 1000]),
    (2048, [512, 1024, 2048]),
    (4096, [512, 1024, 2048, 4096]),
])
def test_prefix_caching_buckets_automatic(seq_len, prefill):
    assert prefix_caching_buckets(config(seq_len=seq_len)) == (prefill, [0] + prefill)


def test_prefix_caching_buckets_explicit_prefix_only_and_leading_zero():
    nc = config(seq_len=4096, prefix_buckets=[1024])
    assert prefix_caching_buckets(nc) == ([512, 1024, 2048, 4096], [0, 1024])
    nc = config(seq_len=4096, prefix_buckets=[0, 2048])
    assert prefix_caching_buckets(nc)[1] == [0, 2048]
    with pytest.raises(ValueError, match="prefix_buckets"):
        prefix_caching_buckets(config(seq_len=1024, prefix_buckets=[512, 2048]))


def test_prefix_caching_bucket_grid():
    nc = config(seq_len=1024, prefix_buckets=[512])
    assert prefix_caching_bucket_grid(nc) == [(512, 0), (512, 512), (1024, 0), (1024, 512)]


def test_prefix_caching_buckets_disabled():
    nc = config(enable_bucketing=False, seq_len=4096, max_context_length=2048)
    assert prefix_caching_buckets(nc) == ([2048], [0, 2048])


# ---- prefix caching: the guide's four worked examples --------------------------------------

def choose(prompts, prefixes):
    return select_prefix_caching_bucket(prompts, prefixes, GUIDE_PREFILL, GUIDE_PREFIX)


def test_guide_example_1_no_prefix():
    assert choose([1000], [0]) == PrefixBucketChoice(1024, 0, (0,))


def test_guide_example_2_whole_prefix_moves_into_prefill():
    assert choose([800], [128]) == PrefixBucketChoice(1024, 0, (0,))


def test_guide_example_3_part_of_prefix_moves():
    assert choose([900], [640]) == PrefixBucketChoice(512, 512, (388,))


def test_guide_example_4_prefix_too_long():
    with pytest.raises(ValueError) as err:
        choose([1600], [1280])
    assert "effective prefix length 1088" in str(err.value)
    assert "largest prefix bucket 1024" in str(err.value)


# ---- prefix caching: batches and edge cases ------------------------------------------------

def test_batch_prefill_bucket_follows_longest_suffix():
    # suffixes 260, 600, 100 -> prefill 1024; spare slots 764, 424, 924.
    choice = choose([900, 1000, 1500], [640, 400, 1400])
    assert choice == PrefixBucketChoice(1024, 512, (0, 0, 476))


def test_batch_prefix_bucket_follows_longest_effective_prefix():
    # suffixes 100, 200 -> prefill 512; effective prefixes 700-412=288, 1100-312=788.
    assert choose([800, 1300], [700, 1100]) == PrefixBucketChoice(512, 1024, (288, 788))


def test_batch_no_prefix_anywhere():
    assert choose([10, 500], [0, 0]) == PrefixBucketChoice(512, 0, (0, 0))


def test_exact_fit_keeps_prefix():
    # suffix 512 fills the prefill bucket exactly; the whole 512-token prefix stays cached.
    assert choose([1024], [512]) == PrefixBucketChoice(512, 512, (512,))


def test_suffix_too_long_for_any_prefill_bucket():
    with pytest.raises(ValueError, match="prompt suffix length 3000 exceeds the largest prefill"):
        choose([3000], [0])


@pytest.mark.parametrize("prompts, prefixes", [([], []), ([10], [0, 0]), ([10], [10]),
                                               ([10], [-1])])
def test_bad_prefix_batches(prompts, prefixes):
    with pytest.raises(ValueError):
        choose(prompts, prefixes)


def test_choice_is_frozen():
    choice = choose([1000], [0])
    with pytest.raises(AttributeError):
        choice.prefill_bucket = 2048
