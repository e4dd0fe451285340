"""Bucket lists and bucket selection, as in NxD Inference's "Bucketing" feature.

Compiled graphs take static shapes, so every input is padded up to the smallest bucket that fits.
This module decides which buckets exist (automatic powers of two, or explicit lists from the
config) and which bucket serves a given input, including the two-dimensional (prefill, prefix)
buckets used for context encoding when prefix caching is enabled.

Functions that take a ``neuron_config`` only read these attributes (via ``getattr``):
``enable_bucketing``, ``max_context_length``, ``seq_len``, ``context_encoding_buckets``,
``token_generation_buckets``, ``prefix_buckets``, ``tkg_batch_size``, ``max_batch_size``,
``token_generation_batch_buckets``. It imports no torch.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Sequence

AUTO_MIN_BUCKET = 128  # smallest automatic CTE / TKG bucket
PREFIX_CACHING_MIN_BUCKET = 512  # smallest automatic prefill / prefix bucket


@dataclass(frozen=True)
class PrefixBucketChoice:
    """The (prefill, prefix) bucket serving one prefix-caching context-encoding batch.

    ``effective_prefix_lens[i]`` is how many leading tokens of prompt ``i`` are read from the
    KV cache; the rest (``prompt_len - effective_prefix_len``) are encoded in the prefill bucket.
    """

    prefill_bucket: int
    prefix_bucket: int
    effective_prefix_lens: tuple[int, ...]


def generate_buckets(min_length: int, max_length: int) -> list[int]:
    """Powers of two from ``min_length`` strictly below ``max_length``, then ``max_length``.

    ``generate_buckets(128, 1000) == [128, 256, 512, 1000]``; if ``max_length <= min_length``
    the only bucket is ``max_length``.
    """
    if min_length < 1 or min_length & (min_length - 1):
        raise ValueError(f"min_length must be a positive power of two, got {min_length}")
    if max_length < 1:
        raise ValueError(f"max_length must be positive, got {max_length}")
    buckets = []
    size = min_length
    while size < max_length:
        buckets.append(size)
        size *= 2
    buckets.append(max_length)
    return buckets


def quartered_buckets(min_length: int, max_length: int, quarter_from: int = 1024) -> list[int]:
    """Powers of two from ``min_length``; from ``quarter_from`` up, every doubling is split into
    four equal steps, so a prompt longer than ``quarter_from`` is padded by at most 25%; ends at
    ``max_length``. ``quartered_buckets(128, 2048) == [128, 256, 512, 1024, 1280, 1536, 1792,
    2048]`` (NxD's powers of two would pad a 1025-token prompt to 2048)."""
    return _split_buckets(min_length, max_length, lambda size: 4 if size >= quarter_from else 1)


def prefill_buckets(min_length: int, max_length: int, halves_from: int = 128,
                    eighths_from: int = 1024) -> list[int]:
    """Context-encoding buckets for a worker whose work is prefill: powers of two from
    ``min_length``, every doubling from ``halves_from`` split in two and from ``eighths_from`` in
    eight, ending at ``max_length``. ``prefill_buckets(32, 2048) == [32, 64, 128, 192, 256, 384,
    512, 768, 1024, 1152, 1280, ..., 1920, 2048]``: a prompt of 129-1023 tokens pads by less than
    half, one past 1024 by less than an eighth (quartered_buckets: less than all, and a quarter).
    On ``mixed``'s prompt lengths (nxdi_bench) the padded tokens are 1.09x the prompts' against
    1.16x quartered, and a saturated prefill worker's median time to first token fell 21-31%
    (BENCHMARKS.md, issue 4, session 59), for 7 more lengths to trace and warm up at 2048."""
    def parts(size: int) -> int:
        return 8 if size >= eighths_from else 2 if size >= halves_from else 1
    return _split_buckets(min_length, max_length, parts)


def decode_batch_buckets(max_batch: int) -> list[int]:
    """A decode worker's TKG batch buckets: powers of two to 8, then every doubling in four equal
    steps, ending at ``max_batch``: ``decode_batch_buckets(32) == [1, 2, 4, 8, 10, 12, 14, 16,
    20, 24, 28, 32]``. Past 8 rows a step's products are bound by their arithmetic, and a padded
    row costs about what a real one does: one Zen 4 core, 384 positions, 9-14 rows took 27-30
    ms a step padded to 16 and 21-28 ms in these buckets; below 8 the weights' read bounds the
    step and 5-7 rows took the same 15-17 ms in their own buckets as in 8's. BENCHMARKS.md,
    issue 4, session 71."""
    return quartered_buckets(1, max_batch, quarter_from=8)


def _split_buckets(min_length: int, max_length: int, parts) -> list[int]:
    """generate_buckets' powers of two with the doubling from each bucket ``size`` split into
    ``parts(size)`` equal steps (1: not split)."""
    buckets = []
    for size in generate_buckets(min_length, max_length):
        if buckets:
            step = buckets[-1] // parts(buckets[-1])
            buckets += range(buckets[-1] + step, size, step)
        buckets.append(size)
    return buckets


def _max_context_length(nc: Any) -> int:
    """``max_context_length``, defaulting to ``seq_len`` as NeuronConfig does."""
    value = getattr(nc, "max_context_length", None)
    return value if value is not None else getattr(nc, "seq_len")


def _tkg_batch_size(nc: Any) -> int:
    """``tkg_batch_size``, defaulting to ``max_batch_size``."""
    value = getattr(nc, "tkg_batch_size", None)
    return value if value is not None else getattr(nc, "max_batch_size")


def parse_buckets(text: str) -> tuple[int, ...]:
    """"128,256,1024" -> (128, 256, 1024): a command-line bucket list (argparse `type=`)."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token counts, got {text!r}") from None


def validate_buckets(buckets: Sequence[int], limit: int, field: str,
                     limit_name: str = "the limit", allow_zero: bool = False) -> list[int]:
    """Check an explicit bucket list: non-empty, positive, strictly increasing, largest <= limit.

    ``allow_zero`` accepts a leading 0 (the "no prefix" bucket of ``prefix_buckets``).
    Raises ValueError naming ``field`` (and ``limit_name``) and what to change.
    """
    buckets = [int(b) for b in buckets]
    if not buckets:
        raise ValueError(f"{field} must not be empty; give at least one bucket or leave it unset")
    smallest_allowed = 0 if allow_zero else 1
    if buckets[0] < smallest_allowed:
        raise ValueError(f"{field} must hold positive sizes, got {buckets}")
    if any(later <= earlier for earlier, later in zip(buckets, buckets[1:])):
        raise ValueError(f"{field} must be strictly increasing, got {buckets}")
    if buckets[-1] > limit:
        raise ValueError(
            f"{field} has bucket {buckets[-1]} larger than {limit_name} {limit}; "
            f"remove it or raise {limit_name}"
        )
    return buckets


def _buckets_for(nc: Any, field: str, max_length: int, limit_name: str) -> list[int]:
    """Shared rule for CTE and TKG: no bucketing, explicit list, or automatic powers of two."""
    if not getattr(nc, "enable_bucketing", False):
        return [max_length]
    explicit = getattr(nc, field, None)
    if explicit is not None:
        return validate_buckets(explicit, max_length, field, limit_name)
    return generate_buckets(AUTO_MIN_BUCKET, max_length)


def context_encoding_buckets(nc: Any) -> list[int]:
    """Context-encoding (prefill) sequence-length buckets for ``nc``."""
    return _buckets_for(nc, "context_encoding_buckets", _max_context_length(nc),
                        "max_context_length")


def token_generation_buckets(nc: Any) -> list[int]:
    """Token-generation sequence-length buckets (KV length) for ``nc``."""
    return _buckets_for(nc, "token_generation_buckets", getattr(nc, "seq_len"), "seq_len")


def token_generation_batch_buckets(nc: Any) -> list[int]:
    """Token-generation batch-size buckets for continuous batching.

    An explicit ``token_generation_batch_buckets`` list wins; with bucketing enabled the
    buckets are powers of two from 1 below ``tkg_batch_size`` plus ``tkg_batch_size``;
    otherwise ``[tkg_batch_size]``.
    """
    batch = _tkg_batch_size(nc)
    explicit = getattr(nc, "token_generation_batch_buckets", None)
    if explicit is not None:
        return validate_buckets(explicit, batch, "token_generation_batch_buckets",
                                "tkg_batch_size")
    if getattr(nc, "enable_bucketing", False):
        return generate_buckets(1, batch)
    return [batch]


def mixed_batch_buckets(nc: Any) -> list[int]:
    """Decode-row buckets of the mixed sub-models (a prefill piece with a decode batch in one
    call): the token-generation batch buckets that are powers of two, and the largest. There is
    one mixed graph per (piece length, rows, cache length) and the piece's tokens dominate its
    call, so a few padded decode rows cost it little next to the graphs a dense list would add.
    """
    buckets = token_generation_batch_buckets(nc)
    return [b for b in buckets[:-1] if not b & (b - 1)] + buckets[-1:]


def select_bucket(length: int, buckets: Sequence[int], what: str = "sequence length",
                  kind: str = "") -> int:
    """The smallest bucket >= ``length``.

    ``what`` names the quantity and ``kind`` the bucket family in errors, e.g.
    ``select_bucket(n, cte, "prompt length", "context-encoding")``.
    """
    if length < 1:
        raise ValueError(f"{what} must be at least 1, got {length}")
    for bucket in buckets:
        if bucket >= length:
            return bucket
    family = f"{kind} bucket" if kind else "bucket"
    raise ValueError(
        f"{what} {length} exceeds the largest {family} {max(buckets)}; "
        f"raise max_context_length/seq_len or shorten the input"
    )


def pad_to_bucket(token_ids: Sequence[int], bucket: int, pad_id: int = 0) -> list[int]:
    """Right-pad ``token_ids`` with ``pad_id`` to exactly ``bucket`` entries."""
    if len(token_ids) > bucket:
        raise ValueError(f"{len(token_ids)} tokens do not fit bucket {bucket}")
    return list(token_ids) + [pad_id] * (bucket - len(token_ids))


def pad_batch_to_bucket(batch: Sequence[Sequence[int]], bucket: int,
                        pad_id: int = 0) -> list[list[int]]:
    """Right-pad every row of ``batch`` to ``bucket`` entries: [batch, bucket]."""
    return [pad_to_bucket(row, bucket, pad_id) for row in batch]


def prefix_caching_buckets(nc: Any) -> tuple[list[int], list[int]]:
    """``(prefill_buckets, prefix_buckets)`` for context encoding with prefix caching.

    Prefill (suffix) buckets: explicit ``context_encoding_buckets`` or powers of two from 512 up
    to ``max_context_length``. Prefix buckets: ``[0]`` plus explicit ``prefix_buckets`` or the
    prefill list. Without bucketing both dimensions hold only ``max_context_length`` (plus 0).
    """
    max_len = _max_context_length(nc)
    if not getattr(nc, "enable_bucketing", False):
        return [max_len], [0, max_len]
    explicit = getattr(nc, "context_encoding_buckets", None)
    if explicit is not None:
        prefill = validate_buckets(explicit, max_len, "context_encoding_buckets",
                                   "max_context_length")
    else:
        prefill = generate_buckets(PREFIX_CACHING_MIN_BUCKET, max_len)
    explicit = getattr(nc, "prefix_buckets", None)
    if explicit is None:
        return prefill, [0] + prefill
    prefix = validate_buckets(explicit, max_len, "prefix_buckets", "max_context_length",
                              allow_zero=True)
    return prefill, prefix if prefix[0] == 0 else [0] + prefix


def prefix_caching_bucket_grid(nc: Any) -> list[tuple[int, int]]:
    """Every (prefill, prefix) pair: the context-encoding graphs compiled with prefix caching."""
    prefill, prefix = prefix_caching_buckets(nc)
    return [(fill, pre) for fill in prefill for pre in prefix]


def select_prefix_caching_bucket(prompt_lens: Sequence[int], prefix_lens: Sequence[int],
                                 prefill_buckets: Sequence[int],
                                 prefix_buckets: Sequence[int]) -> PrefixBucketChoice:
    """Pick the (prefill, prefix) bucket for a batch, as the feature guide describes.

    1. The prefill bucket is the smallest one fitting the largest suffix (prompt - prefix).
    2. Spare prefill slots of each prompt are filled by moving tokens from the end of its prefix
       into the suffix (a prefix that fits entirely becomes 0).
    3. The prefix bucket is the smallest one fitting the largest remaining (effective) prefix.
    """
    _check_prefix_batch(prompt_lens, prefix_lens)
    suffixes = [p - c for p, c in zip(prompt_lens, prefix_lens)]
    prefill = select_bucket(max(suffixes), prefill_buckets, "prompt suffix length", "prefill")
    effective = tuple(max(0, c - (prefill - s)) for c, s in zip(prefix_lens, suffixes))
    longest = max(effective)
    fitting = [b for b in prefix_buckets if b >= longest]
    if not fitting:
        raise ValueError(
            f"effective prefix length {longest} exceeds the largest prefix bucket "
            f"{max(prefix_buckets)}; add a larger prefix bucket or shorten the cached prefix"
        )
    return PrefixBucketChoice(prefill, min(fitting), effective)


def _check_prefix_batch(prompt_lens: Sequence[int], prefix_lens: Sequence[int]) -> None:
    """Validate a batch of (prompt length, cached prefix length) pairs."""
    if not prompt_lens or len(prompt_lens) != len(prefix_lens):
        raise ValueError(
            f"need one prefix length per prompt, got {len(prompt_lens)} prompts and "
            f"{len(prefix_lens)} prefix lengths"
        )
    for prompt, prefix in zip(prompt_lens, prefix_lens):
        if not 0 <= prefix < prompt:
            raise ValueError(
                f"prefix length {prefix} must be in [0, prompt length {prompt}); "
                f"at least one prompt token must be encoded"
            )
