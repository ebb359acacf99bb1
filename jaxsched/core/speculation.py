"""How many proposals a step verifies (speculative decoding). Plain Python: no jax, no clocks.

Each decode row may carry proposed tokens (ngram.py) that the step verifies: the model computes the
row's logits at every proposed position, and the row keeps the proposals its sampler drew the
same token for, plus the token drawn at the first mismatch (runner side: sampler.py; host side:
Scheduler.update). A proposal costs a token of the step whether it is kept or not, and a step that
verifies runs the programs of width Q (each row's logits at Q positions), whose lm_head and sampler
do Q times the rows'.

So the scheduler asks the step-cost model. Proposal j (1-based) of a request is kept only if the
j - 1 before it were, with probability about a^j, where a is the request's acceptance rate so far
(a decayed count, starting from PRIOR). Taking proposals in order of that probability, each
candidate step (no proposals at width 1; or the proposals that fill each token bucket at width Q) is
scored by expected tokens per predicted second: the step's scheduled tokens plus the proposals'
expected keeps, over its predicted time. The best wins; with a TPOT target, the best of those
predicted within it. Without a cost model (step_cost_model=False), or before it has data, every
proposal is verified, as vLLM does.

A request whose proposals keep failing sees its rate fall, and its proposals stop paying for
their place: it stops being given them. Below MIN_RATE it is not even proposed for, but once every
RETRY_STEPS steps (its text may have turned to copying).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

PRIOR_KEPT, PRIOR_TRIED = 1.0, 2.0  # a = 0.5 before any proposal was verified
DECAY = 0.9  # older verifications weigh less: a request's text changes character
MIN_RATE = 0.1  # 0.083 after a long run of refusals (the decayed counts' limit, with the prior)
RETRY_STEPS = 32
# With overlapped scheduling the step before one with proposals is read first (the overlap pauses):
# a request the proposer had nothing for (no n-gram recurred) pauses it again only this many steps later
EMPTY_RETRY_STEPS = 8


def acceptance_rate(kept: float, tried: float) -> float:
    """The request's estimated chance that a proposal is kept, given the one before it was."""
    return (kept + PRIOR_KEPT) / (tried + PRIOR_TRIED)


def record(kept: float, tried: float, n_proposed: int, n_kept: int) -> tuple[float, float]:
    """The decayed counts after a step that verified n_proposed proposals of which the first
    n_kept were kept: each kept one was a success, the first refused one a failure, the ones
    after it untested."""
    tested = n_kept + (1 if n_kept < n_proposed else 0)
    return DECAY * kept + n_kept, DECAY * tried + tested


def choose(proposals: Sequence[tuple[float, int]], total: int, num_rows: int, budget: int,
           token_buckets: Sequence[int], predict: Callable[[int, int, int], float] | None,
           target_seconds: float | None = None) -> int:
    """How many of the step's proposals to verify, taken best first.

    proposals: (probability it is kept, rows' index) per proposal, sorted best first; total: the
    step's tokens without them; num_rows: its rows; budget: tokens the step may still add;
    predict(T, S rows, width > 1 ?): predicted seconds of a step of T tokens (None: no model).
    """
    most = min(len(proposals), budget)
    if most <= 0:
        return 0
    if predict is None or predict(total, num_rows, False) <= 0:  # no model, or no data yet
        return most
    k0 = bisect.bisect_left(token_buckets, total)
    gain = [0.0]
    for p, _ in proposals[:most]:
        gain.append(gain[-1] + p)
    best_x, best_score = 0, None
    candidates = [0] + [min(b - total, most) for b in token_buckets[k0:] if b > total]
    seen = set()
    for x in candidates:
        if x in seen:
            continue
        seen.add(x)
        seconds = predict(total + x, num_rows, x > 0)
        if target_seconds is not None and x and seconds > target_seconds:
            continue
        score = (total + gain[x]) / seconds if seconds > 0 else float(total + gain[x])
        if best_score is None or score > best_score:
            best_x, best_score = x, score
        if x == most:
            break
    return best_x
