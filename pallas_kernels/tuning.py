"""Tile sizes per backend and shape, kept as data so tuning never touches kernel code."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class XlaCpuConfig:
    decode_kv_blocks: int  # KV blocks per chunk of the decode loop
    decode_row_groups: int  # independent decode loops over rows sorted by context length
    prefill_q_tile: int  # query tokens per prefill tile
    prefill_tiles_per_group: int  # tiles processed together per outer iteration
    prefill_kv_blocks: int  # KV blocks per chunk of a prefill tile's loop


def xla_cpu_config(block_size: int) -> XlaCpuConfig:
    # Measured with scripts/bench_attention.py at the demo model's shapes (docs/PERFORMANCE.md, "Decisions in the code"). Decode: with
    # 16-token pages, chunks of 2 pages (the gathered chunk stays in L2); with larger pages, one
    # page per chunk (a gather copies a page per index, so bigger pages gather faster). Prefill is
    # flat for q tiles 16-128 and groups of 2-8 tiles, and slows past that (tiles of a group loop
    # to the group's longest context). Decode rows run as 4 groups of rows sorted by context
    # length, one loop per group (XLA:CPU runs independent loops on both cores, and each loop stops
    # at its own longest row).
    return XlaCpuConfig(decode_kv_blocks=max(1, 32 // block_size), decode_row_groups=4, prefill_q_tile=32,
                        prefill_tiles_per_group=4, prefill_kv_blocks=max(1, 128 // block_size))


# How the sampler's optional parts are chosen each step (jaxsched/runner/sampler.py; the platform
# record, jaxsched/platforms/platform.py, picks for "auto"). "device": one program per S, each part
# under a lax.cond on a predicate the device computes. "host": a program per S for each feature set
# below, no cond in any; the host picks the first that holds what the step needs. The cheapest first:
# all-greedy steps without logprobs (offline benchmarks), sampled ones without filters (a served
# default), greedy ones with logprobs (evaluations), then everything but the filters (greedy
# structured output, and any step with penalties, a logit_bias or a mask but no top-k/p/min-p), then
# everything but penalties, logit_bias and masks, then everything. The filters' sort over [S, V] is
# the costly part the first four leave out; each set is one more program per S to compile. "mixed":
# the first of those (the argmax alone) for all-greedy steps without logprobs, penalties, a
# logit_bias or a mask, the cond program for every other step (docs/PERFORMANCE.md, "Decisions in
# the code").
SAMPLER_VARIANTS = (frozenset(), frozenset({"sample"}), frozenset({"logprobs"}),
                    frozenset({"sample", "logprobs", "adjust"}), frozenset({"sample", "filter", "logprobs"}),
                    frozenset({"sample", "filter", "logprobs", "adjust"}))
# the programs per S of each choice: a feature set (the programs without conds), or None for the
# cond program (every feature)
SAMPLER_PROGRAMS = {"device": (None,), "host": SAMPLER_VARIANTS, "mixed": (frozenset(), None)}
SAMPLER_BRANCHES = tuple(SAMPLER_PROGRAMS)


# ---------------------------------------------------------------------------------------------------
# The "pallas" backend (Triton on NVIDIA GPUs). Every size here is a power of two: Triton tensors
# must be, and its dot needs at least 16 rows, 16 columns and a reduction of 16.
# These are starting points from the usual flash-attention shapes, NOT yet measured on the H200:
# scripts/gpu_check.py times them; put the measured choice and its figure here when it has run.
# ---------------------------------------------------------------------------------------------------
_GPU_PROGRAMS_TARGET = 512  # ~4 programs per SM of an H100/H200 (132 SMs): enough to hide latency


@dataclass(frozen=True)
class PallasConfig:
    q_tile: int  # Qb: query tokens of one sequence per prefill program; Qb * Gp rows per dot
    prefill_kv_pages: int  # pages per KV chunk of the prefill loop (chunk = pages * P tokens)
    prefill_warps: int
    prefill_stages: int
    decode_kv_pages: int  # pages per KV chunk of the decode loop
    decode_splits: int  # NS: KV ranges of one decode row run by separate programs (split-K)
    decode_warps: int
    decode_stages: int


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pallas_config(T: int, S: int, N: int, K: int, H: int, P: int, M: int) -> PallasConfig:
    """Tile sizes for one (T, S) bucket of a model: a function of static shapes only."""
    Gp = next_pow2(N // K)  # query heads per KV head, padded to a power of two
    # Prefill: 64 (token, head) rows per program is the usual flash-attention tile for H <= 128; it
    # halves for H = 256 to keep the [rows, H] float32 accumulator in registers.
    rows = 64 if H <= 128 else 32
    # never more tokens than the step has (down to a power of two), but always 16 rows for the dot
    q_tile = max(1, min(rows // Gp, 1 << (max(T, 1).bit_length() - 1)), 16 // Gp)
    kv_tokens = 64 if H <= 128 else 32
    pages = max(1, kv_tokens // P, 16 // P)
    # Decode: a program streams one row's K and V of one KV head and does little math on them, so
    # with few rows the GPU idles unless each row's KV is split over several programs. Split until
    # S * K * NS programs reach the target, never into more ranges than the longest row has chunks.
    max_chunks = max(1, -(-M // pages))
    splits = 1
    while S * K * splits < _GPU_PROGRAMS_TARGET and splits * 2 <= min(16, max_chunks):
        splits *= 2
    return PallasConfig(q_tile=q_tile, prefill_kv_pages=pages, prefill_warps=4 if q_tile * Gp <= 64 else 8,
                        prefill_stages=2, decode_kv_pages=pages, decode_splits=splits, decode_warps=4,
                        decode_stages=2)
