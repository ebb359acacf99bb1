"""Ragged paged attention over the KV block pool: public wrapper, validation, and its references.

One call serves a whole step: prefill chunks (many query tokens of one sequence, causal within the
chunk and over the cached prefix) and decode tokens (one query per sequence) side by side, with
grouped-query attention, reading K/V through block tables.

Pool layout (fixed here and in kv_cache.pool_shapes): k_cache, v_cache are f[L, NB, K, P, H], one
page of one KV head being a contiguous [P, H] tile, which is what a GPU kernel loads per program and
what a CPU gather copies in one piece. The "xla" backend keeps K pages transposed, k_cache
f[L, NB, K, H, P] (kv_cache.k_transposed says why); v_cache is the same for every backend. The
layer index is an argument rather than a slice of the pool because a slice of a donated buffer
inside the layer scan would be copied; indexing inside the gather is not.
A bfloat16 pool for the XLA backends is a uint16 array of the same bits (kv_cache.pool_dtype says why).

Backends:
  "xla"       the jnp implementation in xla_attention.py, tuned for XLA:CPU
  "numba"     CPU only: a numba kernel, called through XLA's FFI, that reads pages where they lie
              (numba_attention.py, numba_kernels.py); same pool layout as "xla"
  "reference" the plain, obviously-correct version every other backend is tested against
  "pallas"    the Pallas kernels with the Triton lowering in pallas_attention.py (NVIDIA GPUs; on
              CPU they run in interpret mode, slowly: for tests). Extra rules: head_dim a power of
              two >= 16, block size in pallas_attention.PAGE_SIZES (see validate_pallas).

Arguments (shape glossary in README.md):
  q                f[T, N, H]   queries of this step's new tokens, rope applied
  k_cache, v_cache f[L, NB, K, P, H] (k_cache f[L, NB, K, H, P] for "xla", "numba")
  layer            i32[]        which layer of the pool
  block_tables     i32[S, M]    blocks of each sequence; unused entries 0 (the null page)
  seq_lens         i32[S]       KV length of each sequence after this step (its new tokens included)
  query_start_loc  i32[S + 1]   where each sequence's tokens start in T; padding rows are empty
  num_seqs         i32[1]       real sequences; rows from it on are padding
Returns f[T, N, H]; rows of padding tokens are zero.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kv_cache import k_transposed, pool_shapes, pool_values
from pallas_kernels.pallas_attention import pallas_attention, validate_pallas
from pallas_kernels.xla_attention import xla_attention

BACKENDS = ("xla", "numba", "reference", "pallas")
_NEG_INF = -1e30  # finite, so a fully masked row gives exp(0 - 0) rather than NaN


def validate(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, backend="xla") -> None:
    """Check shapes and dtypes before tracing; raise ValueError naming the argument."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, N, H], got shape {q.shape}")
    _T, N, H = q.shape
    if v_cache.ndim != 5:
        raise ValueError(f"v_cache must be [L, NB, K, P, H], got shape {v_cache.shape}")
    L, NB, K, P, Hk = v_cache.shape
    k_want = pool_shapes(L, NB, K, P, Hk, backend)[0]
    if k_cache.shape != k_want:
        layout = "[L, NB, K, H, P]" if k_transposed(backend) else "[L, NB, K, P, H]"
        raise ValueError(f"k_cache must be {layout} = {k_want} for backend {backend!r} (v_cache is "
                         f"{v_cache.shape}), got {k_cache.shape}; kv_cache.pool_shapes gives both shapes")
    if Hk != H:
        raise ValueError(f"head_dim mismatch: q has H={H}, the KV pool has H={Hk}")
    if N % K:
        raise ValueError(f"query heads N={N} must be a multiple of KV heads K={K}")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [S, M], got shape {block_tables.shape}")
    S = block_tables.shape[0]
    if seq_lens.shape != (S,):
        raise ValueError(f"seq_lens must be [S]=[{S}], got shape {seq_lens.shape}")
    if query_start_loc.shape != (S + 1,):
        raise ValueError(f"query_start_loc must be [S + 1]=[{S + 1}], got shape {query_start_loc.shape}")
    if num_seqs.shape != (1,):
        raise ValueError(f"num_seqs must be [1], got shape {num_seqs.shape}")
    for name, a in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc), ("num_seqs", num_seqs)):
        if a.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {a.dtype}")
    floats = (jnp.float32, jnp.bfloat16, jnp.float16)
    if q.dtype not in floats or (k_cache.dtype not in floats and k_cache.dtype != jnp.uint16):
        raise ValueError(f"q ({q.dtype}) must be float32, bfloat16 or float16 and k_cache ({k_cache.dtype}) one "
                         "of those or uint16 (bfloat16 bits, see kv_cache.pool_dtype)")


def paged_attention(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc, num_seqs,
                    *, sm_scale: float, backend: str = "xla"):
    """Attention of this step's tokens over their sequences' paged KV. See the module docstring."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    validate(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, backend)
    if backend == "pallas":
        validate_pallas(q, k_cache, block_tables)
        return pallas_attention(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc,
                                num_seqs, sm_scale=sm_scale)
    if backend == "numba":
        from pallas_kernels.numba_attention import numba_attention

        return numba_attention(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc,
                               num_seqs, sm_scale=sm_scale)
    if backend == "xla":
        return xla_attention(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc,
                              num_seqs, sm_scale=sm_scale)
    if backend == "reference":
        return reference_attention(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc,
                                   num_seqs, sm_scale=sm_scale)
    raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")


# ---------------------------------------------------------------------------------------------------
# The reference: per token, gather its sequence's whole context and run a dense masked softmax.
# Memory is O(T * M * P), so it is for tests only.
# ---------------------------------------------------------------------------------------------------
def token_rows(query_start_loc, num_seqs, T):
    """For each token, its sequence row and whether it is a real token. i32[T], bool[T]."""
    t = jnp.arange(T, dtype=jnp.int32)
    row = jnp.searchsorted(query_start_loc, t, side="right").astype(jnp.int32) - 1
    row = jnp.clip(row, 0, query_start_loc.shape[0] - 2)
    real = t < query_start_loc[num_seqs[0]]
    return row, real


def reference_attention(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc, num_seqs,
                        *, sm_scale: float):
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
    s = jnp.einsum("tkgh,tkch->tkgc", qg, k) * sm_scale
    kv_pos = jnp.arange(M * P)
    mask = (kv_pos[None, :] <= q_pos[:, None]) & real[:, None]
    s = jnp.where(mask[:, None, None, :], s, _NEG_INF)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("tkgc,tkch->tkgh", p, v).reshape(T, N, H)
    return jnp.where(real[:, None, None], o, 0).astype(q.dtype)


paged_attention_jit = functools.partial(jax.jit, static_argnames=("sm_scale", "backend"))(paged_attention)
