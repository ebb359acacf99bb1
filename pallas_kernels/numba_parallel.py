"""numba's parallel regions without the GIL where their caller does not hold it.

numba runs a `prange` loop through a generated kernel that takes the GIL (PyGILState_Ensure), lets
it go for the region (PyEval_SaveThread) and takes it back after it (PyEval_RestoreThread) before
releasing it again: written for callers that hold the GIL, from Python. Our kernels are called by
XLA's threads inside a compiled step (cpu_ffi.py), which do not hold it, so every region waited
twice for the GIL. The thread that holds it is the engine's, scheduling and packing the next step,
or the server's event loop; a Python thread gives the GIL up only when it blocks or at its switch
interval (5 ms). So the device made no progress while the host ran Python, and overlapped
scheduling could not overlap (docs/PERFORMANCE.md, "Overlapped scheduling and the host's share of a step").

install() makes the kernel ask PyGILState_Check() first: a caller that holds the GIL gets numba's
release and re-acquire as before; one that does not (XLA's threads) runs the region without
touching it. Nothing in a nopython region needs the GIL (numba's error paths take it themselves),
so this changes nothing else for any numba code in the process. It must run before a parallel
function is compiled; the kernel becomes part of numba's disk cache, which is keyed on the source
files of the modules that import this one.
"""

from __future__ import annotations

import logging

from llvmlite import ir
from numba.core import cgutils

logger = logging.getLogger(__name__)

_installed = False


class _RegionAPI:
    """numba's PythonAPI for the builder of one region's kernel, whose GIL calls touch the GIL only
    if the calling thread holds it. The kernel builder calls gil_ensure, save_thread, (the region),
    restore_thread, gil_release, once each and in that order."""

    def __init__(self, api) -> None:
        self._api = api
        self._held = None  # i1: PyGILState_Check() != 0, read by the calls after gil_ensure

    def __getattr__(self, name):
        return getattr(self._api, name)

    def gil_ensure(self):
        api, b = self._api, self._api.builder
        check = api._get_function(ir.FunctionType(ir.IntType(32), []), name="PyGILState_Check")
        self._held = b.icmp_unsigned("!=", b.call(check, []), ir.Constant(ir.IntType(32), 0))
        return self._held

    def save_thread(self):
        api, b = self._api, self._api.builder
        slot = cgutils.alloca_once_value(b, ir.Constant(api.voidptr, None))
        with b.if_then(self._held):
            b.store(api.save_thread(), slot)
        return b.load(slot)

    def restore_thread(self, thread_state) -> None:
        with self._api.builder.if_then(self._held):
            self._api.restore_thread(thread_state)

    def gil_release(self, held) -> None:
        pass  # gil_ensure took nothing


class _RegionContext:
    """The target context handed to numba's kernel builder: the real one, but with _RegionAPI as
    its Python API."""

    def __init__(self, ctx) -> None:
        self._ctx = ctx

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def get_python_api(self, builder):
        return _RegionAPI(self._ctx.get_python_api(builder))


def install() -> bool:
    """Patch numba's parallel-region kernel builder (once per process). False where this numba's
    internals differ from the ones known here: its kernels then keep the GIL round trips (correct,
    but a device step waits on Python threads), and a warning says so."""
    global _installed
    if _installed:
        return True
    try:
        from numba.core.pythonapi import PythonAPI
        from numba.np.ufunc import parallel
        original = parallel.build_gufunc_kernel
        for method in ("gil_ensure", "gil_release", "save_thread", "restore_thread", "_get_function"):
            getattr(PythonAPI, method)
    except (ImportError, AttributeError) as e:
        logger.warning("numba's parallel regions will take the GIL on XLA's threads (%s): a CPU step then "
                       "waits for the Python threads; numba 0.68 is the version this was written for", e)
        return False

    def build_gufunc_kernel(library, ctx, info, sig, inner_ndim):
        return original(library, _RegionContext(ctx), info, sig, inner_ndim)

    build_gufunc_kernel.__wrapped__ = original
    parallel.build_gufunc_kernel = build_gufunc_kernel
    _installed = True
    return True
