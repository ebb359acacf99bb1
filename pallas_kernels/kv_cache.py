"""Writing this step's new K/V into the pool (its shapes and dtype are the backend record's, backends.py).

The pool is donated to the jitted step, so the write's scatter updates it in place. Padding tokens
carry slot 0 and write into the null page, which no real sequence reads unmasked.

One write for every attention backend, on CPU and GPU alike: there is no Pallas kernel for it. A
step writes 2 * T * K * H elements per layer (1 MiB for T = 256, K = 8, H = 128 in bf16) where its
attention reads every sequence's whole KV (2 GiB for 256 sequences of 2048 tokens), and XLA:GPU
lowers this scatter into the donated pool to one in-place kernel; a Pallas kernel could at best
save that launch. Revisit only if scripts/gpu_check.py shows the write as a visible share of a step.
"""

from __future__ import annotations

from pallas_kernels.pool_storage import to_pool


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
