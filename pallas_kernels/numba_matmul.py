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
from pallas_kernels.numba_kernels import _CACHE_HANDLERS, _THREADS, _exp
from pallas_kernels.numba_tile import NR, make_tile  # NR: columns per panel

MB = 192  # rows per outer block: 192 x K float32 of x stays in a 1 MB L2 for K up to ~1300

_tile8, _tile4, _tile2, _tile1 = (make_tile(r, "packed") for r in (8, 4, 2, 1))
_add8, _add4, _add2, _add1 = (make_tile(r, "packed", accumulate=True) for r in (8, 4, 2, 1))
ACTIVATIONS = ("silu", "gelu_tanh")  # glu's act: 0, 1


@njit(fastmath=True, inline="always", cache=True)
def _panel_rows(xf, K, wf, b, ahead, c, c0, ldc, m0, m1, add):
    """Rows m0 <= m < m1 of x against the panel at b: c[c0 + (m - m0) * ldc + 0:NR] = (or += with
    add) x[m] . panel, in row tiles of 8, then one of 4, 2 and 1 as needed; the tiles take turns
    prefetching the panel at `ahead` (the weights come from memory every step)."""
    r = (m1 - m0) % 8
    n_tiles = (m1 - m0) // 8 + (r >= 4) + (r % 4 >= 2) + r % 2
    m = m0
    i = 0
    while m + 8 <= m1:
        if add:
            _add8(xf, m * K, K, wf, b, ahead, n_tiles, i, c, c0 + (m - m0) * ldc, ldc, K)
        else:
            _tile8(xf, m * K, K, wf, b, ahead, n_tiles, i, c, c0 + (m - m0) * ldc, ldc, K)
        m += 8
        i += 1
    if m + 4 <= m1:
        if add:
            _add4(xf, m * K, K, wf, b, ahead, n_tiles, i, c, c0 + (m - m0) * ldc, ldc, K)
        else:
            _tile4(xf, m * K, K, wf, b, ahead, n_tiles, i, c, c0 + (m - m0) * ldc, ldc, K)
        m += 4
        i += 1
    if m + 2 <= m1:
        if add:
            _add2(xf, m * K, K, wf, b, ahead, n_tiles, i, c, c0 + (m - m0) * ldc, ldc, K)
        else:
            _tile2(xf, m * K, K, wf, b, ahead, n_tiles, i, c, c0 + (m - m0) * ldc, ldc, K)
        m += 2
        i += 1
    if m < m1:
        if add:
            _add1(xf, m * K, K, wf, b, ahead, n_tiles, i, c, c0 + (m - m0) * ldc, ldc, K)
        else:
            _tile1(xf, m * K, K, wf, b, ahead, n_tiles, i, c, c0 + (m - m0) * ldc, ldc, K)


@njit(fastmath=True, parallel=True, cache=True)
def packed_matmul(x, w, out, add):
    """out f32[M, N] = x f32[M, K] @ W (add: out += x @ W), w the packed W f32[P, K, NR]
    (N = P * NR); all C-contiguous."""
    M, K = x.shape
    P = w.shape[0]
    N = P * NR
    xf, wf, of = x.ravel(), w.ravel(), out.ravel()
    n_threads = min(_THREADS, max(P, 1))
    for t in prange(n_threads):
        p0, p1 = P * t // n_threads, P * (t + 1) // n_threads
        for m0 in range(0, M, MB):
            m1 = min(M, m0 + MB)
            for p in range(p0, p1):
                ahead = (p + 1 if p + 1 < p1 else p0) * K * NR
                _panel_rows(xf, K, wf, p * K * NR, ahead, of, m0 * N + p * NR, N, m0, m1, add)


@njit(fastmath=True, inline="always", cache=True)
def _act(g, act):
    """silu(g) (act 0) or gelu with the tanh approximation (act 1), through _exp of a value <= 0."""
    if act == 0:
        e = _exp(-abs(g))  # sigmoid(|g|) = 1 / (1 + e)
        return g / (np.float32(1.0) + e) if g >= 0 else g * e / (np.float32(1.0) + e)
    y = np.float32(0.7978845608028654) * (g + np.float32(0.044715) * g * g * g)
    e = _exp(np.float32(-2.0) * abs(y))  # tanh(|y|) = (1 - e) / (1 + e)
    th = (np.float32(1.0) - e) / (np.float32(1.0) + e)
    return np.float32(0.5) * g * (np.float32(1.0) + (th if y >= 0 else -th))


@njit(fastmath=True, parallel=True, cache=True)
def packed_glu(x, w, out, act):
    """out f32[M, F] = act(x @ Wg) * (x @ Wu), w the packed [Wg Wu] f32[P, K, NR] (the fused gate/up
    weight: its first P / 2 panels are the gate's, F = P / 2 * NR). Panel j of the gate and of the
    up projection run one after the other over a block of rows, the up tile into a scratch block
    that stays in cache, so the [M, 2F] product is never written."""
    M, K = x.shape
    half = w.shape[0] // 2
    F = half * NR
    xf, wf, of = x.ravel(), w.ravel(), out.ravel()
    n_threads = min(_THREADS, max(half, 1))
    for t in prange(n_threads):
        j0, j1 = half * t // n_threads, half * (t + 1) // n_threads
        up = np.empty(MB * NR, np.float32)
        for m0 in range(0, M, MB):
            m1 = min(M, m0 + MB)
            for j in range(j0, j1):
                gate, upp = j * K * NR, (j + half) * K * NR
                ahead = (j + 1 if j + 1 < j1 else j0) * K * NR
                _panel_rows(xf, K, wf, gate, upp, of, m0 * F + j * NR, F, m0, m1, False)
                _panel_rows(xf, K, wf, upp, ahead, up, 0, NR, m0, m1, False)
                for m in range(m0, m1):
                    o = m * F + j * NR
                    u = (m - m0) * NR
                    for c in range(NR):
                        of[o + c] = _act(of[o + c], act) * up[u + c]


