"""The "xla" attention backend: ragged paged attention in plain jnp, organised for XLA:CPU.

Same arguments and result as pallas_kernels.paged_attention (see its docstring for shapes), except
that K pages are stored transposed: k_cache is f[L, NB, K, H, P] (backends.py says why).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import tuning
from pallas_kernels.pool_storage import pool_values
from pallas_kernels.softcap import soft_cap

_NEG_INF = -1e30  # finite, so a fully masked row gives exp(0 - 0) rather than NaN


# ---------------------------------------------------------------------------------------------------
# The XLA path. XLA:CPU runs small batched dots and gathers slowly per call, so work is organised to
# make each call large and to never materialise a sequence's whole context:
#   decode rows (one query): rows sorted by context length and cut into a few groups, each group's
#     rows at once in its own loop over KV chunks (online softmax), up to the group's longest row;
#   prefill rows (several queries): split into query tiles of Qb tokens of one sequence, processed
#     a group of tiles at a time, each tile looping over KV chunks up to its own causal limit.
# Each path runs under lax.cond only when the step has such rows, and every loop's trip count is
# a real length of the step, so padding rows cost no attention work.
# ---------------------------------------------------------------------------------------------------
def _online_softmax_update(carry, s, v_chunk, pv_einsum):
    """One KV chunk of flash-style attention. s: scores with the chunk axis last (masked)."""
    m, l, acc = carry
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.exp(s - m_new[..., None])
    corr = jnp.exp(m - m_new)
    l = l * corr + p.sum(axis=-1)
    acc = acc * corr[..., None] + jnp.einsum(pv_einsum, p, v_chunk)
    return m_new, l, acc


def _chunk_kv(cache, layer, block_tables_rows, j, bpc, pages_transposed=False):
    """KV of chunk j (bpc blocks) for each row in float32: f[R, K, bpc * P, H], or f[R, K, H, bpc * P]
    from a pool of transposed pages."""
    blocks = jax.lax.dynamic_slice_in_dim(block_tables_rows, j * bpc, bpc, axis=1)  # [R, bpc]
    x = cache[layer, blocks]  # [R, bpc, K, P, H] or [R, bpc, K, H, P]
    R, _, K, A, B = x.shape
    if pages_transposed:
        return pool_values(x.transpose(0, 2, 3, 1, 4).reshape(R, K, A, bpc * B))
    return pool_values(x.transpose(0, 2, 1, 3, 4).reshape(R, K, bpc * A, B))


def _first_chunk(lo, used, C):
    """The first KV chunk of C positions any of these reads needs: positions from lo on (where used)."""
    return jnp.min(jnp.where(used, lo, jnp.iinfo(jnp.int32).max)) // C


def _decode_rows(q_rows, k_cache, v_cache, layer, bt, kv_lens, sm_scale, bpc, window=None, softcap=None):
    """Single-query attention for every row. q_rows f[S, N, H]; bt: their block tables, padded to
    whole chunks of bpc blocks (StepMeta); rows with kv_len 0 give zeros. window: each row reads its
    last `window` positions only, from the first chunk that holds one of them (None: all)."""
    S, N, H = q_rows.shape
    _, _, K, P, _ = v_cache.shape
    G = N // K
    C = bpc * P
    qg = q_rows.reshape(S, K, G, H).astype(jnp.float32) * sm_scale
    n_chunks = (jnp.max(kv_lens) + C - 1) // C
    first = 0
    if window is not None:
        lo = jnp.maximum(kv_lens - window, 0)  # each row's first position read
        first = jnp.minimum(_first_chunk(lo, kv_lens > 0, C), n_chunks)

    def body(j, carry):
        # The gathered pages stay [S, bpc, K, H, P] / [S, bpc, K, P, H]: contracting in that layout
        # skips a transpose copy to [S, K, C, H] (decode is bound by moving K/V, not by math).
        blocks = jax.lax.dynamic_slice_in_dim(bt, j * bpc, bpc, axis=1)  # [S, bpc]
        k = pool_values(k_cache[layer, blocks])
        v = pool_values(v_cache[layer, blocks])
        s = soft_cap(jnp.einsum("skgh,sbkhp->skgbp", qg, k).reshape(S, K, G, C), softcap)
        pos = j * C + jnp.arange(C)
        seen = pos[None, :] < kv_lens[:, None]
        if window is not None:
            seen &= pos[None, :] >= lo[:, None]
        s = jnp.where(seen[:, None, None, :], s, _NEG_INF)
        m, l, acc = carry
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        pv = jnp.einsum("skgbp,sbkph->skgh", p.reshape(S, K, G, bpc, P), v)
        return m_new, l * corr + p.sum(axis=-1), acc * corr[..., None] + pv

    init = (jnp.full((S, K, G), _NEG_INF, jnp.float32), jnp.zeros((S, K, G), jnp.float32),
            jnp.zeros((S, K, G, H), jnp.float32))
    _, l, acc = jax.lax.fori_loop(first, n_chunks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(S, N, H)


def _prefill_tiles(q, k_cache, v_cache, layer, bt, seq_lens, query_start_loc, is_prefill,
                   out, sm_scale, q_tile, tiles_per_group, bpc, window=None, softcap=None):
    """Causal attention for rows with several queries, in tiles of q_tile tokens of one sequence.
    bt: the block tables padded to whole chunks of bpc blocks (StepMeta). window: each query reads
    its last `window` positions only, each group of tiles from the first chunk one of them needs."""
    T, N, H = q.shape
    _, _, K, P, _ = v_cache.shape
    S = bt.shape[0]
    G = N // K
    C = bpc * P
    Qb, GT = q_tile, tiles_per_group
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    n_tiles = jnp.where(is_prefill, (q_lens + Qb - 1) // Qb, 0)
    tile_end = jnp.cumsum(n_tiles)  # [S]
    total_tiles = tile_end[-1]

    def group(g, out):
        w = g * GT + jnp.arange(GT)  # tile ids of this group
        row = jnp.clip(jnp.searchsorted(tile_end, w, side="right"), 0, S - 1).astype(jnp.int32)
        first_tok = (w - (tile_end[row] - n_tiles[row])) * Qb  # tile's first token within its chunk
        count = jnp.where(w < total_tiles, jnp.clip(q_lens[row] - first_tok, 0, Qb), 0)
        tok = query_start_loc[row][:, None] + first_tok[:, None] + jnp.arange(Qb)[None, :]  # [GT, Qb]
        tok_ok = jnp.arange(Qb)[None, :] < count[:, None]
        ctx_start = seq_lens[row] - q_lens[row]  # tokens cached before this step's chunk
        q_pos = ctx_start[:, None] + first_tok[:, None] + jnp.arange(Qb)[None, :]  # [GT, Qb]
        kv_len = jnp.where(count > 0, ctx_start + first_tok + count, 0)  # causal limit of each tile
        qt = q[jnp.clip(tok, 0, T - 1)].astype(jnp.float32) * sm_scale  # [GT, Qb, N, H]
        qt = qt.reshape(GT, Qb, K, G, H).transpose(0, 2, 3, 1, 4).reshape(GT, K, G * Qb, H)
        rows_bt = bt[row]
        q_pos_g = jnp.broadcast_to(q_pos[:, None, :], (GT, G, Qb)).reshape(GT, 1, G * Qb, 1)

        def body(j, carry):
            k = _chunk_kv(k_cache, layer, rows_bt, j, bpc, pages_transposed=True)  # [GT, K, H, C]
            v = _chunk_kv(v_cache, layer, rows_bt, j, bpc)  # [GT, K, C, H]
            s = soft_cap(jnp.einsum("tkqh,tkhc->tkqc", qt, k), softcap)
            kv_pos = (j * C + jnp.arange(C)).reshape(1, 1, 1, C)
            seen = kv_pos <= q_pos_g
            if window is not None:
                seen &= kv_pos > q_pos_g - window
            s = jnp.where(seen, s, _NEG_INF)
            return _online_softmax_update(carry, s, v, "tkqc,tkch->tkqh")

        init = (jnp.full((GT, K, G * Qb), _NEG_INF, jnp.float32), jnp.zeros((GT, K, G * Qb), jnp.float32),
                jnp.zeros((GT, K, G * Qb, H), jnp.float32))
        n_chunks = (jnp.max(kv_len) + C - 1) // C
        # a tile's first query reads from (its position - window) on: the group's earliest such chunk
        first = 0 if window is None else jnp.minimum(
            _first_chunk(jnp.maximum(ctx_start + first_tok - window + 1, 0), count > 0, C), n_chunks)
        _, l, acc = jax.lax.fori_loop(first, n_chunks, body, init)
        o = acc / jnp.where(l > 0, l, 1.0)[..., None]
        o = o.reshape(GT, K, G, Qb, H).transpose(0, 3, 1, 2, 4).reshape(GT * Qb, N, H)
        dest = jnp.where(tok_ok, tok, T).reshape(-1)  # T is out of range: dropped
        return out.at[dest].set(o.astype(out.dtype), mode="drop")

    return jax.lax.fori_loop(0, (total_tiles + GT - 1) // GT, group, out)


def _row_groups(S: int, most: int) -> int:
    """Decode row groups for S rows: as many as `most` while each keeps at least 8 rows."""
    return max(1, min(most, S // 8))


class StepMeta(NamedTuple):
    """What every layer's call needs from the step's metadata alone, computed once a step (prepare)
    outside the layer loop: the block table padded to whole chunks, the rows' kinds, and the decode
    rows' order with their tables and lengths in it."""

    bt: jax.Array  # i32[S, M'] the block table padded to whole chunks of either path
    is_decode: jax.Array  # bool[S]
    is_prefill: jax.Array  # bool[S]
    order: jax.Array  # i32[S] decode rows longest first (then every other row)
    dec_bt: jax.Array  # i32[S, M'] bt in that order
    dec_lens: jax.Array  # i32[S] a decode row's length in that order, 0 for the others


