"""How many threads the numba kernels' parallel regions use, chosen at run time.

numba's pool is sized once per process (NUMBA_NUM_THREADS, read when numba starts), and
numba.set_num_threads only sets the count for regions launched from the calling thread. Our
kernels are launched from XLA's threads (cpu_ffi.py), which Python never runs on. So the count is
a process-wide int under a C symbol, and every kernel's FFI handler calls `apply_limit()` first:
with a count set, the handler sets numba's per-thread count on the XLA thread it runs on, and the
region launches that many threads (one: the calling thread alone, no wake-up of the pool).

Why: with a core set aside for the host (jaxsched/platforms/cpu_affinity.py), the device's threads share
the rest, and a region that waits for a second pool thread on the same core costs more than it
shares (docs/PERFORMANCE.md, "Decisions in the code").

The handlers reach the count through the symbol, not an address: their machine code is cached on
disk (numba's cache) and loaded in later processes, where LLVM's linker resolves the name to this
process's int, as numba resolves its own pool's entry points. `_define` runs at import, before any
module that calls apply_limit() compiles or loads a handler.
"""

from __future__ import annotations

import ctypes

from llvmlite import binding as ll
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_SYMBOL = "jaxsched_numba_thread_limit"
_limit = ctypes.c_int(0)  # 0: never set (the handlers leave numba's count alone); else the count
_requested = 0  # what set_limit() was last given (0: the whole pool)


def _define() -> None:
    ll.add_symbol(_SYMBOL, ctypes.addressof(_limit))
    # apply_limit() calls numba's set_num_threads by symbol, which exists once the pool has started:
    # compiling or loading it from the cache before that would abort the process
    from numba.np.ufunc.parallel import _launch_threads

    _launch_threads()


_define()


def set_limit(n: int) -> None:
    """Threads per parallel region from now on, for every kernel call in this process (0: the
    whole pool again). More than the pool holds runs the pool."""
    global _requested
    from numba import config

    if n < 0:
        raise ValueError(f"a thread limit must be 0 (none) or positive, got {n}")
    pool = int(config.NUMBA_NUM_THREADS)
    _requested = min(n, pool)
    # 0 stores the pool's size, so that the handlers set it back on threads an earlier limit lowered
    # (the C entry point does not check the count against the pool)
    _limit.value = _requested or pool


def limit() -> int:
    """The limit in force (0: none, the whole pool)."""
    return _requested


@intrinsic
def _read_limit(typingctx):
    def codegen(context, builder, signature, args):
        mod = builder.module
        gv = mod.globals.get(_SYMBOL)
        if gv is None:
            gv = ir.GlobalVariable(mod, ir.IntType(32), _SYMBOL)
            gv.linkage = "external"
        return builder.load(gv)
    return types.int32(), codegen


@intrinsic
def _set_num_threads(typingctx, n):
    def codegen(context, builder, signature, args):
        # numba's threading layer's entry point, by symbol (registered when its pool starts)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(32)]),
                                            "set_num_threads")
        builder.call(fn, [context.cast(builder, args[0], signature.args[0], types.int32)])
        return context.get_dummy_value()
    return types.void(n), codegen


@njit(cache=True)
def apply_limit():
    """In a kernel's handler, before its parallel region: the calling thread's region size is the
    limit, once one has been set (set_limit(0) sets the pool's size back)."""
    n = _read_limit()
    if n > 0:
        _set_num_threads(n)
