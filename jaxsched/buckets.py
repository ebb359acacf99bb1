"""Bucket lists: the one source of the shapes a step may have. No jax here.

Every step's token count T and sequence count S are rounded up to a bucket, and every (T, S) pair
is compiled at warm-up, so a step never compiles. Buckets double, so padding is below 50 % of a
step and the number of compiled programs stays logarithmic in the limits. Decode-sized buckets
(from 32 up to max_num_seqs) also get the 1.5x step between two doublings (48, 96, 192, ...):
decode steps are most of a generation's steps, and one of 80 sequences then pads to 96, not 128
(vLLM captures CUDA graphs at batch sizes 8 apart for the same reason). Steps of more tokens than
max_num_seqs carry prefill chunks; their S stays on the doubling buckets, so the finer ones add few
(T, S) pairs to compile.
"""

from __future__ import annotations

import bisect

MIN_TOKEN_BUCKET = 16
MIN_SEQ_BUCKET = 8
FINE_FROM = 32  # below this a doubling pads a few rows at most: no 1.5x steps


def make_buckets(limit: int, smallest: int, fine_up_to: int = 0) -> tuple[int, ...]:
    """Powers of two from `smallest` (capped by `limit`) up to `limit`, `limit` always last, plus
    the 1.5x step after each power of two b with FINE_FROM <= b and 1.5 b < min(fine_up_to, limit)."""
    buckets = []
    b = min(smallest, limit)
    while b < limit:
        buckets.append(b)
        mid = b * 3 // 2
        if b >= FINE_FROM and mid < min(fine_up_to, limit):
            buckets.append(mid)
        b *= 2
    buckets.append(limit)
    return tuple(buckets)


def token_buckets(max_num_batched_tokens: int, max_num_seqs: int = 0) -> tuple[int, ...]:
    """T buckets; with max_num_seqs, the decode-sized ones (T <= max_num_seqs) get 1.5x steps."""
    return make_buckets(max_num_batched_tokens, MIN_TOKEN_BUCKET, fine_up_to=max_num_seqs)


def seq_buckets(max_num_seqs: int) -> tuple[int, ...]:
    return make_buckets(max_num_seqs, MIN_SEQ_BUCKET, fine_up_to=max_num_seqs)


def seq_buckets_for(seq_bkts: tuple[int, ...], T: int) -> tuple[int, ...]:
    """The S buckets a step of T tokens may use: all for decode-sized T (T <= the largest S); for
    larger T (the step carries prefill chunks) only the doubling ones and the limit."""
    if T <= seq_bkts[-1]:
        return seq_bkts
    return tuple(s for s in seq_bkts if s & (s - 1) == 0 or s == seq_bkts[-1])


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
        for s in seq_buckets_for(seq_bkts, t):
            pairs.append((t, s))
            if s >= t:  # a larger S than T cannot occur; keep the first S that covers T
                break
    return pairs
