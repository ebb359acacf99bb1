"""Keep freed host memory in the process on a CPU backend, so that each step does not fault it in again.

XLA:CPU allocates an executable's temporary buffer (all its intermediates, in one block) at every
run and frees it afterwards. glibc serves a block over 32 MiB, and any block larger than a worker
thread's arena can hold, with a fresh mmap, and gives it back with munmap at free: every run then
pays a page fault and the zeroing of each page it touches, on the step's critical path. The
sampler's temporary buffer holds several [S, V] arrays, so a sampled step of many rows spent a large
share of its time in the kernel (docs/PERFORMANCE.md, "Decisions in the code").

The cure is glibc's own switches, set before any worker thread allocates: one arena (whose heap can
grow with brk), no mmap for large blocks, and a trim threshold that keeps up to 1 GiB of freed
memory at the top of the heap. The process keeps its peak host memory instead of returning it to
the kernel after each step, as a caching allocator would (vLLM's CPU build asks for tcmalloc for the
same reason).

An engine core applies this when it starts, before anything it does touches jax, because it must
come before jax's threads first allocate, which is before the engine knows its devices; importing
jaxsched changes nothing. (glibc fixes the arena count when a thread other than the main one first
allocates; applied after that, only the mmap switches take effect, and the large blocks of the
other threads' arenas are still mapped afresh: an application that starts jax before its first
engine gets less of it.) So the choice comes from the environment: JAXSCHED_HOST_MALLOC=keep
applies it, =system leaves glibc as it is (an embedding application's opt-out), and the default,
auto, applies it when jax will run on the CPU (platforms.expected()). On a GPU the large buffers live in device memory, which XLA pools already.
Only Linux with glibc has these switches.

One arena has a cost of its own: every allocation of the device's threads and of the host's Python
thread takes the same lock, and memory one thread frees is handed to the other. With overlapped
scheduling both allocate at the same time, and a small model's step is slowed by it (the tiny
model's overlapped step: docs/PERFORMANCE.md, "Decisions in the code"). The one arena is only needed
where a program's temporary buffer is too large for a thread arena's heap. So an engine that is
built before jax starts its threads calls `allow_thread_arenas` with the largest temporary buffer
its programs can take, and where that fits, every thread that allocates from then on (jax's among
them) gets an arena of its own again. JAXSCHED_HOST_MALLOC=keep keeps one arena whatever the engine.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
from collections.abc import Mapping

from jaxsched import envs
from jaxsched.platforms.platform import expected

logger = logging.getLogger(__name__)

ENV = envs.HOST_MALLOC

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
TRIM_THRESHOLD = 1 << 30
# glibc's HEAP_MAX_SIZE on 64-bit: a thread arena's heaps are this large at most, and a block that
# does not fit one is mapped afresh at every allocation, whatever M_MMAP_MAX says
THREAD_HEAP_BYTES = 64 << 20

# this process's malloc as set here: None until keep_freed_memory() decided (it decides once);
# then "system" (glibc's own), "keep" (one arena whatever the engine), "auto" (one arena, which
# allow_thread_arenas may lift) or "threads" (auto, with arenas of their own given back to threads)
state: str | None = None


def applied() -> bool:
    """Whether freed memory is kept (the settings above are in effect)."""
    return state in ("keep", "auto", "threads")


def _glibc():
    """This process's C library when it is glibc on Linux (whose switches this module sets), else None."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL("libc.so.6")



def keep_freed_memory(environ: Mapping[str, str] | None = None) -> bool:
    """Apply the settings above when JAXSCHED_HOST_MALLOC asks for them; True when they were set."""
    global state
    state = "system"
    choice = envs.host_malloc(environ)
    if choice == "system" or (choice == "auto" and not expected(environ).host_runs_model):
        return False
    libc = _glibc()
    if libc is None:
        if choice == "keep":
            logger.warning("%s=keep needs Linux with glibc; this is %s with %s: left as it is", ENV, sys.platform,
                           platform.libc_ver()[0] or "another C library")
        return False
    # the arena count first: glibc fixes it when a second thread first allocates
    ok = all(libc.mallopt(p, v) == 1 for p, v in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0),
                                                  (_M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
    if not ok:
        logger.warning("glibc refused a mallopt setting; host memory is returned to the kernel after each step")
    state = choice if ok else "system"
    return ok


def allow_thread_arenas(largest_block: int) -> bool:
    """Give every thread that first allocates from now on an arena of its own (glibc's default
    count), where keep_freed_memory() set one arena under the `auto` choice and no block of
    `largest_block` bytes (an engine's largest program temporary buffer) would be too large for a
    thread arena's heap. Returns whether it did.

    Threads keep the arena they first allocated from, and glibc fixes its arena limit when a thread
    other than the main one first allocates: called before jax starts its threads (the engine does
    it before anything else touches jax), it moves jax's; called later, only threads started after
    it, if any, and none where the limit was already fixed: so it does nothing once jax has started.
    Process-wide: the first engine decides."""
    global state
    if state != "auto" or largest_block > THREAD_HEAP_BYTES // 2:
        return False
    try:
        from jax._src import xla_bridge

        started = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # a jax without it: assume started (the one arena stays)
        started = True
    if started:  # jax's threads have taken the one arena, and glibc has fixed its limit
        return False
    libc = _glibc()  # not None: applied
    # glibc's default limit (NARENAS_FROM_NCORES); mallopt takes no 0 for "the default"
    if libc.mallopt(_M_ARENA_MAX, 8 * (os.cpu_count() or 1)) != 1:
        return False
    state = "threads"
    return True


def arena_count() -> int:
    """How many malloc arenas this process has (glibc's malloc_info); 0 where that cannot be read."""
    libc = _glibc()
    if libc is None:
        return 0
    import tempfile

    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = (ctypes.c_char_p, ctypes.c_char_p)
    libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.fclose.argtypes = (ctypes.c_void_p,)
    with tempfile.NamedTemporaryFile("r", suffix=".xml") as f:
        fp = libc.fopen(f.name.encode(), b"w")
        if not fp:
            return 0
        libc.malloc_info(0, fp)
        libc.fclose(fp)
        return f.read().count("<heap nr=")


def release_freed() -> None:
    """Give the kernel back the host memory freed so far (glibc's malloc_trim): once, when an
    engine has started, so that the host copies of its weights' loading (a GGUF file dequantized,
    tensors stacked) and the temporary buffers of every program warm-up ran do not stay in the
    process up to the trim threshold kept for the steps' buffers."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def apply_once() -> bool:
    """keep_freed_memory() the first time an engine of this process starts; later engines find
    the process as the first one left it. Returns whether the settings are in effect."""
    if state is None:
        keep_freed_memory()
    return applied()
