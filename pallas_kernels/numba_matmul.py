"""The layers' weight matmuls on a CPU, x [T, K] @ w [K, N] in float32, as a numba kernel over weights
packed once at start: w [K, N] -> [N / NR, K, NR], NR columns at a time, each panel contiguous.

Why: a matmul library packs the weight into panels on every call. With few rows (a decode step's
T = 8 ... 128) that copy costs as much as the arithmetic: XLA:CPU's dots ran at 100-300 GFLOP/s
there against ~450 at T = 2048 on the demo model's shapes, and vLLM's CPU path holds its weights
prepacked for oneDNN for the same reason. With the panels packed at start, this kernel runs every
T near the machine's float32 peak (docs/PERFORMANCE.md, "Decisions in the code").

The micro-kernel is numba_tile.py's "packed" form: an MR x NR block of the result held in vector
registers through the whole sum over K, prefetching the thread's next panel. The driver deals
panels out to numba's threads and walks the rows in blocks of MB, so a block of x stays in L2 while
every panel of the thread passes over it.

Used by the "numba" attention backend's engines (runner.py packs the weights; models/layers.linear
calls `matmul` on a packed weight). Shapes are read at run time; the functions are cached on disk.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import carray, cfunc, njit, prange

from pallas_kernels import cpu_ffi
from pallas_kernels.cpu_ffi import ARGS, RETS, buffer, dim, pointer
from pallas_kernels.numba_kernels import _CACHE_HANDLERS, _THREADS
from pallas_kernels.numba_tile import NR, make_tile  # NR: columns per panel

MB = 192  # rows per outer block: 192 x K float32 of x stays in a 1 MB L2 for K up to ~1300

_tile8, _tile4, _tile2, _tile1 = (make_tile(r, "packed") for r in (8, 4, 2, 1))


@njit(fastmath=True, parallel=True, cache=True)
def packed_matmul(x, w, out):
    """out f32[M, N] = x f32[M, K] @ W, w the packed W f32[P, K, NR] (N = P * NR); all C-contiguous."""
    M, K = x.shape
    P = w.shape[0]
    N = P * NR
    xf, wf, of = x.ravel(), w.ravel(), out.ravel()
    n_threads = min(_THREADS, max(P, 1))
    for t in prange(n_threads):
        p0, p1 = P * t // n_threads, P * (t + 1) // n_threads
        for m0 in range(0, M, MB):
            m1 = min(M, m0 + MB)
            r = (m1 - m0) % 8  # row tiles of a panel: 8 rows each, then one of 4, 2 and 1 as needed
            n_tiles = (m1 - m0) // 8 + (r >= 4) + (r % 4 >= 2) + r % 2
            for p in range(p0, p1):
                b = p * K * NR
                ahead = (p + 1 if p + 1 < p1 else p0) * K * NR  # the weights come from memory every step
                m = m0
                i = 0
                while m + 8 <= m1:
                    _tile8(xf, m * K, K, wf, b, ahead, n_tiles, i, of, m * N + p * NR, N, K)
                    m += 8
                    i += 1
                if m + 4 <= m1:
                    _tile4(xf, m * K, K, wf, b, ahead, n_tiles, i, of, m * N + p * NR, N, K)
                    m += 4
                    i += 1
                if m + 2 <= m1:
                    _tile2(xf, m * K, K, wf, b, ahead, n_tiles, i, of, m * N + p * NR, N, K)
                    m += 2
                    i += 1
                if m < m1:
                    _tile1(xf, m * K, K, wf, b, ahead, n_tiles, i, of, m * N + p * NR, N, K)


# FFI handler. Arguments: x f32[M, K], w f32[P, K, NR]; result f32[M, P * NR].
@cfunc(cpu_ffi.HANDLER_SIGNATURE, cache=_CACHE_HANDLERS)
def handler(frame_ptr):
    frame = cpu_ffi.frame_words(frame_ptr)
    if not cpu_ffi.answer_metadata(frame) and cpu_ffi.executing(frame):
        x_p, x_d = buffer(frame, ARGS, 0)
        w_p, w_d = buffer(frame, ARGS, 1)
        M, K, P = dim(x_d, 0), dim(x_d, 1), dim(w_d, 0)
        packed_matmul(carray(pointer(x_p), (M, K), dtype=np.float32),
                      carray(pointer(w_p), (P, K, NR), dtype=np.float32),
                      carray(pointer(buffer(frame, RETS, 0)[0]), (M, P * NR), dtype=np.float32))
    return cpu_ffi.success()


def packable(w) -> bool:
    """Whether a weight can be packed: float32 [K, N] with N a multiple of NR."""
    return w.ndim == 2 and w.dtype == np.float32 and w.shape[1] % NR == 0 and w.shape[1] > 0


def pack(w: np.ndarray) -> np.ndarray:
    """[K, N] -> [N / NR, K, NR]: panel p holds columns p * NR ... (p + 1) * NR - 1, row by row."""
    K, N = w.shape
    return np.ascontiguousarray(np.asarray(w).reshape(K, N // NR, NR).transpose(1, 0, 2))


def unpack(wp: np.ndarray) -> np.ndarray:
    """pack's inverse."""
    P, K, _ = wp.shape
    return np.ascontiguousarray(np.asarray(wp).transpose(1, 0, 2).reshape(K, P * NR))


@functools.cache
def _target() -> str:
    name = "jaxsched_numba_matmul_f32"
    cpu_ffi.register(name, handler)
    return name


def matmul(x, wp):
    """x [..., K] @ W with wp = pack(W) (a jax array), in float32, inside a jitted program."""
    import jax
    import jax.numpy as jnp

    P, K, _ = wp.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).astype(jnp.float32)
    out = jax.ffi.ffi_call(_target(), jax.ShapeDtypeStruct((x2.shape[0], P * NR), jnp.float32))(x2, wp)
    return out.reshape(*lead, P * NR).astype(x.dtype)
