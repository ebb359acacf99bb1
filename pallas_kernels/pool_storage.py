"""How a KV pool holds its values: float32, bfloat16, or bfloat16 as its uint16 bits.

For the XLA:CPU backends a bfloat16 pool is kept as uint16 holding the same bits: XLA:CPU gathers
and converts bfloat16 element by element (several times slower than a float32 pool), while a
uint16 gather is a plain copy and bfloat16 -> float32 is a 16-bit shift that fuses into it, so
half the bytes of float32 are read (docs/PERFORMANCE.md, "Decisions in the code"). The Pallas kernels load bfloat16 tiles natively, so their pool stays
bfloat16 (which backend stores bits is AttentionBackend.bf16_as_bits). Everything that reads or
writes the pool goes through the two helpers below, so both storages hold the same values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BF16_BITS = jnp.uint16


def to_pool(x, storage):
    """Values -> pool storage (bfloat16 rounding, then its bits when the pool is uint16)."""
    if storage == BF16_BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), BF16_BITS)
    return x.astype(storage)


def pool_values(x):
    """Pool storage -> float32 values, for attention's math."""
    if x.dtype == BF16_BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.uint32) << 16, jnp.float32)
    return x.astype(jnp.float32)
