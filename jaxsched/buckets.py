"""Bucket lists: the one source of the shapes a step may have. No jax here.

Every step's token count T and sequence count S are rounded up to a bucket, and every (T, S) pair
is compiled at warm-up, so a step never compiles. Buckets double, so padding is below 50 % of a
step and the number of compiled programs stays logarithmic in the limits.
"""

from __future__ import annotations

import bisect

MIN_TOKEN_BUCKET = 16
MIN_SEQ_BUCKET = 8


def make_buckets(limit: int, smallest: int) -> tuple[int, ...]:
    """Powers of two from `smallest` (capped by `limit`) up to `limit`; `limit` is always last."""
    buckets = []
    b = min(smallest, limit)
    while b < limit:
        buckets.append(b)
        b *= 2
    buckets.append(limit)
    return tuple(buckets)


def token_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    return make_buckets(max_num_batched_tokens, MIN_TOKEN_BUCKET)


def seq_buckets(max_num_seqs: int) -> tuple[int, ...]:
    return make_buckets(max_num_seqs, MIN_SEQ_BUCKET)


def round_up(buckets: tuple[int, ...], n: int) -> int:
    """The smallest bucket >= n. Raises if n is beyond the largest bucket (a scheduler bug)."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def bucket_pairs(token_bkts: tuple[int, ...], seq_bkts: tuple[int, ...]) -> list[tuple[int, int]]:
    """Every (T, S) a step can have: S sequences need at least S tokens, so S <= T."""
    pairs = []
    for t in token_bkts:
        for s in seq_bkts:
            pairs.append((t, s))
            if s >= t:  # a larger S than T cannot occur; keep the first S that covers T
                break
    return pairs
