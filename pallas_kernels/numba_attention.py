"""The "numba" attention backend: ragged paged attention in a CPU kernel that reads KV pages where
they lie, called from the jitted step through XLA's FFI.

Same arguments, pool layout and result as the "xla" backend (K pages stored [H, P], a bfloat16 pool
as uint16 bits; backends.py records both). The kernels are numba_kernels.py; cpu_ffi.py makes them
XLA FFI handlers.

Why: decode attention is bound by moving K/V, and XLA:CPU can only reach pages through a gather that
copies them, after which the score and value dots read the copy again: three passes over every
byte, where the kernel makes one. Prefill attention in XLA runs as many small tiled dots over
gathered chunks; the kernel does the same dots on the pages in place, with exact causal limits per
tile. The steps it saves on this CPU are in docs/PERFORMANCE.md, "Decisions in the code".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxsched import platforms
from pallas_kernels.window import layer_and_window


def unsupported_reason(platform: str) -> str | None:
    """None when the backend can run on `platform` (jax's name: "cpu", "gpu", ...), else why not.
    backends.py asks this when choosing a backend."""
    try:
        import numba  # noqa: F401
    except ImportError as e:
        return f"numba is not importable ({e}); install it with `pip install numba`"
    if not platforms.of(platform).host_runs_model:
        return "the numba kernels run on a CPU only"
    return None


_STORAGE = {jnp.dtype(jnp.float32): "f32", jnp.dtype(jnp.uint16): "u16", jnp.dtype(jnp.uint8): "u8"}


@functools.cache
def _target(storage: str) -> str:
    """Register the kernel's FFI handler for one pool storage (once per process); its name."""
    from pallas_kernels import cpu_ffi, numba_kernels

    name = f"jaxsched_numba_attention_{storage}"
    cpu_ffi.register(name, numba_kernels.handler(storage))
    return name


def _kernel_storage(pool):
    """The kernel reads float32, uint16 (bfloat16 bits) or uint8 (fp8 e4m3 bits) pages. The engine's
    pools are one of those (AttentionBackend.pool_dtype); a bfloat16 or e4m3 array is reinterpreted
    as its bits, anything else converted (a copy of the pool: for tests and odd callers only)."""
    if pool.dtype in _STORAGE:
        return pool
    if pool.dtype == jnp.bfloat16:
        return jax.lax.bitcast_convert_type(pool, jnp.uint16)
    if pool.dtype == jnp.float8_e4m3fn:
        return jax.lax.bitcast_convert_type(pool, jnp.uint8)
    return pool.astype(jnp.float32)


def numba_attention(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc, num_seqs,
                    *, sm_scale: float, window=None):
    """window: sliding-window attention (paged_attention's docstring): the kernels start at the
    first page a window holds."""
    T, N, H = q.shape
    k_cache, v_cache = _kernel_storage(k_cache), _kernel_storage(v_cache)
    call = jax.ffi.ffi_call(_target(_STORAGE[k_cache.dtype]), jax.ShapeDtypeStruct((T, N, H), jnp.float32))
    out = call(q.astype(jnp.float32), k_cache, v_cache, layer_and_window(layer, window),
               block_tables, seq_lens, query_start_loc, num_seqs, jnp.full((1,), sm_scale, jnp.float32))
    return out.astype(q.dtype)


@functools.cache
def _rope_write_target() -> str:
    from pallas_kernels import cpu_ffi, numba_kv_write

    name = "jaxsched_numba_rope_write_f32"
    cpu_ffi.register(name, numba_kv_write.handler)
    return name


def rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, layer, slot_mapping):
    """numba_kv_write.py's one pass: rope on q and k, k and v written into the pools at
    slot_mapping -> (q with rope, k_cache, v_cache), the pools updated in place (aliased). None
    where it cannot run (anything but float32 q, k, v and pools, or an odd head_dim): the caller
    then runs layers.apply_rope and kv_cache.write_kv, which give the same values."""
    if any(x.dtype != jnp.float32 for x in (q, k, v, k_cache, v_cache)) or q.shape[-1] % 2:
        return None
    f32 = jnp.float32
    call = jax.ffi.ffi_call(_rope_write_target(), (jax.ShapeDtypeStruct(q.shape, f32),
                                                   jax.ShapeDtypeStruct(k_cache.shape, f32),
                                                   jax.ShapeDtypeStruct(v_cache.shape, f32)),
                            input_output_aliases={7: 1, 8: 2})
    q, k_cache, v_cache = call(q, k, v, cos.astype(f32), sin.astype(f32), slot_mapping.astype(jnp.int32),
                               jnp.reshape(layer, (1,)).astype(jnp.int32), k_cache, v_cache)
    return q, k_cache, v_cache
