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

XLA's CPU client sizes its thread pools (the intra-op "XLAEigen" pool that runs a program's
parallel loops, and the client's own) once, from the cores the process may use when jax first
starts its backends. Two pool threads sharing the one device core split every loop in two, and
the halves take turns on that core (each waits, spinning, for the other), so a reserve made after
that start leaves the device's step slower than it need be. `size_xla_pools(n)`, called before
anything starts jax's backends, makes the pools as large as the device's cores instead
(docs/PERFORMANCE.md, "Decisions in the code").

It pays when the device's step is short (a small model, a few rows), where a second device thread
gains less than the host's core costs; a larger model's matmuls want every core
(docs/PERFORMANCE.md, "Decisions in the code"). `auto_reserved_cores` draws that line from the model's
FLOPs a token per core ("Decisions in the code"). It is process-wide: every engine in the process
shares the split.

The same contention decides whether overlapped scheduling pays on a CPU at all:
`auto_async_scheduling` turns it off where no core is reserved and the model keeps every core
busy ("Decisions in the code").
"""

from __future__ import annotations

import logging
import os
import threading

from jaxsched import envs

logger = logging.getLogger(__name__)

_cores: tuple[int, ...] | None = None  # the process's cores before the first reserve()
_reserved = 0  # the cores the last reserve() kept for the host (0: none, or put back)


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


_POOL_THREAD = "tf_XLAEigen"  # the name XLA's CPU client gives its intra-op pool's threads (Linux)
# why size_xla_pools left the pools as they were, for reserve()'s warning (None: no reason to warn)
_pools_skipped: str | None = "jax started its backends before the engine was built"
_pool_warned = False


def size_xla_pools(n: int) -> bool:
    """When n cores are to be reserved and jax has not started its backends yet: start them with
    XLA's CPU thread pools sized to the cores left for the device. Returns whether it did.

    Leaves the pools as they are where jax already started (reserve() then warns), where the
    user set their size (PJRT_NPROC / NPROC), and where jax may start on a GPU (the engine refuses
    a reserve there, and the process's CPU client must not shrink for that)."""
    if not n:
        return False
    from jax._src import xla_bridge

    from jaxsched.platforms.platform import expected

    global _pools_skipped
    if xla_bridge.backends_are_initialized():
        _pools_skipped = "jax started its backends before the engine was built"
        return False
    if envs.xla_pool_size_set():  # the user's size: no warning either
        _pools_skipped = None
        return False
    if not expected().host_runs_model:
        _pools_skipped = "a GPU plugin is installed, so the engine did not start jax itself (set JAX_PLATFORMS=cpu)"
        return False
    check(n)
    import jax

    # the client reads the cores from the calling thread's affinity; the threads it starts inherit it
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, available_cores()[:-n])
    try:
        jax.devices()  # starts every backend, the CPU client's pools sized to the device's cores
    finally:
        os.sched_setaffinity(0, own)
    _pools_skipped = None  # sized: nothing to warn about
    return True


# the model's FLOPs a token (ModelConfig.token_flops) per core of this process, below which "auto"
# reserves a core: a small model's device work leaves the cores idle enough that a core of the
# host's own pays; a larger one's needs every core. The line is where the measured gain ends
# (docs/PERFORMANCE.md, "Decisions in the code")
AUTO_MAX_FLOPS_PER_CORE = 5e6
# the same line for a synchronous engine (async_scheduling=False), whose host does not work beside
# the device but still takes turns with it on the cores: its gain ends at a smaller model
AUTO_MAX_FLOPS_PER_CORE_SYNC = 3.5e6


def _flops_per_core(model_config) -> tuple[float, int]:
    """The model's FLOPs a token (ModelConfig.token_flops) per core of this process, and the cores:
    what both "auto" rules draw their line on."""
    cores = len(available_cores())
    return model_config.token_flops / cores, cores


def reserved_now() -> int:
    """How many cores the process's threads are split off for the host now (0: none)."""
    return _reserved