# FFI handlers. Arguments: x f32[M, K], w f32[P, K, NR]; result f32[M, P * NR]. handler_add takes a
# third argument, f32[M, P * NR], which the result aliases (jax.ffi.ffi_call's input_output_aliases):
# the product is added to it. handler_silu / handler_gelu: result f32[M, P / 2 * NR] (packed_glu).
@njit(inline="always", cache=True)
def _operands(frame):
    x_p, x_d = buffer(frame, ARGS, 0)
    w_p, w_d = buffer(frame, ARGS, 1)
    M, K, P = dim(x_d, 0), dim(x_d, 1), dim(w_d, 0)
    return (carray(pointer(x_p), (M, K), dtype=np.float32), carray(pointer(w_p), (P, K, NR), dtype=np.float32),
            M, P)


@cfunc(cpu_ffi.HANDLER_SIGNATURE, cache=_CACHE_HANDLERS)
def handler(frame_ptr):
    frame = cpu_ffi.frame_words(frame_ptr)
    if not cpu_ffi.answer_metadata(frame) and cpu_ffi.executing(frame):
        x, w, M, P = _operands(frame)
        packed_matmul(x, w, carray(pointer(buffer(frame, RETS, 0)[0]), (M, P * NR), dtype=np.float32), False)
    return cpu_ffi.success()


@cfunc(cpu_ffi.HANDLER_SIGNATURE, cache=_CACHE_HANDLERS)
def handler_add(frame_ptr):
    frame = cpu_ffi.frame_words(frame_ptr)
    if not cpu_ffi.answer_metadata(frame) and cpu_ffi.executing(frame):
        x, w, M, P = _operands(frame)
        out = carray(pointer(buffer(frame, RETS, 0)[0]), (M, P * NR), dtype=np.float32)
        base_p = buffer(frame, ARGS, 2)[0]
        if base_p != buffer(frame, RETS, 0)[0]:  # aliased by the call; should XLA ever not, copy
            out[:] = carray(pointer(base_p), (M, P * NR), dtype=np.float32)
        packed_matmul(x, w, out, True)
    return cpu_ffi.success()


@cfunc(cpu_ffi.HANDLER_SIGNATURE, cache=_CACHE_HANDLERS)
def handler_silu(frame_ptr):
    frame = cpu_ffi.frame_words(frame_ptr)
    if not cpu_ffi.answer_metadata(frame) and cpu_ffi.executing(frame):
        x, w, M, P = _operands(frame)
        packed_glu(x, w, carray(pointer(buffer(frame, RETS, 0)[0]), (M, P // 2 * NR), dtype=np.float32), 0)
    return cpu_ffi.success()


@cfunc(cpu_ffi.HANDLER_SIGNATURE, cache=_CACHE_HANDLERS)
def handler_gelu(frame_ptr):
    frame = cpu_ffi.frame_words(frame_ptr)
    if not cpu_ffi.answer_metadata(frame) and cpu_ffi.executing(frame):
        x, w, M, P = _operands(frame)
        packed_glu(x, w, carray(pointer(buffer(frame, RETS, 0)[0]), (M, P // 2 * NR), dtype=np.float32), 1)
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


_HANDLERS = {"matmul": handler, "matmul_add": handler_add, "glu_silu": handler_silu,
             "glu_gelu_tanh": handler_gelu}


@functools.cache
def _target(kind: str) -> str:
    name = f"jaxsched_numba_{kind}_f32"
    cpu_ffi.register(name, _HANDLERS[kind])
    return name


def matmul(x, wp, add=None):
    """x [..., K] @ W with wp = pack(W) (a jax array), in float32, inside a jitted program; plus
    `add` [..., N] (a residual), summed into the kernel's accumulators instead of in a pass of its own."""
    import jax
    import jax.numpy as jnp

    P, K, _ = wp.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).astype(jnp.float32)
    out_type = jax.ShapeDtypeStruct((x2.shape[0], P * NR), jnp.float32)
    if add is None:
        out = jax.ffi.ffi_call(_target("matmul"), out_type)(x2, wp)
    else:
        base = add.reshape(-1, P * NR).astype(jnp.float32)
        out = jax.ffi.ffi_call(_target("matmul_add"), out_type, input_output_aliases={2: 0})(x2, wp, base)
    return out.reshape(*lead, P * NR).astype(x.dtype)


def glu(x, wp, act: str):
    """act(x @ Wg) * (x @ Wu) [..., F] with wp = pack([Wg Wu]) ([K, 2F] packed, F a multiple of NR),
    in float32 inside a jitted program; act one of ACTIVATIONS (gelu_tanh: gelu's tanh form)."""
    import jax
    import jax.numpy as jnp

    if act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {ACTIVATIONS}, got {act!r}")
    P, K, _ = wp.shape
    if P % 2:
        raise ValueError(f"a fused gate/up weight has an even number of panels, got {P}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).astype(jnp.float32)
    out = jax.ffi.ffi_call(_target(f"glu_{act}"), jax.ShapeDtypeStruct((x2.shape[0], P // 2 * NR), jnp.float32))(x2, wp)
    return out.reshape(*lead, P // 2 * NR).astype(x.dtype)
