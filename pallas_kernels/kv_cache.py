"""Writing this step's new K/V into the pool by slot mapping.

The pool is donated to the jitted step, so this scatter updates it in place. Padding tokens carry
slot 0 and write into the null page, which no real sequence reads unmasked.

One implementation for every attention backend, on CPU and GPU alike: there is no Pallas kernel for
the write. A step writes 2 * T * K * H elements per layer (1 MiB for T = 256, K = 8, H = 128 in
bf16) where its attention reads every sequence's whole KV (2 GiB for 256 sequences of 2048 tokens),
and XLA:GPU lowers this scatter into the donated pool to one in-place kernel; a Pallas kernel could
at best save that launch. Revisit only if scripts/gpu_check.py shows the write as a visible share
of a step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# ---------------------------------------------------------------------------------------------------
# Storage of a bfloat16 pool. For the XLA backends a bfloat16 pool is kept as uint16 holding the
# same bits: XLA:CPU gathers and converts bfloat16 element by element (a bfloat16 pool made decode
# attention ~7x slower than float32, 84 vs 12 ms per layer at S=128, ctx 400), while a uint16 gather
# is a plain copy and bfloat16 -> float32 is a 16-bit shift that fuses into it (7.6 ms per layer:
# half the bytes of float32 read from memory). The Pallas kernels load bfloat16 tiles natively, so
# their pool stays bfloat16. Everything that reads or writes the pool goes through the two helpers
# below, so both storages hold the same values.
# ---------------------------------------------------------------------------------------------------
_BF16_BITS = jnp.uint16


def pool_dtype(dtype: str, backend: str):
    """The array dtype of a pool of `dtype` ("float32" / "bfloat16") for an attention backend."""
    if dtype == "bfloat16" and backend != "pallas":
        return _BF16_BITS
    return jnp.dtype(dtype)


def to_pool(x, storage):
    """Values -> pool storage (bfloat16 rounding, then its bits when the pool is uint16)."""
    if storage == _BF16_BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), _BF16_BITS)
    return x.astype(storage)


def pool_values(x):
    """Pool storage -> float32 values, for attention's math."""
    if x.dtype == _BF16_BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.uint32) << 16, jnp.float32)
    return x.astype(jnp.float32)


# ---------------------------------------------------------------------------------------------------
# K page layout. The "xla" backend stores each K page transposed, [H, P] instead of [P, H]: its
# score dot contracts over H, and XLA:CPU feeds that dot a [.., H, C] operand, so with [P, H] pages
# every gathered K chunk went through a transpose copy on top of the gather (decode attention
# 8.8 -> 7.0 ms per layer at S=128, contexts 64-640, 128-token pages). V pages stay [P, H] (the PV
# dot contracts over P). The Pallas kernels load [P, H] tiles, so their pool keeps that layout.
# ---------------------------------------------------------------------------------------------------
def k_transposed(backend: str) -> bool:
    """Whether `backend` keeps K pages as [H, P] (see above; the "numba" backend shares the "xla"
    backend's pool, and its kernel sums rows of a [H, P] page into contiguous scores too)."""
    return backend in ("xla", "numba")


def pool_shapes(L: int, NB: int, K: int, P: int, H: int, backend: str):
    """(K pool shape, V pool shape) for an attention backend: [L, NB, K, H, P] or [L, NB, K, P, H]."""
    v = (L, NB, K, P, H)
    return ((L, NB, K, H, P) if k_transposed(backend) else v), v


def write_kv(k_cache, v_cache, layer, k, v, slot_mapping, *, k_transposed: bool):
    """k_cache f[L, NB, K, P, H] (f[L, NB, K, H, P] when k_transposed), v_cache f[L, NB, K, P, H];
    k, v f[T, K, H]; slot_mapping i32[T] (block * P + offset).

    Returns the updated (k_cache, v_cache). k_transposed has no default: with head_dim == block
    size both layouts have the same shape, so only the caller knows which one it holds.
    """
    P = v_cache.shape[3]
    block = slot_mapping // P
    offset = slot_mapping % P
    # Advanced indices (layer, block, offset) around slices put T first: the update is [T, K, H].
    if k_transposed:
        k_cache = k_cache.at[layer, block, :, :, offset].set(to_pool(k, k_cache.dtype))
    else:
        k_cache = k_cache.at[layer, block, :, offset].set(to_pool(k, k_cache.dtype))
    v_cache = v_cache.at[layer, block, :, offset].set(to_pool(v, v_cache.dtype))
    return k_cache, v_cache
