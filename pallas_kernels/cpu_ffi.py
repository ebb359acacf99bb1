"""Calling numba-compiled CPU kernels from a jitted XLA program, through XLA's typed FFI.

XLA:CPU reads KV pages through gathers, which copy them (docs/PERFORMANCE.md): a kernel that reads
pages where they lie has to live outside XLA. It is written in Python and compiled by numba; this
module turns it into an XLA FFI handler, so `jax.ffi.ffi_call` runs it inside the compiled step, on
the step's own buffers, with no copy and no host callback.

An FFI handler is a C function `XLA_FFI_Error* handler(XLA_FFI_CallFrame*)`. numba compiles one with
`@cfunc`; what it cannot do by itself is walk the C structs XLA hands it, so the few fields read here
are addressed as 64-bit words, at the offsets of xla/ffi/api/c_api.h (FFI API 0.x, which jaxlib
ships as include/xla/ffi/api/c_api.h; every struct starts with struct_size and extension_start):

  XLA_FFI_CallFrame  word 1 extension_start, word 4 stage (int32), args at word 5, rets at word 10
  XLA_FFI_Args/Rets  word 2 size, word 4 the array of buffer pointers (so frame words 7/9, 12/14)
  XLA_FFI_Buffer     word 3 data, word 4 rank, word 5 dims (int64[rank])

XLA calls the handler once at registration with a metadata extension (it checks the FFI version
the handler was built for), then once per execution. Shapes and dtypes are static per program and
checked in Python before the call is traced, so a handler only reads pointers and sizes. A handler
is `cfunc(HANDLER_SIGNATURE, cache=True)` of a module-level function (numba caches only those), made
at import or, where compiling it is slow, on first use (numba_kernels.handler):

    frame = frame_words(frame_ptr)
    if not answer_metadata(frame) and executing(frame):
        ...  # buffer(frame, ARGS, i) / buffer(frame, RETS, i) -> (data address, dims address)
    return success()

This module imports numba unconditionally; numba_attention.py decides whether it can be used.
"""

from __future__ import annotations

import ctypes

import numpy as np
from numba import carray, njit, types
from numba.core.extending import intrinsic

_FFI_API_MAJOR, _FFI_API_MINOR = 0, 3  # the version of c_api.h the offsets above come from
_EXTENSION_METADATA = 1  # XLA_FFI_Extension_Metadata
_STAGE_EXECUTE = 3  # XLA_FFI_ExecutionStage_EXECUTE
ARGS, RETS = 9, 14  # words of the CallFrame holding the args / rets pointer arrays
HANDLER_SIGNATURE = types.voidptr(types.voidptr)  # XLA_FFI_Error* (XLA_FFI_CallFrame*)


@intrinsic
def pointer(typingctx, addr):
    """An int64 address as a void pointer (what carray takes)."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))
    return types.voidptr(types.int64), codegen


@njit(inline="always")
def words(addr, n):
    """n 64-bit words at address `addr` (a struct seen as int64[n])."""
    return carray(pointer(addr), (n,), dtype=np.int64)


@njit(inline="always")
def frame_words(frame_ptr):
    """The call frame's first 16 words (every field read here is among them)."""
    return carray(frame_ptr, (16,), dtype=np.int64)


@njit(inline="always")
def answer_metadata(frame) -> bool:
    """If XLA is asking for the handler's metadata, fill it in and return True."""
    ext = frame[1]
    if ext == 0:
        return False
    e = words(ext, 4)  # XLA_FFI_Extension_Base {struct_size, type, next} + metadata pointer
    if (e[1] & 0xFFFFFFFF) != _EXTENSION_METADATA:
        return False
    md = carray(pointer(e[3]), (10,), dtype=np.int32)  # XLA_FFI_Metadata as int32 words
    md[6] = _FFI_API_MAJOR  # api_version.major_version (byte 24)
    md[7] = _FFI_API_MINOR  # api_version.minor_version (byte 28)
    md[8] = 0  # traits: none
    return True


@njit(inline="always")
def executing(frame) -> bool:
    return (frame[4] & 0xFFFFFFFF) == _STAGE_EXECUTE


@njit(inline="always")
def buffer(frame, which, i):
    """(data address, dims address) of argument i (which=ARGS) or result i (which=RETS)."""
    b = words(words(frame[which], i + 1)[i], 6)
    return b[3], b[5]


@njit(inline="always")
def count(frame, which):
    """How many arguments (which=ARGS) or results (which=RETS) the call has: the size word, two
    before the buffer array."""
    return frame[which - 2]


@njit(inline="always")
def dim(dims_addr, i):
    return words(dims_addr, i + 1)[i]


@njit(inline="always")
def success():
    return pointer(0)  # a null XLA_FFI_Error*


_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)


def register(name: str, handler) -> None:
    """Register a numba `@cfunc(HANDLER_SIGNATURE)` with XLA:CPU under `name`. Register each name
    once (XLA refuses a second, different handler under the same name); the cfunc object must stay
    alive as long as programs that call it (module-level or cached ones do)."""
    import jax

    capsule = _PyCapsule_New(handler.address, b"xla._CUSTOM_CALL_TARGET", None)
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")
