"""Compile, or load from numba's disk cache, every numba kernel the CPU path can call, ahead of
the processes that use them: `python -m pallas_kernels.compile_cpu_kernels [--jobs N]`.

Why: the first process on a machine that uses a kernel compiles it and writes numba's cache beside
the sources, and every later process loads that cache. Processes that start together before the
cache exists each compile the same kernels at the same time (the float32 attention handler is the
longest: docs/PERFORMANCE.md). `make test` runs this once per virtualenv before pytest, so that the
test workers and the multi-device tests' subprocesses load the cache; ahead of a deployment (an image
build) it moves that cost out of the first engine's start.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor

logger = logging.getLogger(__name__)


# The handlers in groups of about equal compile time, one process per group where there are cores
# to spare: both attention handlers share numba_kernels' cached functions (their cache index files),
# so they stay in one process; the matmul and the rope-and-KV-write handlers are the other group.
GROUPS = (("matmul", "matmul int8", "matmul int8 grouped", "rope and KV write"),
          ("attention float32 pool", "attention bfloat16 pool", "attention fp8 pool"))
_ATTENTION = {"attention float32 pool": "f32", "attention bfloat16 pool": "u16", "attention fp8 pool": "u8"}


def _compile(name: str) -> None:
    from pallas_kernels import numba_attention

    if name == "matmul":
        from pallas_kernels import numba_matmul  # its handler is compiled (or loaded) at import

        numba_matmul._target()
    elif name == "matmul int8":
        from pallas_kernels import numba_matmul

        numba_matmul._target("i8")
    elif name == "matmul int8 grouped":
        from pallas_kernels import numba_matmul

        numba_matmul._target("i8g")
    elif name == "rope and KV write":
        numba_attention._rope_write_target()
    else:
        numba_attention._target(_ATTENTION[name])


def compile_group(names: tuple[str, ...]) -> dict[str, float]:
    """The handlers `names` compiled (or loaded) in this process, as an engine would register them
    with jax: seconds per handler (a fraction of a second each where numba's cache already held it)."""
    from pallas_kernels import numba_attention, numba_kernels  # noqa: F401  (jax and numba, nothing compiled)

    seconds: dict[str, float] = {}
    for name in names:
        t0 = time.perf_counter()
        _compile(name)
        seconds[name] = time.perf_counter() - t0
    return seconds


def compile_all(jobs: int = 1) -> dict[str, float]:
    """Every numba FFI handler: seconds per handler. jobs > 1: the groups in that many processes
    (each writes numba's cache, which is all this is for)."""
    if jobs <= 1:
        return {k: v for group in GROUPS for k, v in compile_group(group).items()}
    with ProcessPoolExecutor(min(jobs, len(GROUPS)), mp_context=multiprocessing.get_context("spawn")) as pool:
        return {k: v for part in pool.map(compile_group, GROUPS) for k, v in part.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="processes to compile in (default: 2 where there are 2 cores)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from pallas_kernels.numba_attention import unsupported_reason

    reason = unsupported_reason("cpu")
    if reason:
        logger.warning("numba kernels not compiled: %s", reason)
        return 0
    t0 = time.perf_counter()
    seconds = compile_all(args.jobs)
    logger.info("numba kernels ready in %.1f s (%s)", time.perf_counter() - t0,
                ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
