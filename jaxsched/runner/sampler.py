"""On-device sampling, compiled once per sequence bucket and run after the model's forward pass.

Greedy rows take the argmax. Sampling rows apply temperature, then top-k / top-p / min-p as one
threshold per row (the cond program finds it without sorting the row: FILTER_TOP), then one draw
from what the filters keep, by inverting its CDF at a number hashed
from (request seed, output index): a seeded request gives the same tokens whatever else shares its
batch. Each costly part runs under lax.cond, so an all-greedy step pays only for the argmax and a
step without logprobs for none.

Penalties come first, as in vLLM, and apply to greedy and sampled rows alike: repetition_penalty
divides positive and multiplies non-positive logits of every token seen in the prompt or the output;
frequency_penalty * count and presence_penalty * (count > 0) are subtracted over the output tokens;
min_tokens sets EOS and stop_token_ids to -inf until that many tokens were generated. The history
arrives as a per-row table of at most W (engine: max_model_len) distinct token ids with their output
counts (jaxsched/runner/penalties.py says why, and how a request that could outgrow it is refused up front):
a gather and a scatter of [S, W] entries, no [S, V] array crosses to the device. The whole stage
sits under lax.cond, so a step where no row is penalised pays nothing for it.

Then logit_bias (OpenAI's: a value added to chosen tokens' logits, from an [S, LB] table scattered
like the penalties), then the token masks of constrained rows (structured outputs and
allowed_token_ids, jaxsched/structured/grammar.py): an i32[S, VW] bitmask, unpacked on the device, that sets
disallowed tokens to -inf. The mask goes to the token choice (greedy or drawn) inside a lax.cond whose
outputs are the [S] sampled ids, so a step without constrained rows never unpacks it, and no [S, V]
array leaves the cond (a cond returning the logits copies them in its identity branch).

Logprobs are of the model's raw distribution (vLLM's default): the sampled token's logprob and
rank, and the top `max_logprobs` alternatives, before penalties and temperature.

The lax.conds above suit a CPU, where XLA evaluates a predicate where it stands. XLA:GPU reads each
cond's predicate back to the host and waits for the stream to drain first, so the sampler's call
would hold the host until the model's program of the same step had finished, and the next step
could not be scheduled meanwhile (overlapped scheduling, engine.py). There the host, which knows
from the rows' parameters which parts a step needs (`needs`), picks one of a few programs built
with a fixed set of FEATURES (`sample(..., features=...)`): the parts in the set always run, those
outside it never do, and no cond is left. Which sets are built is pallas_kernels.tuning's choice
(`SAMPLER_PROGRAMS`: on a CPU, `mixed`, the argmax alone for steps that need nothing more and the
cond program for the rest). A variant's outputs equal the cond program's for every step it covers.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

# The parts of the sampler a step may need (`needs`), as the host sees them in the step's rows:
SAMPLE = "sample"  # some row has temperature > 0
FILTER = "filter"  # some sampled row has top_k, top_p or min_p
LOGPROBS = "logprobs"  # some row asks for logprobs
ADJUST = "adjust"  # some row has penalties (or min_tokens), a logit_bias or a token mask
FEATURES = frozenset((SAMPLE, FILTER, LOGPROBS, ADJUST))


def needs(temperature, top_k, top_p, min_p, num_logprobs, adjusted: bool) -> frozenset[str]:
    """FEATURES a step's sampler must run, from its S rows' fields (numpy, padding rows neutral) and
    whether any row has penalties, a logit_bias or a token mask: the host-side twins of the
    predicates the cond program computes on the device."""
    sampled = temperature > 0
    out = set()
    if sampled.any():
        out.add(SAMPLE)
        if (sampled & ((top_k > 0) | (top_p < 1.0) | (min_p > 0))).any():
            out.add(FILTER)
    if (num_logprobs >= 0).any():
        out.add(LOGPROBS)
    if adjusted:
        out.add(ADJUST)
    return frozenset(out)


@dataclass
class SamplerOutput:
    """Host copy of one step's sampling results, rows in batch order (S rows, padding included)."""

    sampled: np.ndarray  # i32[S]
    logprob: np.ndarray  # f32[S]    logprob of the sampled token (if any row asked)
    rank: np.ndarray  # i32[S]       1 = the most likely token
    top_ids: np.ndarray  # i32[S, k] top-k alternatives, k = max_logprobs
    top_logprobs: np.ndarray  # f32[S, k]

    @classmethod
    def unpack(cls, ints: np.ndarray, floats: np.ndarray, S: int, k: int) -> SamplerOutput:
        return cls(sampled=ints[:S], rank=ints[S : 2 * S], top_ids=ints[2 * S :].reshape(S, k),
                   logprob=floats[:S], top_logprobs=floats[S:].reshape(S, k))


