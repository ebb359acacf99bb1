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


# YNNPACK fusion kinds for the model step on a CPU with the "xla" attention backend. jaxlib hands
# YNNPACK only dots and reductions by default; adding elementwise chains moves that backend's
# attention loops' exp / select / rescale work into YNNPACK's vectorised kernels (faster decode
# attention). With the "numba" backend attention is not in XLA's hands, and the same option only
# slows the rest of the step (the gate / up split copied out for YNNPACK, among others): jaxlib's
# default there (docs/PERFORMANCE.md, "Decisions in the code"). It is an XLA option per compiled
# program (passed to compile()), so nothing else in the process is affected.
_XLA_ATTENTION_CPU_OPTIONS = {
    "xla_cpu_experimental_ynn_fusion_type":
        "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_ELTWISE,LIBRARY_FUSION_TYPE_REDUCE",
}


def compiler_options(platform: str, attention_backend: str) -> dict[str, str]:
    """XLA options for compiling the model step on `platform` ("cpu", "gpu", ...) with the named
    attention backend (pallas_kernels.backends)."""
    return dict(_XLA_ATTENTION_CPU_OPTIONS) if platform == "cpu" and attention_backend == "xla" else {}


# The layers' weight matmuls in numba_matmul's kernel over weights packed at start, instead of
# XLA's dots (which pack the weight on every call): with the "numba" backend on one CPU device.
# Measured on the demo model's shapes: 1.5-2.5x XLA:CPU at T = 8-128, level or ahead at T = 2048
# (docs/PERFORMANCE.md, "Decisions in the code"). Not with a mesh: a packed weight is not split
# along the axes parallel.py shards.
def packed_matmuls(platform: str, attention_backend: str, num_devices: int) -> bool:
    return platform == "cpu" and attention_backend == "numba" and num_devices == 1


# How the model holds its layer weights (jaxsched/models/layers.py). Both run one lax.scan over the
# layers. "stacked": every weight stacked along a leading L axis and sliced per layer as the scan's
# xs; XLA:CPU copies that dynamic slice before each dot. "per_layer": separate arrays per layer,
# reached through lax.switch on the layer index, whose branches read them in place: a little
# faster on a CPU, for more peak memory (L copies of a layer's non-attention code in every program)
# and about twice the cached warm-up (docs/PERFORMANCE.md, "Decisions in the code"). GPUs keep
# "stacked" for now: there a switch reads its index on the host (a sync per layer), and a stacked
# step of the 1B model took 2.6-3.3 ms where its weights take 0.8 ms to read (docs/PERFORMANCE.md,
# "GPU (H200)"), which a copy of each sliced weight would explain. "unrolled" (no loop, no slice,
# no switch) is the candidate; scripts/gpu_check.py measures it beside "stacked".
def layer_weights(platform: str) -> str:
    return "per_layer" if platform == "cpu" else "stacked"


# How the sampler's optional parts are chosen each step (jaxsched/runner/sampler.py). "device": one
# program per S, each part under a lax.cond on a predicate the device computes. XLA:CPU evaluates a
# cond where it stands, and one program per S keeps the warm-up short (docs/PERFORMANCE.md, "Decisions
# in the code"). XLA:GPU copies a cond's predicate to the host and waits for the stream to drain, so
# the sampler's call returned only once the same step's model program had run: the host could not
# schedule the next step meanwhile. "host": a program per S for each feature set below, no cond in
# any; the host picks the first that holds what the step needs. The cheapest first: all-greedy steps
# without logprobs (offline benchmarks), sampled ones without filters (a served default), greedy
# ones with logprobs (evaluations), then everything but the filters (greedy structured output, and
# any step with penalties, a logit_bias or a mask but no top-k/p/min-p), then everything but
# penalties, logit_bias and masks, then everything. The filters' sort over [S, V] is the costly part
# the first four leave out, by far the largest there is (docs/PERFORMANCE.md, "Decisions in the code"); each set is one more program per S to compile.
# "mixed": the first of those (the argmax alone) for all-greedy steps without logprobs, penalties,
# a logit_bias or a mask, the cond program for every other step. A CPU's choice: its call costs
# 23-39 us against 78-114 for the cond program, and the call and its run 0.10-0.20 ms against
# 0.22-0.37 (32 rows, the tiny and the demo model; docs/PERFORMANCE.md, "Decisions in the code"), a
# share of a small model's step, for one more small program per S.
SAMPLER_VARIANTS = (frozenset(), frozenset({"sample"}), frozenset({"logprobs"}),
                    frozenset({"sample", "logprobs", "adjust"}), frozenset({"sample", "filter", "logprobs"}),
                    frozenset({"sample", "filter", "logprobs", "adjust"}))
# the programs per S of each choice: a feature set (the programs without conds), or None for the
# cond program (every feature)
SAMPLER_PROGRAMS = {"device": (None,), "host": SAMPLER_VARIANTS, "mixed": (frozenset(), None)}
SAMPLER_BRANCHES = tuple(SAMPLER_PROGRAMS)


def sampler_branches(platform: str) -> str:
    return "mixed" if platform == "cpu" else "host"


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