def auto_reserved_cores(model_config, *, cpu: bool, jax_started: bool, own_devices: bool,
                        async_scheduling: bool, reserved: int = 0) -> tuple[int, str]:
    """EngineArgs.cpu_reserved_cores="auto", decided before jax starts: (cores to reserve, why).

    One core, for the host, where the model's work per token is small for this machine: the
    device's step is then short beside the host's work per step, which a second device thread
    cannot hide (it shares the host's core) but a core of the host's own can. Otherwise 0; and 0
    where a reserve is not this engine's to make: off the CPU platform, where jax started before
    the engine (its pools have a thread for every core: size_xla_pools), for an engine given its
    devices (a data-parallel replica: the reserve is process-wide) or split over several. Without
    overlapped scheduling the line is lower (the host's work is not beside the device's; the
    reserve still spares the device's threads the host's turns). `reserved`: the split an earlier
    engine of this process made, which a later one keeps (the pools were sized for it; 0 would put
    every thread back on every core)."""
    if not cpu:
        return 0, "the model does not run on the host's cores"
    if reserved:
        return reserved, f"an earlier engine of this process reserved {reserved} (the split is process-wide)"
    if jax_started:
        return 0, "jax started before the engine, with a CPU thread pool for every core"
    if not own_devices:
        return 0, "the engine shares this process's cores with other replicas or hosts"
    per_core, cores = _flops_per_core(model_config)
    if cores < 2:
        return 0, "this process may use one core"
    line = AUTO_MAX_FLOPS_PER_CORE if async_scheduling else AUTO_MAX_FLOPS_PER_CORE_SYNC
    mode = "" if async_scheduling else ", without overlapped scheduling"
    if per_core >= line:
        return 0, (f"the model's {per_core / 1e6:.1f} MFLOP a token per core (of {cores}) wants every core "
                   f"(reserving pays below {line / 1e6:g}{mode})")
    return 1, (f"the model's {per_core / 1e6:.2f} MFLOP a token per core (of {cores}) is below "
               f"{line / 1e6:g}{mode}: its steps are short beside the host's work")


# the model's FLOPs a token per core below which an engine with no core reserved for the host
# still overlaps its steps on a CPU: the device's step is then short and leaves the cores idle at
# its joins, which the host's work fills. Above it the host's work preempts the device's threads
# (a parallel loop waits for its slowest thread) and hides nothing (docs/PERFORMANCE.md,
# "Decisions in the code")
AUTO_OVERLAP_MAX_FLOPS_PER_CORE = 1.5e6


def auto_async_scheduling(model_config, *, cpu: bool, reserved: int, multi_host: bool) -> tuple[bool, str]:
    """EngineArgs.async_scheduling=None on this platform: (overlap the host's work with the
    device's step, why). On beside an accelerator, and on a CPU where the host has a core of its
    own (cpu_reserved_cores) or the model's steps are short; off on a CPU where the host's work
    would take turns with the device's threads on every core. Always on for an engine spread over
    several hosts, which must all decide the same whatever their cores."""
    if not cpu:
        return True, "the host works beside an accelerator"
    if multi_host:
        return True, "an engine over several hosts overlaps on every host"
    if reserved:
        return True, f"the host has {reserved} core(s) of its own"
    per_core, cores = _flops_per_core(model_config)
    line = AUTO_OVERLAP_MAX_FLOPS_PER_CORE
    if per_core < line:
        return True, (f"the model's {per_core / 1e6:.2f} MFLOP a token per core (of {cores}) is below "
                      f"{line / 1e6:g}: its steps leave cores idle for the host's work")
    return False, (f"the model's {per_core / 1e6:.1f} MFLOP a token per core (of {cores}) keeps every core busy, "
                   f"and no core is reserved for the host: its work would only delay the device's threads "
                   f"(overlap pays below {line / 1e6:g}, or with cpu_reserved_cores)")


def pool_threads() -> int:
    """How many threads XLA's CPU intra-op pool has in this process (0 before jax starts it)."""
    count = 0
    for name in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{name}/comm") as f:
                count += f.read().strip() == _POOL_THREAD
        except OSError:  # a thread that ended meanwhile
            continue
    return count


def reserve(n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Python threads on the last n cores, every other thread on the rest; numba's regions limited
    to the rest's count. Returns (host cores, device cores). Safe to call again (an engine built
    later sweeps the threads started since); n = 0 after a reserve puts every thread back on every
    core and lifts the limit."""
    global _cores, _reserved
    if n == 0 and _cores is None:  # nothing was ever reserved: nothing to undo (any platform)
        return (), ()
    check(n)
    cores = available_cores()
    _cores = cores
    _reserved = n
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
    global _pool_warned
    pool = pool_threads()
    if n and pool > len(device) and _pools_skipped and not _pool_warned and not envs.xla_pool_size_set():
        _pool_warned = True  # once a process: the pools do not change
        logger.warning("cpu_reserved_cores=%d: XLA's CPU thread pool has %d threads for %d device core(s): %s, "
                       "sized to every core, and the threads will take turns on the device's cores (a slower "
                       "step). Build the engine before using jax in this process, or set PJRT_NPROC=%d in the "
                       "environment before jax starts", n, pool, len(device), _pools_skipped, len(device))
    logger.info("cpu_reserved_cores=%d: %d Python thread(s) on core(s) %s, the other threads (XLA, numba) on %s; "
                "%d thread(s) placed", n, len(python), list(host), list(device), moved)
    return host, device