_ARGMAX_BLOCK = 512
# The cond program's filters never sort a row (XLA:CPU's sort of [S, V] is far too slow). They
# read each row's FILTER_TOP largest logits (lax.top_k) when those hold every sampled row's top-k and
# nucleus (top-p), else bisect for the thresholds over whole rows, a few times the cost of that
# top_k (docs/PERFORMANCE.md, "Decisions in the code"). The demo model's nucleus at top_p 0.95 is a
# few tokens at temperature 0.7, past 256 in one position of six at temperature 1.0, and random
# prompts' are wider still.
FILTER_TOP = 256
_BISECT_STEPS = 32  # int32 keys: each step halves the range, so 32 end on one value


def argmax_rows(x):
    """jnp.argmax(x, axis=-1) as i32[S] (first index on ties; NaN rows excepted), in two levels: the max of
    each block of 512 columns, then the argmax inside the winning block: XLA:CPU's one-pass argmax
    (a variadic reduce) is an order of magnitude slower than plain max reductions (docs/PERFORMANCE.md, "Decisions in the code")."""
    S, V = x.shape
    B = _ARGMAX_BLOCK
    if V <= B:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    pad = (-V) % B
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    xb = x.reshape(S, -1, B)
    # The first block holding the row's maximum. A row with NaN logits (a broken model) gets some
    # token of the block the max reduction picks: finding NaN first would cost another pass over
    # [S, V] every step, and jnp.argmax's answer, the NaN's index, is no better.
    blk = jnp.argmax(xb.max(axis=-1), axis=-1)
    inner = jnp.argmax(jnp.take_along_axis(xb, blk[:, None, None], axis=1)[:, 0], axis=-1)
    return (blk * B + inner).astype(jnp.int32)


def _kept_by_top_k(top_k, V: int):
    """Tokens each row's top-k keeps: i32[S], V where top-k is off (0 or -1) or wider than V."""
    return jnp.where(top_k > 0, jnp.minimum(top_k, V), V)


def _min_p_threshold(mx, t, min_p):
    """min_p keeps p >= min_p * p_max, i.e. logits / t >= max / t + log(min_p): mx f32[S, 1] the
    rows' largest logits -> f32[S, 1], -inf where min_p is off."""
    return jnp.where(min_p[:, None] > 0, mx + (t * jnp.log(jnp.maximum(min_p, 1e-38)))[:, None], -jnp.inf)


