"""Bucket lists: the one source of the shapes a step may have. No jax here.

Every step's token count T and sequence count S are rounded up to a bucket, and every (T, S) pair
is compiled at warm-up, so a step never compiles. Buckets double, so padding is below 50 % of a
step and the number of compiled programs stays logarithmic in the limits. Decode-sized buckets
(from 32 up to max_num_seqs) also get steps between two doublings, a quarter of the doubling apart
and never closer than 16 (32 -> 48 -> 64 -> 80 -> 96 -> 112 -> 128 -> 160 -> ...): decode steps are
most of a generation's steps, and every padded row costs a full row of matmuls (vLLM captures CUDA
graphs at batch sizes 8 apart for the same reason; the padding saved is in docs/PERFORMANCE.md). Steps of more tokens than
max_num_seqs carry prefill chunks; their S stays on the doubling buckets. The fine steps do
multiply the decode-sized (T, S) pairs: 61 programs for the benchmark's limits (max_num_seqs 128,
max_num_batched_tokens 2048) against 34 with doubling buckets only, 92 for max_num_seqs 256.
"""

from __future__ import annotations

import bisect

MIN_TOKEN_BUCKET = 16
MIN_SEQ_BUCKET = 8
FINE_FROM = 32  # below this a doubling pads a few rows at most: no finer steps
FINE_STEP = 16  # the finest step between decode-sized buckets


def make_buckets(limit: int, smallest: int, fine_up_to: int = 0) -> tuple[int, ...]:
    """Powers of two from `smallest` (capped by `limit`) up to `limit`, `limit` always last, plus,
    after each power of two b >= FINE_FROM, the steps b + k * max(b / 4, FINE_STEP) that are below
    min(fine_up_to, limit)."""
    buckets = []
    b = min(smallest, limit)
    while b < limit:
        buckets.append(b)
        if b >= FINE_FROM:
            step = max(b // 4, FINE_STEP)
            buckets += range(b + step, min(2 * b, fine_up_to, limit), step)
        b *= 2
    buckets.append(limit)
    return tuple(buckets)


def token_buckets(max_num_batched_tokens: int, max_num_seqs: int = 0) -> tuple[int, ...]:
    """T buckets; with max_num_seqs, the decode-sized ones (T <= max_num_seqs) get finer steps, and
    max_num_seqs itself is one (a full decode step of 100 sequences pads to 100, not 128)."""
    buckets = make_buckets(max_num_batched_tokens, MIN_TOKEN_BUCKET, fine_up_to=max_num_seqs)
    if buckets[0] < max_num_seqs < max_num_batched_tokens and max_num_seqs not in buckets:
        buckets = tuple(sorted((*buckets, max_num_seqs)))
    return buckets


def seq_buckets(max_num_seqs: int) -> tuple[int, ...]:
    return make_buckets(max_num_seqs, MIN_SEQ_BUCKET, fine_up_to=max_num_seqs)


def seq_buckets_for(seq_bkts: tuple[int, ...], T: int) -> tuple[int, ...]:
    """The S buckets a step of T tokens may use: the doubling ones and the limit, plus, for
    decode-sized T (T <= the largest S), the finer ones above T / 2. A padded sequence costs only an
    lm_head row, a padded token a full row of matmuls, so fine S steps matter only where S is close
    to T (decode steps); this keeps the pairs to compile at 61 instead of 64 for max_num_seqs 128,
    92 instead of 108 for 256."""
    coarse = tuple(s for s in seq_bkts if s & (s - 1) == 0 or s == seq_bkts[-1])
    if T > seq_bkts[-1]:
        return coarse
    return tuple(s for s in seq_bkts if s in coarse or s > T // 2)


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
