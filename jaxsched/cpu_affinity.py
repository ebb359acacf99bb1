"""Cores set aside for the host on the CPU platform (EngineArgs.cpu_reserved_cores).

On a CPU the "device" is this process's own native threads: XLA's thread pools and numba's
kernels. They share the machine's cores with the host's Python threads (the engine loop that
schedules, packs and detokenizes, the server's event loop), so overlapped scheduling cannot hide
the host's work the way it does beside a GPU: while the host packs step N+1, it takes a core
that step N's threads wanted. vLLM's CPU build reserves cores for its front end for the same
reason (VLLM_CPU_NUM_OF_RESERVED_CPU).

`reserve(n)` puts every Python thread of the process on the last n cores it may use and every
other thread on the rest, and limits the numba kernels' parallel regions to as many threads as
those cores (pallas_kernels/numba_threads.py). Threads started later inherit their creator's
cores: a Python thread the host's, a pool thread of XLA's the device's.

It pays when the device's step is short (a small model, a few rows), where a second device thread
gains less than the host's core costs; a larger model's matmuls want every core
(docs/PERFORMANCE.md, "Thirtieth pass"). It is process-wide: every engine in the process shares
the split.
"""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger(__name__)

_cores: tuple[int, ...] | None = None  # the process's cores before the first reserve()


def available_cores() -> tuple[int, ...]:
    """The cores this process may run on (as it started: a reserve() does not shrink them)."""
    return _cores if _cores is not None else tuple(sorted(os.sched_getaffinity(0)))


def check(n: int) -> None:
    """Raise ValueError, saying what to change, when n cores (a count EngineArgs checked) cannot be
    reserved here."""
    cores = available_cores()
    if n >= len(cores):
        raise ValueError(f"cpu_reserved_cores={n} leaves no core for the model: this process may use {len(cores)} "
                         f"core(s) ({', '.join(map(str, cores))}); reserve at most {len(cores) - 1}")


def reserve(n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Python threads on the last n cores, every other thread on the rest; numba's regions limited
    to the rest's count. Returns (host cores, device cores). Safe to call again (an engine built
    later sweeps the threads started since); n = 0 after a reserve puts every thread back on every
    core and lifts the limit."""
    global _cores
    if n == 0 and _cores is None:  # nothing was ever reserved: nothing to undo (any platform)
        return (), ()
    check(n)
    cores = available_cores()
    _cores = cores
    host, device = (cores[-n:], cores[:-n]) if n else (cores, cores)  # 0 after a reserve: every thread everywhere
    python = {t.native_id for t in threading.enumerate()}
    moved = 0
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            os.sched_setaffinity(tid, host if tid in python else device)
            moved += 1
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            continue
    try:
        from pallas_kernels import numba_threads
    except ImportError:  # no numba here: the engine runs the XLA kernels, which need no limit
        pass
    else:
        numba_threads.set_limit(len(device) if n else 0)
    logger.info("cpu_reserved_cores=%d: %d Python thread(s) on core(s) %s, the other threads (XLA, numba) on %s; "
                "%d thread(s) placed", n, len(python), list(host), list(device), moved)
    return host, device