def _threshold(logits, t, top_k, top_p, min_p):
    """The lowest logit each row keeps under its top-k, top-p and min-p at temperature t: logits
    f32[S, V], t f32[S] -> f32[S, 1]. The thresholds are the rows' own logits (min-p's excepted), not
    logits / t, so a filter that keeps one token keeps exactly the argmax."""
    _S, V = logits.shape
    srt = -jnp.sort(-logits, axis=-1)  # descending
    k = _kept_by_top_k(top_k, V)
    kth = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)
    srt_k = jnp.where(jnp.arange(V)[None, :] < k[:, None], srt / t[:, None], -jnp.inf)
    probs = jax.nn.softmax(srt_k, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability mass ranked above each token
    n_keep = jnp.maximum(jnp.sum(before < top_p[:, None], axis=-1), 1)
    # top_p = 1 is off: float32's cumulative sum reaches 1.0 before the last kept ranks of a peaked row
    pth = jnp.where((top_p < 1.0)[:, None], jnp.take_along_axis(srt, (n_keep - 1)[:, None], axis=-1), -jnp.inf)
    return jnp.maximum(jnp.maximum(kth, pth), _min_p_threshold(srt[:, :1], t, min_p))


def _threshold_top(logits, t, top_k, top_p, min_p):
    """_threshold from each row's FILTER_TOP largest logits (lax.top_k), without sorting the row, and
    whether that was enough for each row: bool[S]. It is where the row's top-k is at most FILTER_TOP,
    or top-k is off and its nucleus (top-p) ends within them (or top-p is off); min-p needs only the
    maximum. The softmax's normaliser over the kept ranks then comes from the whole row (top-k off)
    or from the ranks themselves. A row whose top_k is over FILTER_TOP, or whose nucleus is wider,
    is not covered."""
    _S, V = logits.shape
    K = min(FILTER_TOP, V)
    # f32[S, K], descending. XLA:CPU runs top_k as its TopK kernel only while the sort it lowers to
    # has the one slice as its user; reading top's first column let the simplifier slice the sort a
    # second time, and the whole row was sorted. The barrier keeps top_k whole.
    top = jax.lax.optimization_barrier(jax.lax.top_k(logits, K)[0])
    k = _kept_by_top_k(top_k, V)
    ranks = jnp.arange(K)[None, :]
    in_k = ranks < k[:, None]
    kth = jnp.where((k <= K)[:, None], jnp.take_along_axis(top, (jnp.minimum(k, K) - 1)[:, None], axis=-1), -jnp.inf)
    mx = top[:, :1]
    e_top = jnp.where(in_k, jnp.exp((top - mx) / t[:, None]), 0.0)
    z = jnp.where(k >= V, jnp.sum(jnp.exp((logits - mx) / t[:, None]), axis=-1), jnp.sum(e_top, axis=-1))
    probs = e_top / z[:, None]
    mass = jnp.cumsum(probs, axis=-1)
    n_keep = jnp.maximum(jnp.sum(in_k & (mass - probs < top_p[:, None]), axis=-1), 1)
    p_on = top_p < 1.0
    pth = jnp.where(p_on[:, None], jnp.take_along_axis(top, (n_keep - 1)[:, None], axis=-1), -jnp.inf)
    covered = (k <= K) | ((k >= V) & (~p_on | (mass[:, -1] >= top_p)))
    return jnp.maximum(jnp.maximum(kth, pth), _min_p_threshold(mx, t, min_p)), covered


def _order_key(x):
    """float32 -> int32 in the same order (-0.0 just below +0.0)."""
    b = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(b < 0, b ^ jnp.int32(0x7FFFFFFF), b)


def _from_key(k):
    return jax.lax.bitcast_convert_type(jnp.where(k < 0, k ^ jnp.int32(0x7FFFFFFF), k), jnp.float32)


def _least_key(lo, hi, ok):
    """Per row, the least int32 key c in (lo, hi] with ok(c), for ok false at lo and true from some
    key on (monotone): bisection."""
    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # (lo + hi) // 2 without overflowing int32
        good = ok(mid)
        return jnp.where(good, lo, mid), jnp.where(good, mid, hi)

    return jax.lax.fori_loop(0, _BISECT_STEPS, halve, (lo, hi))[1]


def _threshold_bisect(logits, t, top_k, top_p, min_p):
    """_threshold without sorting: the top-k threshold is the least logit with fewer than k logits
    above it, the top-p one the least with less than top_p of the (top-k) mass above it, each found
    by bisection over the logits' order keys. Only the summation order of the mass differs from the
    sort's, so a token at the nucleus' edge may fall the other way by rounding."""
    _S, V = logits.shape
    keys = _order_key(logits)
    mx = jnp.max(logits, axis=-1, keepdims=True)
    lo, hi = _order_key(jnp.min(logits, axis=-1)) - 1, keys.max(axis=-1)
    k = _kept_by_top_k(top_k, V)
    kth = _from_key(_least_key(lo, hi, lambda c: jnp.sum(keys > c[:, None], axis=-1) < k))[:, None]
    e = jnp.where(logits >= kth, jnp.exp((logits - mx) / t[:, None]), 0.0)
    z = jnp.sum(e, axis=-1)
    pc = _least_key(lo, hi, lambda c: jnp.sum(jnp.where(keys > c[:, None], e, 0.0), axis=-1) < top_p * z)
    pth = jnp.where((top_p < 1.0)[:, None], _from_key(pc)[:, None], -jnp.inf)
    return jnp.maximum(jnp.maximum(kth, pth), _min_p_threshold(mx, t, min_p))


def _threshold_cond(logits, t, top_k, top_p, min_p, do_sample):
    """The filters' thresholds for the cond program: _threshold_top's where it covers every sampled
    row, else _threshold_bisect's. Neither sorts a row (docs/PERFORMANCE.md, "Decisions in the code")."""
    thr, covered = _threshold_top(logits, t, top_k, top_p, min_p)
    return jax.lax.cond(jnp.all(covered | ~do_sample), lambda: thr,
                        lambda: _threshold_bisect(logits, t, top_k, top_p, min_p))


def with_pending(ids, counts, num, pending):
    """The penalty tables with each row's pending token folded in as the host folds a token it has
    read: one more output of that token, a new entry if the table lacks it. ids i32[S, W], counts
    f32[S, W], num i32[S], pending i32[S] (-1: none) -> (ids, counts, num). A MASKED entry stays
    masked (the host masks after counting)."""
    W = ids.shape[1]
    col = jnp.arange(W)[None, :]
    tok = pending[:, None]
    hit = (col < num[:, None]) & (ids == tok) & (tok >= 0)
    counts = jnp.where(hit & (counts >= 0), counts + 1.0, counts)
    new = (pending >= 0) & ~jnp.any(hit, axis=-1) & (num < W)  # the host refuses what could not fit
    at = new[:, None] & (col == num[:, None])
    return jnp.where(at, tok, ids), jnp.where(at, 1.0, counts), num + new.astype(num.dtype)


def _penalised(batch):
    """Whether some row has a penalty table: entries, or a pending token for an empty one (a
    request whose only output so far is pending)."""
    some = jnp.any(batch.penalty_num > 0)
    return some if batch.pending_token is None else some | jnp.any(batch.pending_token >= 0)


def penalty_updates(logits, batch):
    """vLLM's repetition, frequency and presence penalties and min_tokens masking, in that order, over
    each row's token table: (ids i32[S, W], new logits f32[S, W]) to scatter; ids V mean no entry."""
    S, V = logits.shape
    W = batch.penalty_ids.shape[1]
    table, count, num = batch.penalty_ids, batch.penalty_counts, batch.penalty_num
    if batch.pending_token is not None:  # overlapped scheduling: the token the host has not read yet
        table, count, num = with_pending(table, count, num, batch.pending_token)
    valid = jnp.arange(W)[None, :] < num[:, None]
    ids = jnp.where(valid, table, V)  # V is out of range: gathered as 0, never scattered
    rows = jnp.arange(S)[:, None]
    x = logits.at[rows, ids].get(mode="fill", fill_value=0.0)  # [S, W]
    rep = jnp.where(batch.repetition_penalty > 0, batch.repetition_penalty, 1.0)[:, None]
    x = jnp.where(x > 0, x / rep, x * rep)
    seen = jnp.maximum(count, 0.0)
    x = x - batch.frequency_penalty[:, None] * seen - batch.presence_penalty[:, None] * (seen > 0)
    x = jnp.where(count < 0, -jnp.inf, x)  # MASKED: min_tokens not reached
    return ids.astype(jnp.int32), x


def apply_penalties(logits, batch):
    """penalty_updates applied: logits f32[S, V] -> f32[S, V]. The updates come out of a lax.cond
    and are scattered after it, so a step where no row has penalties pays only for an [S, W]
    scatter of dropped entries (a cond that returned the logits would copy all [S, V] of them in
    its identity branch, every step; docs/PERFORMANCE.md, "Decisions in the code")."""
    S, V = logits.shape
    W = batch.penalty_ids.shape[1]

    def none(_logits):
        return jnp.full((S, W), V, jnp.int32), jnp.zeros((S, W), logits.dtype)

    ids, x = jax.lax.cond(_penalised(batch), lambda lg: penalty_updates(lg, batch), none, logits)
    return logits.at[jnp.arange(S)[:, None], ids].set(x.astype(logits.dtype), mode="drop")


def apply_logit_bias(logits, batch):
    """Add each row's logit_bias entries: logits f32[S, V] -> f32[S, V]. Entries with id V (no
    entry) are dropped by the scatter."""
    if batch.bias_ids is None:
        return logits
    S = logits.shape[0]
    return logits.at[jnp.arange(S)[:, None], batch.bias_ids].add(batch.bias_values.astype(logits.dtype), mode="drop")


def apply_token_mask(logits, token_mask):
    """Disallowed tokens to -inf: logits f32[S, V], token_mask i32[S, VW] -> f32[S, V]."""
    S, V = logits.shape
    VW = token_mask.shape[1]
    bits = (token_mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)[None, None, :]) & 1
    return jnp.where(bits.reshape(S, VW * 32)[:, :V] == 1, logits, -jnp.inf)


