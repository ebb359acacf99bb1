"""Compile, or load from numba's disk cache, every numba kernel the CPU path can call, in this one
process: `python -m pallas_kernels.compile_cpu_kernels`.

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
import time

logger = logging.getLogger(__name__)


def compile_all() -> dict[str, float]:
    """Every numba FFI handler, registered with jax as an engine would: seconds per handler (a
    fraction of a second each where numba's cache already held it)."""
    from pallas_kernels import numba_attention, numba_kernels  # noqa: F401  (jax and numba, nothing compiled)

    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    from pallas_kernels import numba_matmul  # its handler is compiled (or loaded) at import

    numba_matmul._target()
    seconds["matmul"] = time.perf_counter() - t0
    for name, target in (("attention float32 pool", lambda: numba_attention._target(False)),
                         ("attention bfloat16 pool", lambda: numba_attention._target(True)),
                         ("rope and KV write", numba_attention._rope_write_target)):
        t0 = time.perf_counter()
        target()
        seconds[name] = time.perf_counter() - t0
    return seconds


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from pallas_kernels.numba_attention import unsupported_reason

    reason = unsupported_reason("cpu")
    if reason:
        logger.warning("numba kernels not compiled: %s", reason)
        return 0
    seconds = compile_all()
    logger.info("numba kernels ready in %.1f s (%s)", sum(seconds.values()),
                ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
