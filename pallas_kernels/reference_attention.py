"""The "reference" attention backend: the plain, obviously-correct version every other backend is
tested against. Per token, gather its sequence's whole context and run a dense masked softmax.

Same arguments and result as pallas_kernels.paged_attention (see its docstring for shapes), with K
pages [P, H]. Memory is O(T * M * P), so it is for tests only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.pool_storage import pool_values
from pallas_kernels.softcap import soft_cap

_NEG_INF = -1e30  # finite, so a fully masked row gives exp(0 - 0) rather than NaN


def token_rows(query_start_loc, num_seqs, T):
    """For each token, its sequence row and whether it is a real token. i32[T], bool[T]."""
    t = jnp.arange(T, dtype=jnp.int32)
    row = jnp.searchsorted(query_start_loc, t, side="right").astype(jnp.int32) - 1
    row = jnp.clip(row, 0, query_start_loc.shape[0] - 2)
    real = t < query_start_loc[num_seqs[0]]
    return row, real


def reference_attention(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc, num_seqs,
                        *, sm_scale: float, window=None, softcap: float | None = None):
    T, N, H = q.shape
    _, _, K, P, _ = k_cache.shape
    M = block_tables.shape[1]
    G = N // K
    row, real = token_rows(query_start_loc, num_seqs, T)
    q_len = query_start_loc[row + 1] - query_start_loc[row]
    # position of each token in its sequence: the chunk ends at seq_len
    q_pos = seq_lens[row] - q_len + (jnp.arange(T) - query_start_loc[row])
    blocks = block_tables[row]  # [T, M]
    k = k_cache[layer, blocks]  # [T, M, K, P, H]
    v = v_cache[layer, blocks]
    k = pool_values(k.transpose(0, 2, 1, 3, 4).reshape(T, K, M * P, H))
    v = pool_values(v.transpose(0, 2, 1, 3, 4).reshape(T, K, M * P, H))
    qg = q.reshape(T, K, G, H).astype(jnp.float32)
    s = soft_cap(jnp.einsum("tkgh,tkch->tkgc", qg, k) * sm_scale, softcap)
    kv_pos = jnp.arange(M * P)
    mask = (kv_pos[None, :] <= q_pos[:, None]) & real[:, None]
    if window is not None:  # sliding window: the last `window` positions up to the query's own
        mask &= kv_pos[None, :] > q_pos[:, None] - window
    s = jnp.where(mask[:, None, None, :], s, _NEG_INF)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("tkgc,tkch->tkgh", p, v).reshape(T, N, H)
    return jnp.where(real[:, None, None], o, 0).astype(q.dtype)