def _mix32(h):
    """A 32-bit integer hash (lowbias32): each input bit flips about half of the output bits."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: spreads consecutive output indices before the hash


def row_uniform(seeds, sample_index):
    """u f32[S] in [0, 1), a function of each row's (seed, sample_index) only, so a seeded row draws
    the same whatever its neighbours. 24 bits, so that u is exact in float32 and strictly below 1."""
    h = _mix32(seeds.astype(jnp.uint32) ^ _mix32(sample_index.astype(jnp.uint32) + jnp.uint32(_GOLDEN)))
    return (h >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


def _first_above(cum, target, mass):
    """The first column whose running sum exceeds target: cum, mass f32[S, N], target f32[S] -> i32[S].
    Clamped to the row's last column with mass, for when rounding puts target at or past the total;
    columns without mass never win, as their running sum equals the one before."""
    N = cum.shape[1]
    idx = jnp.sum(cum <= target[:, None], axis=-1)
    last = jnp.max(jnp.where(mass > 0, jnp.arange(N), 0), axis=-1)
    return jnp.minimum(idx, last)


def draw_rows(x, t, thr, u):
    """One draw per row from softmax(x / t) restricted to x >= thr, by inverting its CDF at u:
    x f32[S, V], t f32[S] (> 0), thr f32[S, 1], u f32[S] -> i32[S]. One exp per element and one
    random number per row, where a Gumbel-max draw needs random bits and two logs per element
    (docs/PERFORMANCE.md, "Decisions in the code"). Two levels, as in argmax_rows: the block of 512
    columns whose running mass passes u * total, then the column inside it, whose probabilities are
    computed again from that block's logits, since keeping all [S, V] of them for the second level
    would write and read them through memory."""
    S, V = x.shape
    B = _ARGMAX_BLOCK
    m = x.max(axis=-1, keepdims=True)  # exp(x - m) of the max is 1: every row's total is >= 1
    pad = (-V) % B
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    xb = x.reshape(S, -1, B)
    inv_t = 1.0 / t[:, None]  # temperature goes into the exp: logits / t is never stored

    def prob(xs, m, inv_t, thr):
        return jnp.where(xs >= thr, jnp.exp((xs - m) * inv_t), 0.0)

    mass = prob(xb, m[:, :, None], inv_t[:, :, None], thr[:, :, None]).sum(axis=-1)  # [S, V / 512]
    cum = jnp.cumsum(mass, axis=-1)
    target = u * cum[:, -1]
    blk = _first_above(cum, target, mass)
    inner = prob(jnp.take_along_axis(xb, blk[:, None, None], axis=1)[:, 0], m, inv_t, thr)  # [S, 512]
    before = jnp.take_along_axis(cum - mass, blk[:, None], axis=-1)[:, 0]
    # the two levels sum in different orders: a remainder rounded below zero must not pick a
    # massless leading column
    col = _first_above(jnp.cumsum(inner, axis=-1), jnp.maximum(target - before, 0.0), inner)
    return (blk * B + col).astype(jnp.int32)


def _need_filter(batch, do_sample):
    return jnp.any(do_sample & ((batch.top_k > 0) | (batch.top_p < 1.0) | (batch.min_p > 0)))


def _choose(logits, batch):
    """The token of each row: the argmax for greedy rows, a draw from the filtered softmax for the others."""
    do_sample = batch.temperature > 0

    def draw(_):
        t = jnp.where(do_sample, batch.temperature, 1.0)
        need_filter = _need_filter(batch, do_sample)
        # the cond gives thresholds, not filtered logits: a branch returning its input unchanged
        # would copy all [S, V] of them every sampled step
        thr = jax.lax.cond(need_filter, _threshold_cond, lambda x, *_: jnp.full((x.shape[0], 1), -jnp.inf, x.dtype),
                           logits, t, batch.top_k, batch.top_p, batch.min_p, do_sample)
        drawn = draw_rows(logits, t, thr, row_uniform(batch.seeds, batch.sample_index))
        # a step whose rows all sample (a served run at the default temperature) skips the argmax
        greedy = jax.lax.cond(jnp.all(do_sample), lambda: drawn, lambda: argmax_rows(logits))
        return jnp.where(do_sample, drawn, greedy)

    return jax.lax.cond(jnp.any(do_sample), draw, lambda _: argmax_rows(logits), None)


def _choose_fixed(logits, batch, features: frozenset[str]):
    """_choose without a cond: the draw (and its filters) only in a variant with SAMPLE (FILTER),
    computed for every row and kept where the row samples. The thresholds are kept only where
    _choose would compute them (some row filters), so that the draws are the same."""
    greedy = argmax_rows(logits)
    if SAMPLE not in features:
        return greedy
    do_sample = batch.temperature > 0
    t = jnp.where(do_sample, batch.temperature, 1.0)
    thr = jnp.full((logits.shape[0], 1), -jnp.inf, logits.dtype)
    if FILTER in features:
        thr = jnp.where(_need_filter(batch, do_sample),
                        _threshold(logits, t, batch.top_k, batch.top_p, batch.min_p), thr)
    drawn = draw_rows(logits, t, thr, row_uniform(batch.seeds, batch.sample_index))
    return jnp.where(do_sample, drawn, greedy)


def _adjust_fixed(logits, batch):
    """Penalties, logit_bias and the token masks without a cond, to every row: rows without them have
    neutral entries (ids V, dropped; masks of all ones, as the packer and the idle tables leave them)."""
    S = logits.shape[0]
    ids, x = penalty_updates(logits, batch)
    logits = logits.at[jnp.arange(S)[:, None], ids].set(x.astype(logits.dtype), mode="drop")
    logits = apply_logit_bias(logits, batch)
    if batch.token_mask is not None:
        logits = apply_token_mask(logits, batch.token_mask)
    return logits


def sample(logits, batch, max_logprobs: int, features: frozenset[str] | None = None):
    """logits f32[S, V] -> (ints i32[S * (2 + k)], floats f32[S * (1 + k)]), packed for one copy each.
    features None: one program for every step, its costly parts under lax.cond. A subset of FEATURES:
    only those parts, without a cond; right for the steps whose `needs` it contains."""
    S, V = logits.shape
    raw = logits
    k = max_logprobs
    if features is not None:
        unknown = set(features) - FEATURES
        if unknown:
            raise ValueError(f"unknown sampler features {sorted(unknown)}; known: {sorted(FEATURES)}")
        adjusted = _adjust_fixed(logits, batch) if ADJUST in features else logits
        sampled = _choose_fixed(adjusted, batch, features)
        if LOGPROBS in features:
            outs = _logprobs(raw, sampled, k)
            wanted = jnp.any(batch.num_logprobs >= 0)
            outs = tuple(jnp.where(wanted, x, jnp.zeros_like(x)) for x in outs)
        else:
            outs = _no_logprobs(S, k)
        return _packed(sampled, *outs)

    def adjusted(logits):
        logits = apply_logit_bias(apply_penalties(logits, batch), batch)
        if batch.token_mask is None:
            return _choose(logits, batch)
        return jax.lax.cond(jnp.any(batch.masked > 0),
                            lambda lg: _choose(apply_token_mask(lg, batch.token_mask), batch),
                            lambda lg: _choose(lg, batch), logits)

    # Penalties and logit_bias scatter into the logits, and the logprobs below still read the raw
    # ones, so the scatters copy all [S, V] of them: a step where no row needs them skips both
    # (docs/PERFORMANCE.md, "Decisions in the code").
    plain = ~_penalised(batch) & jnp.all(batch.masked <= 0)
    if batch.bias_ids is not None:
        plain = plain & jnp.all(batch.bias_ids >= V)
    sampled = jax.lax.cond(plain, lambda lg: _choose(lg, batch), adjusted, logits)

    outs = jax.lax.cond(jnp.any(batch.num_logprobs >= 0), lambda _: _logprobs(raw, sampled, k),
                        lambda _: _no_logprobs(S, k), None)
    return _packed(sampled, *outs)


def _logprobs(raw, sampled, k: int):
    """(sampled token's logprob f32[S], its rank i32[S], top-k ids i32[S, k], their logprobs f32[S, k])
    of the raw logits f32[S, V]."""
    S = raw.shape[0]
    lp = jax.nn.log_softmax(raw, axis=-1)
    chosen = jnp.take_along_axis(raw, sampled[:, None], axis=-1)
    rank = (jnp.sum(raw > chosen, axis=-1) + 1).astype(jnp.int32)
    slp = jnp.take_along_axis(lp, sampled[:, None], axis=-1)[:, 0]
    if k:
        top_lp, top_ids = jax.lax.top_k(lp, k)
    else:
        top_lp, top_ids = jnp.zeros((S, 0), jnp.float32), jnp.zeros((S, 0), jnp.int32)
    return slp, rank, top_ids.astype(jnp.int32), top_lp


def _no_logprobs(S: int, k: int):
    return (jnp.zeros((S,), jnp.float32), jnp.zeros((S,), jnp.int32), jnp.zeros((S, k), jnp.int32),
            jnp.zeros((S, k), jnp.float32))


def _packed(sampled, slp, rank, top_ids, top_lp):
    return jnp.concatenate([sampled, rank, top_ids.reshape(-1)]), jnp.concatenate([slp, top_lp.reshape(-1)])
