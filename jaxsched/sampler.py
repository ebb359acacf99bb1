"""On-device sampling, traced into the same jit as the model.

Greedy rows take the argmax. Sampling rows apply temperature, then top-k / top-p / min-p as one
threshold per row, then a Gumbel-max draw whose key is derived from (request seed, output index):
a seeded request gives the same tokens whatever else shares its batch. Each costly part runs under
lax.cond, so an all-greedy step pays only for the argmax and a step without logprobs for none.

Penalties come first, as in vLLM, and apply to greedy and sampled rows alike: repetition_penalty
divides positive and multiplies non-positive logits of every token seen in the prompt or the output;
frequency_penalty * count and presence_penalty * (count > 0) are subtracted over the output tokens;
min_tokens sets EOS and stop_token_ids to -inf until that many tokens were generated. The history
arrives as a per-row table of at most W (engine: max_model_len) distinct token ids with their output
counts (jaxsched/penalties.py says why, and how a request that could outgrow it is refused up front):
a gather and a scatter of [S, W] entries, no [S, V] array crosses to the device. The whole stage
sits under lax.cond, so a step where no row is penalised pays nothing for it.

Then logit_bias (OpenAI's: a value added to chosen tokens' logits, from an [S, LB] table scattered
like the penalties), then the token masks of constrained rows (structured outputs and
allowed_token_ids, jaxsched/grammar.py): an i32[S, VW] bitmask, unpacked on the device, that sets
disallowed tokens to -inf. The mask goes to the token choice (greedy or drawn) inside a lax.cond whose
outputs are the [S] sampled ids, so a step without constrained rows never unpacks it, and no [S, V]
array leaves the cond (a cond returning the logits copies them in its identity branch).

Logprobs are of the model's raw distribution (vLLM's default): the sampled token's logprob and
rank, and the top `max_logprobs` alternatives, before penalties and temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


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


def _threshold(x, top_k, top_p, min_p):
    """The lowest logit each row keeps under its top-k, top-p and min-p: x f32[S, V] (temperature
    applied) -> f32[S, 1]."""
    _S, V = x.shape
    srt = -jnp.sort(-x, axis=-1)  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)
    srt_k = jnp.where(jnp.arange(V)[None, :] < k[:, None], srt, -jnp.inf)
    probs = jax.nn.softmax(srt_k, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability mass ranked above each token
    n_keep = jnp.maximum(jnp.sum(before < top_p[:, None], axis=-1), 1)
    pth = jnp.take_along_axis(srt, (n_keep - 1)[:, None], axis=-1)
    # min_p keeps p >= min_p * p_max, i.e. x >= x_max + log(min_p)
    mth = jnp.where(min_p[:, None] > 0, srt[:, :1] + jnp.log(jnp.maximum(min_p, 1e-38))[:, None], -jnp.inf)
    return jnp.maximum(jnp.maximum(kth, pth), mth)


def penalty_updates(logits, batch):
    """vLLM's repetition, frequency and presence penalties and min_tokens masking, in that order, over
    each row's token table: (ids i32[S, W], new logits f32[S, W]) to scatter; ids V mean no entry."""
    S, V = logits.shape
    W = batch.penalty_ids.shape[1]
    valid = jnp.arange(W)[None, :] < batch.penalty_num[:, None]
    ids = jnp.where(valid, batch.penalty_ids, V)  # V is out of range: gathered as 0, never scattered
    rows = jnp.arange(S)[:, None]
    x = logits.at[rows, ids].get(mode="fill", fill_value=0.0)  # [S, W]
    count = batch.penalty_counts
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

    ids, x = jax.lax.cond(jnp.any(batch.penalty_num > 0), lambda lg: penalty_updates(lg, batch), none, logits)
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


_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: consecutive token ids land far apart before the hash


def gumbel_noise(seeds, sample_index, V: int):
    """Gumbel noise f32[S, V], a function of each row's (seed, sample_index) and the token id only,
    so a seeded row draws the same whatever its neighbours. A counter-based hash per element rather
    than jax.random's threefry, which made a sampled step several times slower than a greedy one
    on a CPU (docs/PERFORMANCE.md, "Decisions in the code")."""
    row = _mix32(seeds.astype(jnp.uint32) ^ _mix32(sample_index.astype(jnp.uint32) + jnp.uint32(_GOLDEN)))
    h = _mix32(row[:, None] ^ (jnp.arange(V, dtype=jnp.uint32) * jnp.uint32(_GOLDEN))[None, :])
    u = ((h >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))  # 24 bits, strictly inside (0, 1)
    return -jnp.log(-jnp.log(u))


def _choose(logits, batch):
    """The token of each row: the argmax for greedy rows, a Gumbel-max draw for the others."""
    V = logits.shape[1]
    greedy = argmax_rows(logits)
    do_sample = batch.temperature > 0

    def draw(_):
        t = jnp.where(do_sample, batch.temperature, 1.0)
        x = logits / t[:, None]
        need_filter = jnp.any(do_sample & ((batch.top_k > 0) | (batch.top_p < 1.0) | (batch.min_p > 0)))
        # the cond gives thresholds, not filtered logits: a branch returning x unchanged would copy
        # all [S, V] of them every sampled step
        thr = jax.lax.cond(need_filter, _threshold, lambda x, *_: jnp.full((x.shape[0], 1), -jnp.inf, x.dtype),
                           x, batch.top_k, batch.top_p, batch.min_p)
        noisy = jnp.where(x >= thr, x + gumbel_noise(batch.seeds, batch.sample_index, V), -jnp.inf)
        return jnp.where(do_sample, argmax_rows(noisy), greedy)

    return jax.lax.cond(jnp.any(do_sample), draw, lambda _: greedy, None)


def sample(logits, batch, max_logprobs: int):
    """logits f32[S, V] -> (ints i32[S * (2 + k)], floats f32[S * (1 + k)]), packed for one copy each."""
    S = logits.shape[0]
    raw = logits
    logits = apply_logit_bias(apply_penalties(logits, batch), batch)
    if batch.token_mask is None:
        sampled = _choose(logits, batch)
    else:
        sampled = jax.lax.cond(jnp.any(batch.masked > 0),
                               lambda lg: _choose(apply_token_mask(lg, batch.token_mask), batch),
                               lambda lg: _choose(lg, batch), logits)

    k = max_logprobs

    def with_logprobs(_):
        lp = jax.nn.log_softmax(raw, axis=-1)
        chosen = jnp.take_along_axis(raw, sampled[:, None], axis=-1)
        rank = (jnp.sum(raw > chosen, axis=-1) + 1).astype(jnp.int32)
        slp = jnp.take_along_axis(lp, sampled[:, None], axis=-1)[:, 0]
        if k:
            top_lp, top_ids = jax.lax.top_k(lp, k)
        else:
            top_lp, top_ids = jnp.zeros((S, 0), jnp.float32), jnp.zeros((S, 0), jnp.int32)
        return slp, rank, top_ids.astype(jnp.int32), top_lp

    def without(_):
        return (jnp.zeros((S,), jnp.float32), jnp.zeros((S,), jnp.int32), jnp.zeros((S, k), jnp.int32),
                jnp.zeros((S, k), jnp.float32))

    slp, rank, top_ids, top_lp = jax.lax.cond(jnp.any(batch.num_logprobs >= 0), with_logprobs, without, None)
    ints = jnp.concatenate([sampled, rank, top_ids.reshape(-1)])
    floats = jnp.concatenate([slp, top_lp.reshape(-1)])
    return ints, floats
