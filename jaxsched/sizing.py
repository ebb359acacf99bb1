"""Memory and cost arithmetic behind the resolved config: KV bytes per block, the pool's size from
a memory budget, and when swapping beats recomputing. Plain Python (no jax): the device's memory
figures come in as arguments."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxsched.models.model_config import ModelConfig
    from jaxsched.platforms import Platform

# bytes a value of each kv_cache_dtype (and dtype): the names config.EngineArgs accepts for the pool
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: str, shards: int = 1) -> int:
    """Bytes of one KV block (a page of a layer group's Lg layers, core/kv_groups.py: all L layers
    for a model without sliding layers) on one device, with the pool's K heads split over `shards`
    devices."""
    from jaxsched.core.kv_groups import kv_groups

    return 2 * kv_groups(cfg).size * block_size * (cfg.num_kv_heads // shards) * cfg.head_dim * DTYPE_BYTES[dtype]


def activation_bytes(cfg: ModelConfig, max_tokens: int, max_seqs: int, dtype: str, shards: int = 1) -> int:
    """A generous bound on one step's live activations on one device: per-token hidden states of a
    layer (the head and intermediate parts split over `shards`) plus the gathered logits and the
    sampler's sorted copy, with a factor 2 for XLA's temporaries."""
    per_token = (4 * cfg.hidden_size + ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                                        + 3 * cfg.active_intermediate_size) // shards) * DTYPE_BYTES[dtype]
    return 2 * (max_tokens * per_token + 4 * max_seqs * cfg.vocab_size * 4)


def num_blocks_for_memory(cfg: ModelConfig, block_size: int, dtype: str, kv_dtype: str, utilization: float,
                          memory: tuple[int, int], weights_bytes: int, max_tokens: int, max_seqs: int,
                          max_useful: int, shards: int = 1, extra_block_bytes: int = 0) -> int:
    """vLLM's rule, per device: the pool gets utilization * total memory minus the weights and the
    peak activations; `memory` is one device's (total, free) bytes (host memory on a CPU, where
    free memory also caps it), weights_bytes that device's share, and a block costs each device
    its K / shards heads (and `extra_block_bytes`: a draft model's KV in the same blocks). Never
    more than `max_useful` blocks (null page included)."""
    total, free = memory
    activations = activation_bytes(cfg, max_tokens, max_seqs, dtype, shards)
    budget = min(utilization * total, free) - weights_bytes - activations
    block = kv_bytes_per_block(cfg, block_size, kv_dtype, shards) + extra_block_bytes
    n = int(budget // block)
    if n < 2:
        mib = 2**20
        raise ValueError(
            f"no memory left for the KV pool: of a device's {total / mib:.1f} MiB ({free / mib:.1f} MiB free), "
            f"gpu_memory_utilization={utilization} gives {min(utilization * total, free) / mib:.1f} MiB, and the "
            f"weights take {weights_bytes / mib:.1f} MiB (per device, with tensor_parallel_size={shards}) and the "
            f"activations {activations / mib:.1f} MiB (max_num_batched_tokens={max_tokens}, max_num_seqs="
            f"{max_seqs}), leaving {max(budget, 0) / mib:.1f} MiB for blocks of {block / mib:.2f} MiB: raise "
            "tensor_parallel_size to split the model over more devices or gpu_memory_utilization, lower "
            "max_num_batched_tokens (enable_chunked_prefill keeps longer prompts possible) or max_num_seqs, "
            "use dtype='bfloat16' for smaller weights and KV, quantization='int8' or 'fp8' for 8-bit weights, "
            "kv_cache_dtype='fp8' for blocks of a byte a value, or set num_gpu_blocks_override"
        )
    return min(n, max_useful)


def swap_min_tokens(cfg: ModelConfig, dtype: str, platform: Platform) -> int:
    """Context length from which swapping a victim out and back costs less than recomputing it.

    Recompute costs about 2 * params FLOPs per token (plus attention, ignored: it only favours
    swapping further); a swap copies each token's K/V out and back over the host link, plus a
    fixed cost per swap (two copy calls and the scheduling around them). Rates are coarse
    per-platform figures; the decision only needs their order of magnitude.
    """
    flops, link_bw, overhead_s = platform.flops, platform.link_bytes_per_second, platform.swap_overhead_seconds
    L = cfg.num_layers
    recompute = cfg.token_flops / flops
    copy = 2 * 2 * L * cfg.num_kv_heads * cfg.head_dim * DTYPE_BYTES[dtype] / link_bw
    if recompute <= copy:
        return 1 << 30  # never worth it: always recompute
    return max(1, int(overhead_s / (recompute - copy)) + 1)
