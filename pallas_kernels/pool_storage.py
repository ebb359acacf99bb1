"""How a KV pool holds its values: float32, bfloat16, or bfloat16 as its uint16 bits; fp8 (e4m3 or
e5m2), or e4m3 as its uint8 bits.

For the XLA:CPU backends a bfloat16 pool is kept as uint16 holding the same bits: XLA:CPU gathers
and converts bfloat16 element by element (several times slower than a float32 pool), while a
uint16 gather is a plain copy and bfloat16 -> float32 is a 16-bit shift that fuses into it, so
half the bytes of float32 are read (docs/PERFORMANCE.md, "Decisions in the code"). The Pallas kernels load bfloat16 tiles natively, so their pool stays
bfloat16 (which backend stores bits is AttentionBackend.bf16_as_bits). Everything that reads or
writes the pool goes through the two helpers below, so both storages hold the same values.

fp8 (`kv_cache_dtype` "fp8" = "fp8_e4m3", or "fp8_e5m2": vLLM's names) halves a bfloat16 pool
again. Values are stored unscaled (a scale of 1.0 for every layer, vLLM's default when a checkpoint
carries no calibrated k/v scales), rounded to the nearest fp8 value and saturated at the format's
largest (448 for e4m3, 57344 for e5m2) rather than turned into NaN. The numba kernels read e4m3 as
its uint8 bits (AttentionBackend.fp8_as_bits), which is how a uint8 pool is read everywhere; e5m2
stays its own dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BF16_BITS = jnp.uint16
E4M3_BITS = jnp.uint8
# kv_cache_dtype -> the dtype of the pool's values
KV_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn,
             "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}


def values_dtype(kv_cache_dtype: str):
    """The dtype of a pool's values for a resolved kv_cache_dtype ("float32", "bfloat16", "fp8", ...)."""
    return jnp.dtype(KV_DTYPES[kv_cache_dtype])


def is_fp8(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype.startswith("fp8")


def to_pool(x, storage):
    """Values -> pool storage (bfloat16 rounding, then its bits when the pool is uint16; fp8
    rounding, saturated, then e4m3's bits when the pool is uint8)."""
    if storage == BF16_BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), BF16_BITS)
    fp8 = jnp.dtype(jnp.float8_e4m3fn if storage == E4M3_BITS else storage)
    if fp8 in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        top = float(jnp.finfo(fp8).max)
        x = jnp.clip(x.astype(jnp.float32), -top, top).astype(fp8)
        return jax.lax.bitcast_convert_type(x, E4M3_BITS) if storage == E4M3_BITS else x
    return x.astype(storage)


def pool_values(x):
    """Pool storage -> float32 values, for attention's math."""
    if x.dtype == BF16_BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.uint32) << 16, jnp.float32)
    if x.dtype == E4M3_BITS:
        return jax.lax.bitcast_convert_type(x, jnp.float8_e4m3fn).astype(jnp.float32)
    return x.astype(jnp.float32)