def prepare(T: int, N: int, K: int, H: int, P: int, block_tables, seq_lens, query_start_loc, num_seqs) -> StepMeta:
    """The step's StepMeta (AttentionBackend.prepare's arguments)."""
    S, M = block_tables.shape
    cfg = tuning.xla_cpu_config(P)
    chunk = math.lcm(cfg.decode_kv_blocks, cfg.prefill_kv_blocks)
    bt = jnp.pad(block_tables, ((0, 0), (0, (-M) % chunk)))  # every chunk's dynamic slice stays in range
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    real_row = jnp.arange(S) < num_seqs[0]
    is_decode = real_row & (q_lens == 1)
    kv_lens = jnp.where(is_decode, seq_lens, 0)
    # Rows sorted longest first, then cut into groups of consecutive rows, each its own loop (decode
    # below): a loop runs to its own longest row, so short rows stop costing gathers of padding pages,
    # and XLA:CPU runs independent loops on separate threads. Padding and prefill rows have kv_len 0,
    # so they sort to the end.
    order = jnp.argsort(-kv_lens) if _row_groups(S, cfg.decode_row_groups) > 1 else jnp.arange(S)
    return StepMeta(bt, is_decode, real_row & (q_lens > 1), order, bt[order], kv_lens[order])


def xla_attention(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc, num_seqs,
                  *, sm_scale: float, meta: StepMeta | None = None, window=None, softcap: float | None = None):
    """meta: the step's StepMeta (prepare), computed once for all layers; None computes it here.
    window: sliding-window attention (paged_attention's docstring); the chunks before a read's
    window are not gathered. softcap: Gemma 2's score soft-capping (softcap.py)."""
    T, N, H = q.shape
    S = block_tables.shape[0]
    P = v_cache.shape[3]
    cfg = tuning.xla_cpu_config(P)
    if meta is None:
        meta = prepare(T, N, k_cache.shape[2], H, P, block_tables, seq_lens, query_start_loc, num_seqs)
    is_decode, is_prefill = meta.is_decode, meta.is_prefill
    starts = query_start_loc[:-1]

    def decode(out):
        n = _row_groups(S, cfg.decode_row_groups)
        order = meta.order
        rows = starts[order]
        q_rows = q[jnp.clip(rows, 0, T - 1)]
        bt, lens = meta.dec_bt, meta.dec_lens
        R = -(-S // n)  # rows per group; the last group may be smaller (never empty: n <= S // 8)
        o = jnp.concatenate([_decode_rows(q_rows[g * R:(g + 1) * R], k_cache, v_cache, layer,
                                          bt[g * R:(g + 1) * R], lens[g * R:(g + 1) * R], sm_scale,
                                          cfg.decode_kv_blocks, window, softcap) for g in range(n)])
        return out.at[jnp.where(is_decode[order], rows, T)].set(o.astype(out.dtype), mode="drop")

    def prefill(out):
        return _prefill_tiles(q, k_cache, v_cache, layer, meta.bt, seq_lens, query_start_loc,
                              is_prefill, out, sm_scale, cfg.prefill_q_tile, cfg.prefill_tiles_per_group,
                              cfg.prefill_kv_blocks, window, softcap)

    out = jnp.zeros_like(q)
    out = jax.lax.cond(jnp.any(is_decode), decode, lambda o: o, out)
    out = jax.lax.cond(jnp.any(is_prefill), prefill, lambda o: o, out)
    return out
