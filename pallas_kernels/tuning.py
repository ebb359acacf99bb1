"""Tile sizes per backend and shape, kept as data so tuning never touches kernel code."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class XlaCpuConfig:
    decode_kv_blocks: int  # KV blocks per chunk of the decode loop
    prefill_q_tile: int  # query tokens per prefill tile
    prefill_tiles_per_group: int  # tiles processed together per outer iteration
    prefill_kv_blocks: int  # KV blocks per chunk of a prefill tile's loop


def xla_cpu_config(block_size: int) -> XlaCpuConfig:
    # Chunks of ~64 KV tokens keep the per-iteration gather in L2; see scripts/bench_attention.py.
    kv_blocks = max(1, 64 // block_size)
    return XlaCpuConfig(decode_kv_blocks=kv_blocks, prefill_q_tile=32, prefill_tiles_per_group=4,
                        prefill_kv_blocks=max(1, 128 // block_size))
