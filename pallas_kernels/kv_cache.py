"""The KV pool per attention backend: its shapes and dtype by backend name, and writing new K/V.

The shapes and dtype are the backend's record's (backends.py); these name-taking forms are for the
model and the runner, which hold the backend's name.

The pool is donated to the jitted step, so the write's scatter updates it in place. Padding tokens
carry slot 0 and write into the null page, which no real sequence reads unmasked.

One write for every attention backend, on CPU and GPU alike: there is no Pallas kernel for it. A
step writes 2 * T * K * H elements per layer (1 MiB for T = 256, K = 8, H = 128 in bf16) where its
attention reads every sequence's whole KV (2 GiB for 256 sequences of 2048 tokens), and XLA:GPU
lowers this scatter into the donated pool to one in-place kernel; a Pallas kernel could at best
save that launch. Revisit only if scripts/gpu_check.py shows the write as a visible share of a step.
"""

from __future__ import annotations

from pallas_kernels import backends
from pallas_kernels.pool_storage import to_pool


def pool_dtype(dtype: str, backend: str):
    """The array dtype of a pool of `dtype` ("float32" / "bfloat16") for an attention backend."""
    return backends.get(backend).pool_dtype(dtype)


def k_transposed(backend: str) -> bool:
    """Whether `backend` keeps K pages as [H, P] rather than [P, H]."""
    return backends.get(backend).k_transposed


def pool_shapes(L: int, NB: int, K: int, P: int, H: int, backend: str):
    """(K pool shape, V pool shape) for an attention backend: [L, NB, K, H, P] or [L, NB, K, P, H]."""
    return backends.get(backend).pool_shapes(L, NB, K, P, H)


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
