"""Ragged paged attention over the KV block pool: the public wrapper, its checks, and dispatch.

One call serves a whole step: prefill chunks (many query tokens of one sequence, causal within the
chunk and over the cached prefix) and decode tokens (one query per sequence) side by side, with
grouped-query attention, reading K/V through block tables.

Pool layout (AttentionBackend.pool_shapes): k_cache, v_cache are f[L, NB, K, P, H], one page of one
KV head being a contiguous [P, H] tile, which is what a GPU kernel loads per program and what a CPU
gather copies in one piece. The "xla" and "numba" backends keep K pages transposed, k_cache
f[L, NB, K, H, P] (backends.py says why); v_cache is the same for every backend. The layer index is
an argument rather than a slice of the pool because a slice of a donated buffer inside the layer
scan would be copied; indexing inside the gather is not. A bfloat16 pool for the XLA:CPU backends is a uint16 array of the same bits (pool_storage.py says why).

backend: a name in backends.BACKENDS ("pallas", "numba", "xla", "reference"); its record gives the
attend function and the pool layout. The Pallas kernels have extra shape rules (validate_pallas).

Arguments (shape glossary in README.md):
  q                f[T, N, H]   queries of this step's new tokens, rope applied
  k_cache, v_cache f[L, NB, K, P, H] (k_cache f[L, NB, K, H, P] for "xla", "numba")
  layer            i32[]        which layer of the pool
  block_tables     i32[S, M]    blocks of each sequence; unused entries 0 (the null page)
  seq_lens         i32[S]       KV length of each sequence after this step (its new tokens included)
  query_start_loc  i32[S + 1]   where each sequence's tokens start in T; padding rows are empty
  num_seqs         i32[1]       real sequences; rows from it on are padding
  window           i32[] or None  sliding-window attention: a token at position q reads the cached
                                  positions in (q - window, q] only (None: all of them, causal);
                                  every backend skips the blocks outside the window
  softcap          float or None  Gemma 2's score soft-capping, cap * tanh(s / cap) on the scaled
                                  scores (softcap.py); backends whose record says softcap=False refuse it
Returns f[T, N, H]; rows of padding tokens are zero.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import backends
from pallas_kernels.reference_attention import reference_attention

# reference_attention is re-exported: callers that compare against it import it from here
__all__ = ["paged_attention", "reference_attention", "validate"]


def validate(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, backend="xla") -> None:
    """Check shapes and dtypes before tracing; raise ValueError naming the argument."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, N, H], got shape {q.shape}")
    _T, N, H = q.shape
    if v_cache.ndim != 5:
        raise ValueError(f"v_cache must be [L, NB, K, P, H], got shape {v_cache.shape}")
    L, NB, K, P, Hk = v_cache.shape
    record = backends.get(backend)
    k_want = record.pool_shapes(L, NB, K, P, Hk)[0]
    if k_cache.shape != k_want:
        layout = "[L, NB, K, H, P]" if record.k_transposed else "[L, NB, K, P, H]"
        raise ValueError(f"k_cache must be {layout} = {k_want} for backend {backend!r} (v_cache is "
                         f"{v_cache.shape}), got {k_cache.shape}; AttentionBackend.pool_shapes gives both shapes")
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
    pools = (*floats, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.uint16, jnp.uint8)
    if q.dtype not in floats or k_cache.dtype not in pools:
        raise ValueError(f"q ({q.dtype}) must be float32, bfloat16 or float16 and k_cache ({k_cache.dtype}) one "
                         "of those, float8_e4m3fn, float8_e5m2, uint16 (bfloat16 bits) or uint8 (e4m3 bits; "
                         "see pool_storage.py)")


def paged_attention(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc, num_seqs,
                    *, sm_scale: float, backend: str = "xla", meta=None, window=None, softcap: float | None = None):
    """Attention of this step's tokens over their sequences' paged KV. See the module docstring.
    meta: the backend's prepare() of this step (the same for every layer), when the caller has it."""
    record = backends.get(backend)
    if softcap is not None and not record.softcap:
        raise ValueError(f"attention backend {backend!r} has no score soft-capping (softcap={softcap}); "
                         "use backend 'xla' or 'pallas'")
    validate(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, backend)
    extra = {} if meta is None else {"meta": meta}
    if window is not None:
        extra["window"] = window
    if softcap is not None:
        extra["softcap"] = softcap
    return record.attend(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc, num_seqs,
                  sm_scale=sm_scale, **extra)
