"""One record per platform: everything the engine does differently on a CPU and on a GPU.

The engine reads its platform's record and asks nothing else "is this a CPU?" (tests/test_layout.py
checks that no other module compares platform names). The record is data: a newcomer who wants to
know what differs on a GPU reads it here, and a new platform is one more record.

Settings (EngineArgs' "auto" values) are decided from a record in config.resolve(); process settings
(malloc, XLA's thread pools, core pinning) are applied by the engine core when it starts, never at
import (platforms/host_malloc.py, platforms/cpu_affinity.py).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field

from jaxsched import envs

# YNNPACK fusion kinds for the model step on a CPU with the "xla" attention backend. jaxlib hands
# YNNPACK only dots and reductions by default; adding elementwise chains moves that backend's
# attention loops' exp / select / rescale work into YNNPACK's vectorised kernels (faster decode
# attention). With the "numba" backend attention is not in XLA's hands, and the same option only
# slows the rest of the step (the gate / up split copied out for YNNPACK, among others): jaxlib's
# default there (docs/PERFORMANCE.md, "Decisions in the code"). An XLA option per compiled program
# (passed to compile()), so nothing else in the process is affected.
_YNN_FUSIONS = {"xla_cpu_experimental_ynn_fusion_type":
                "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_ELTWISE,LIBRARY_FUSION_TYPE_REDUCE"}

# modules present when jax can run on something other than the CPU
_ACCELERATOR_MODULES = ("jax_plugins", "jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu")


@dataclass(frozen=True)
class Platform:
    name: str  # jax's name for it: "cpu", "gpu", ...
    # the model runs on the host's own cores: threads, pinning and malloc are the engine's business,
    # and cpu_reserved_cores means something
    host_runs_model: bool
    # EngineArgs.dtype "auto": None keeps the checkpoint's 16-bit dtype (float32 checkpoints stay
    # float32). XLA:CPU runs float32 matmuls faster than bfloat16 ones; a GPU runs every checkpoint
    # in bfloat16 (as vLLM runs a float32 one in 16 bits): half the bytes a step reads, tensor cores
    dtype: str | None
    # EngineArgs.layer_weights "auto" (models/layers.py). "per_layer" on a CPU: separate arrays per
    # layer reached through lax.switch, read in place, where XLA:CPU copies a stacked weight's slice
    # before each dot (faster, for more peak memory and a longer warm-up). GPUs keep "stacked": a
    # switch there reads its index on the host, a sync per layer; "unrolled" is the candidate that
    # scripts/gpu_check.py measures beside it (docs/PERFORMANCE.md, "Decisions in the code").
    layer_weights: str
    # EngineArgs.sampler_branches "auto" (runner/sampler.py). XLA:GPU runs a lax.cond by copying its
    # predicate to the host and draining the stream, so a GPU compiles a program per feature set and
    # the host picks one ("host"). XLA:CPU evaluates a cond where it stands: the argmax alone for
    # plain greedy steps, the program with conds for the rest ("mixed").
    sampler_branches: str
    # how an MoE layer's experts run on their sorted tokens (models/moe.py): "ragged_dot", XLA's grouped
    # matmul, or "tiles", a loop over tiles of one expert each (jax's ragged_dot on a CPU is a dense
    # product over every expert, so a step there would cost all experts whatever it routes)
    grouped_matmul: str = "ragged_dot"
    # XLA options for the model step's programs, by attention backend
    compiler_options: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # the layers' matmuls in numba_matmul's kernel over weights packed at start, for these attention
    # backends on one device (faster than XLA:CPU's dots: docs/PERFORMANCE.md, "Decisions in the code")
    packed_matmul_backends: tuple[str, ...] = ()
    # device.memory_stats() gives the device's memory (else the host's, shared by simulated devices)
    memory_stats: bool = True
    # coarse rates for swap-or-recompute (sizing.swap_min_tokens): matmul FLOP/s, host link bytes/s,
    # fixed seconds per swap; the decision needs only their order of magnitude
    flops: float = 2e14
    link_bytes_per_second: float = 2e10
    swap_overhead_seconds: float = 2e-3
    # Pallas kernels run as Triton programs here (else in interpret mode, for tests)
    triton: bool = False
    # one visible device per data-parallel core process (CUDA_VISIBLE_DEVICES), or all of the host's
    visible_devices_env: str | None = None
    # what to say when more devices are asked for than present
    more_devices_hint: str = ""

    def step_compiler_options(self, attention_backend: str) -> dict[str, str]:
        return dict(self.compiler_options.get(attention_backend, {}))

    def packed_matmuls(self, attention_backend: str, num_devices: int) -> bool:
        # not with a mesh: a packed weight is not split along the axes parallel/mesh.py shards
        return attention_backend in self.packed_matmul_backends and num_devices == 1


CPU = Platform(
    name="cpu", host_runs_model=True, dtype="float32", layer_weights="per_layer", sampler_branches="mixed",
    compiler_options={"xla": _YNN_FUSIONS}, packed_matmul_backends=("numba",), memory_stats=False, grouped_matmul="tiles",
    flops=1e11, link_bytes_per_second=5e9,
    more_devices_hint=" (on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N, set before jax starts, "
                      "simulates N devices)")

GPU = Platform(name="gpu", host_runs_model=False, dtype="bfloat16", layer_weights="stacked", sampler_branches="host",
               triton=True, visible_devices_env="CUDA_VISIBLE_DEVICES")


def of(name: str) -> Platform:
    """The record of jax's platform `name` (a device's .platform, jax.default_backend()). Another
    accelerator (a TPU) gets the GPU's choices under its own name."""
    if name == CPU.name:
        return CPU
    if name == GPU.name:
        return GPU
    return _other(name)


@functools.cache
def _other(name: str) -> Platform:
    return Platform(**{**GPU.__dict__, "name": name, "triton": False, "visible_devices_env": None})


def expected(environ: Mapping[str, str] | None = None) -> Platform:
    """The platform jax will run on, decided without starting jax: JAX_PLATFORMS' first entry,
    else the CPU unless an accelerator plugin is installed. Process settings that must come before
    jax's threads start (malloc arenas, XLA's CPU pool size) are chosen from it."""
    names = envs.jax_platforms(environ)
    if names:
        first = names.split(",")[0].strip()
        return of("gpu" if first in ("cuda", "rocm") else first)
    return GPU if any(importlib.util.find_spec(m) is not None for m in _ACCELERATOR_MODULES) else CPU
