"""The layers' weight matmuls on a CPU, x [T, K] @ w [K, N] in float32, as a numba kernel over weights
packed once at start: w [K, N] -> [N / NR, K, NR], NR columns at a time, each panel contiguous.

Why: a matmul library packs the weight into panels on every call. With few rows (a decode step's
T = 8 ... 128) that copy costs as much as the arithmetic: XLA:CPU's dots ran at 100-300 GFLOP/s
there against ~450 at T = 2048 on the demo model's shapes, and vLLM's CPU path holds its weights
prepacked for oneDNN for the same reason. With the panels packed at start, this kernel runs every
T near the machine's float32 peak (docs/PERFORMANCE.md, "Decisions in the code").

The micro-kernel is numba_tile.py's "packed" form: an MR x NR block of the result held in vector
registers through the whole sum over K, prefetching the thread's next panel (into L1 when a
block has numba_tile.SPREAD row tiles or more to spread the requests over, else into L2). The
driver deals out to numba's threads either the panels (a few rows: a decode step) or runs of rows
(a prefill chunk; `_plan`), and each thread walks its rows in blocks of MB, so that a block of x
stays in L2 while every panel of the thread passes over it. Each thread first copies the block's
rows tile by tile, term-major (`pack_rows`), so that the micro-kernel reads a tile's MR terms k
from one place instead of MR rows K apart.

A second kernel, `matmul_silu_mul`, takes a fused gate/up weight and returns silu(gate) * up: the
[T, 2 F] projection stays in a scratch tile in cache instead of going to memory for XLA to read
back (docs/PERFORMANCE.md, "Decisions in the code"). The plain kernel can also write W's columns to three
arrays, `matmul_split`: a fused q/k/v projection's q, k and v, which XLA would otherwise copy out of
one output as slices for the next FFI call ("Decisions in the code").

Used by the "numba" attention backend's engines (runner.py packs the weights; models/layers.linear
calls `matmul` on a packed weight, layers.qkv_projection `matmul_split`, layers.silu_gate_up
`matmul_silu_mul`). Shapes are read at run time; the functions are cached on disk.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from pallas_kernels import cpu_ffi, numba_parallel, numba_threads
from pallas_kernels.cpu_ffi import ARGS, RETS, buffer, dim, pointer
from pallas_kernels.numba_kernels import _CACHE_HANDLERS, _THREADS, _ir_exp, _scalar
from pallas_kernels.numba_tile import AVX512, NR, make_tile  # NR: columns per panel

numba_parallel.install()  # before this module's parallel kernels compile (numba_parallel.py)

MB = 192  # rows per outer block (a multiple of MR): 192 x K float32 of x stays in a 1 MB L2 for K up to ~1300
# Rows of the full row tile. AVX-512: 12 x NR = 24 of the 32 vector registers hold the tile through
# the sum over K, each panel row loaded once per 12 broadcasts instead of 8 (8 rows ran slower; 14,
# the most that fit, no faster than 12: docs/PERFORMANCE.md, "Decisions in the code"). AVX2: 6 x NR = 12
# of the 16 (6 x 16 is also BLIS's float32 tile for these CPUs; "Decisions in the code").
MR = 12 if AVX512 else 6

_tile_mr, _tile4, _tile2, _tile1 = (make_tile(r, "packed") for r in (MR, 4, 2, 1))
_tile8 = make_tile(8, "packed") if MR > 8 else _tile_mr  # (a remainder tile of 8 rows needs MR > 8)
_gtile_mr, _gtile4, _gtile2, _gtile1 = (make_tile(r, "packed", grouped=True) for r in (MR, 4, 2, 1))
_gtile8 = make_tile(8, "packed", grouped=True) if MR > 8 else _gtile_mr


@njit(inline="always", cache=True)
def _tile_rows(left):
    """The rows of the next row tile with `left` rows of a block to go: MR while there are, then
    one tile each of 8, 4, 2 and 1 as needed."""
    return MR if left >= MR else (8 if left >= 8 else (4 if left >= 4 else (2 if left >= 2 else 1)))


@njit(inline="always", cache=True)
def _n_tiles(rows):
    """The row tiles of a block of `rows` rows: MR rows each, then one of 8, 4, 2 and 1 as needed
    (the sequence _tile_rows gives)."""
    r = rows % MR
    return rows // MR + (r >= 8) + (r % 8 >= 4) + (r % 4 >= 2) + r % 2


@njit(fastmath=True, inline="always", cache=True)
def _tile(rows, xf, x_off, K, wf, b, ahead, n_tiles, i, of, o_off, ldo):
    """One row tile (rows of MR, 8, 4, 2 or 1) of panel b: of[o_off.., NR columns, rows ldo apart] =
    the tile's rows of x, packed at xf[x_off..] (pack_rows), . the panel; the i-th of n_tiles tiles
    of the panel, which prefetches its share of panel `ahead`."""
    if rows == MR:
        _tile_mr(xf, x_off, K, wf, b, ahead, n_tiles, i, of, o_off, ldo, K)
    elif rows == 8:
        _tile8(xf, x_off, K, wf, b, ahead, n_tiles, i, of, o_off, ldo, K)
    elif rows == 4:
        _tile4(xf, x_off, K, wf, b, ahead, n_tiles, i, of, o_off, ldo, K)
    elif rows == 2:
        _tile2(xf, x_off, K, wf, b, ahead, n_tiles, i, of, o_off, ldo, K)
    else:
        _tile1(xf, x_off, K, wf, b, ahead, n_tiles, i, of, o_off, ldo, K)


@njit(fastmath=True, cache=True)
def pack_rows(xf, m0, m1, K, xp):
    """Rows m0 .. m1 of x (flat, rows K long) into xp, row tile by row tile as _tile_rows cuts them:
    the tile of r rows starting at row m at (m - m0) * K, term-major (x[m + j, k] at
    (m - m0) * K + k * r + j), which is how the "packed" micro-kernel reads a tile. Unsigned
    indices: with signed ones numba tests every index for wrapping around, which made this copy
    slower. The tile is written in order, term by term, reading its r rows side by side: row by
    row, each pass wrote a line of every term, and a tile of long rows left L1 before the next
    row's pass came back to its lines (docs/PERFORMANCE.md, "Decisions in the code")."""
    m = m0
    while m < m1:
        r = _tile_rows(m1 - m)
        dst = (m - m0) * K
        src = m * K
        for k in range(K):
            for j in range(r):
                xp[np.uint64(dst + k * r + j)] = xf[np.uint64(src + j * K + k)]
        m += r


@njit(cache=True)
def _zero_rows(out, m):
    """out[m:] = 0 for a C-contiguous 2-D out (a plain loop: under parallel=True an array expression
    would be a parallel region of its own)."""
    f = out.ravel()
    for i in range(m * out.shape[1], f.size):
        f[i] = 0.0


@njit(fastmath=True, inline="always", cache=True)
def _scale_tile(of, o_off, ldo, rows, s, col):
    """of[o_off.., NR columns, `rows` rows ldo apart] *= s[col : col + NR]: an int8 panel's
    per-column scales on the tile it just wrote, while the tile is in L1 (none for float32
    weights: s empty)."""
    if s.size:
        for j in range(rows):
            for c in range(NR):
                of[o_off + j * ldo + c] *= s[col + c]


@njit(fastmath=True, inline="always", cache=True)
def _grouped_tile(rows, xf, x_off, K, wf, b, ahead, n_tiles, i, of, o_off, ldo, s, mn, sg, G):
    """_tile for an int8 panel b whose columns have a scale and a minimum per group of G inputs (w =
    (q + 128) * scale + minimum: models/quantize.py's grouped weights), the panel's at s / mn[sg + g
    * NR + c]: the micro-kernel dequantizes each row of the panel as it loads it (numba_tile.py),
    so the result needs no pass of its own."""
    if rows == MR:
        _gtile_mr(xf, x_off, K, wf, b, ahead, n_tiles, i, of, o_off, ldo, K, s, mn, sg, G)
    elif rows == 8:
        _gtile8(xf, x_off, K, wf, b, ahead, n_tiles, i, of, o_off, ldo, K, s, mn, sg, G)
    elif rows == 4:
        _gtile4(xf, x_off, K, wf, b, ahead, n_tiles, i, of, o_off, ldo, K, s, mn, sg, G)
    elif rows == 2:
        _gtile2(xf, x_off, K, wf, b, ahead, n_tiles, i, of, o_off, ldo, K, s, mn, sg, G)
    else:
        _gtile1(xf, x_off, K, wf, b, ahead, n_tiles, i, of, o_off, ldo, K, s, mn, sg, G)


@njit(inline="always", cache=True)
def _plan(M, P):
    """How an M-row matmul over P panels is shared out: (by_rows, n_threads). With more rows than
    a block, and at least half a block for each of numba's threads, each thread takes its own run
    of rows and every panel, so it packs only its own rows. Otherwise the threads share the rows
    and split the panels, each packing all the rows (a decode step's matmul: the weights, streamed
    from memory, are read once, each panel by one thread). Splitting the panels of a large M made
    each thread pack every row, a measurable share of the multiply (docs/PERFORMANCE.md,
    "Decisions in the code")."""
    if M > MB and M // _THREADS >= MB // 2:
        return True, _THREADS
    return False, min(_THREADS, max(P, 1))


@njit(inline="always", cache=True)
def _share(M, P, by_rows, n_threads, t):
    """Thread t's rows [r0, r1) and panels [p0, p1) under _plan's choice; a run of rows is cut at
    multiples of MR, so that only the last thread's run ends in the smaller row tiles."""
    if by_rows:
        r0 = (M * t // n_threads) // MR * MR
        r1 = M if t == n_threads - 1 else (M * (t + 1) // n_threads) // MR * MR
        return r0, r1, 0, P
    return 0, M, P * t // n_threads, P * (t + 1) // n_threads


@njit(fastmath=True, parallel=True, cache=True)
def packed_matmul(x, w, out_a, out_b, out_c, rows, s, mn):
    """x f32[M, K] @ W, w the packed W f32[P, K, NR] (or int8 with its column scales s f32[P * NR];
    s empty for float32; or int8 in groups of an even number of inputs, s and mn its packed scales
    and minimums f16[P * NG * NR] as uint16 bits, flat: _grouped_tile; mn empty otherwise), in three
    column groups: out_a f32[M, Na] gets
    W's first Na columns, out_b the next Nb, out_c the last Nc (Na + Nb + Nc = P * NR, each a
    multiple of NR; a plain matmul passes empty [M, 0] arrays as out_b and out_c). All C-contiguous.
    The groups let a fused q/k/v projection write q, k and v to buffers of their own, which the
    kernels after it take as they are, instead of XLA copying three slices out of one [M, N].
    Only x's first `rows` rows are multiplied; the outputs' rows past them are zeros (a step's
    padding: `row_limits`)."""
    K = x.shape[1]
    M = min(max(rows, 0), x.shape[0])
    _zero_rows(out_a, M)
    _zero_rows(out_b, M)
    _zero_rows(out_c, M)
    P = w.shape[0]
    Pa = out_a.shape[1] // NR
    Pb = Pa + out_b.shape[1] // NR
    xf, wf = x.ravel(), w.ravel()
    fa, fb, fc = out_a.ravel(), out_b.ravel(), out_c.ravel()
    NG = mn.size // (P * NR) if P > 0 else 0  # groups along K of a grouped weight, else 0
    by_rows, n_threads = _plan(M, P)
    for t in prange(n_threads):
        r0, r1, p0, p1 = _share(M, P, by_rows, n_threads, t)
        xp = np.empty(min(r1 - r0, MB) * K, np.float32)  # a block of the thread's rows, packed
        for m0 in range(r0, r1, MB):
            m1 = min(r1, m0 + MB)
            n_tiles = _n_tiles(m1 - m0)
            pack_rows(xf, m0, m1, K, xp)
            for p in range(p0, p1):
                # the group panel p writes into, that group's row length and the panel's column there
                if p < Pa:
                    of, N, c = fa, out_a.shape[1], p * NR
                elif p < Pb:
                    of, N, c = fb, out_b.shape[1], (p - Pa) * NR
                else:
                    of, N, c = fc, out_c.shape[1], (p - Pb) * NR
                b = p * K * NR
                ahead = (p + 1 if p + 1 < p1 else p0) * K * NR  # the weights come from memory every step
                m = m0
                i = 0
                while m < m1:
                    rows = _tile_rows(m1 - m)
                    if NG:
                        _grouped_tile(rows, xp, (m - m0) * K, K, wf, b, ahead, n_tiles, i, of, m * N + c, N,
                                      s, mn, p * NG * NR, K // NG)
                    else:
                        _tile(rows, xp, (m - m0) * K, K, wf, b, ahead, n_tiles, i, of, m * N + c, N)
                        _scale_tile(of, m * N + c, N, rows, s, p * NR)
                    m += rows
                    i += 1


@intrinsic
def _silu_mul(typingctx, gu, rows, out, o_off, ldo):
    """out[o_off + j * ldo + c] = silu(g) * u for the first `rows` rows of a gate tile g = gu[:MR *
    NR] and the up tile u = gu[MR * NR:] beside it (both [MR, NR], row-major; out float32 and
    C-contiguous), in 16-lane vectors: the sigmoid as 1 / (1 + e) or e / (1 + e) with e = exp(-|g|)
    (no overflow either way), chosen by g's sign in a select. numba compiled the same loop to 8
    lanes with a branch, a measurable share of the gate/up matmul (docs/PERFORMANCE.md, "Decisions
    in the code")."""
    def codegen(context, builder, signature, args):
        gu_a, n_rows, out_a, off, ld = args
        gp = context.make_array(signature.args[0])(context, builder, gu_a).data
        op = context.make_array(signature.args[2])(context, builder, out_a).data
        i64 = ir.IntType(64)
        f32 = ir.FloatType()
        v16 = ir.VectorType(f32, 16)
        n_rows = context.cast(builder, n_rows, signature.args[1], types.int64)
        off = context.cast(builder, off, signature.args[3], types.int64)
        ld = context.cast(builder, ld, signature.args[4], types.int64)
        fabs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16]), "llvm.fabs.v16f32")
        one = ir.Constant(v16, [ir.Constant(f32, 1.0)] * 16)
        zero = ir.Constant(v16, [ir.Constant(f32, 0.0)] * 16)

        def vec(ptr, at):
            return builder.bitcast(builder.gep(ptr, [at]), v16.as_pointer())

        with cgutils.for_range(builder, n_rows) as loop:
            j = loop.index
            for v in range(NR // 16):
                col = ir.Constant(i64, 16 * v)
                at = builder.add(builder.mul(j, ir.Constant(i64, NR)), col)
                g = builder.load(vec(gp, at), align=4)
                u = builder.load(vec(gp, builder.add(at, ir.Constant(i64, MR * NR))), align=4)
                e = _ir_exp(builder, builder.fneg(builder.call(fabs, [g])), v16)
                r = builder.fdiv(one, builder.fadd(one, e))
                sig = builder.select(builder.fcmp_ordered(">=", g, zero), r, builder.fmul(e, r))
                res = builder.fmul(builder.fmul(g, sig), u)
                dst = builder.add(off, builder.add(builder.mul(j, ld), col))
                builder.store(res, vec(op, dst), align=4)
        return context.get_dummy_value()
    return types.void(gu, rows, out, o_off, ldo), codegen


@njit(fastmath=True, parallel=True, cache=True)
def packed_matmul_silu_mul(x, w, out, rows, s, mn):
    """out f32[M, F] = silu(x @ Wg) * (x @ Wu), w the packed [Wg Wu] f32[P, K, NR] (a fused gate/up
    weight, F = P / 2 * NR: the gate's panels first; or int8 with its column scales s, else s empty;
    or int8 in groups with s and mn as packed_matmul's). Each row tile of a gate panel and of the up
    panel beside it go to a scratch tile in cache, and only their product is written, so the
    [M, 2 F] projection never reaches memory nor a separate elementwise pass. Rows of x past
    `rows` are not multiplied; their rows of out are zeros."""
    K = x.shape[1]
    M = min(max(rows, 0), x.shape[0])
    _zero_rows(out, M)
    F2 = w.shape[0] // 2  # panels of the gate (and of the up)
    F = F2 * NR
    xf, wf, of = x.ravel(), w.ravel(), out.ravel()
    NG = mn.size // (2 * F2 * NR) if F2 > 0 else 0
    by_rows, n_threads = _plan(M, F2)
    for t in prange(n_threads):
        r0, r1, q0, q1 = _share(M, F2, by_rows, n_threads, t)
        gu = np.empty(2 * MR * NR, np.float32)  # a row tile of the gate [MR, NR], then of the up [MR, NR]
        xp = np.empty(min(r1 - r0, MB) * K, np.float32)
        for m0 in range(r0, r1, MB):
            m1 = min(r1, m0 + MB)
            n_tiles = _n_tiles(m1 - m0)
            pack_rows(xf, m0, m1, K, xp)
            for q in range(q0, q1):
                nq = q + 1 if q + 1 < q1 else q0
                m = m0
                i = 0
                while m < m1:
                    rows = _tile_rows(m1 - m)
                    x_off = (m - m0) * K
                    if NG:
                        _grouped_tile(rows, xp, x_off, K, wf, q * K * NR, nq * K * NR, n_tiles, i, gu, 0, NR,
                                      s, mn, q * NG * NR, K // NG)
                        _grouped_tile(rows, xp, x_off, K, wf, (q + F2) * K * NR, (nq + F2) * K * NR, n_tiles, i,
                                      gu, MR * NR, NR, s, mn, (q + F2) * NG * NR, K // NG)
                    else:
                        _tile(rows, xp, x_off, K, wf, q * K * NR, nq * K * NR, n_tiles, i, gu, 0, NR)
                        _tile(rows, xp, x_off, K, wf, (q + F2) * K * NR, (nq + F2) * K * NR, n_tiles, i, gu, MR * NR, NR)
                        _scale_tile(gu, 0, NR, rows, s, q * NR)
                        _scale_tile(gu, MR * NR, NR, rows, s, (q + F2) * NR)
                    _silu_mul(gu, rows, of, m * F + q * NR, F)
                    m += rows
                    i += 1


@njit(inline="always", cache=True)
def _dispatch(frame, x, w, s, mn, M, P):
    """The call the results ask for (see the handlers)."""
    a_p, a_d = buffer(frame, RETS, 0)
    Na = dim(a_d, 1)
    rows = _scalar(frame, 2, np.int32)
    out_a = carray(pointer(a_p), (M, Na), dtype=np.float32)
    if cpu_ffi.count(frame, RETS) == 3:
        b_p, b_d = buffer(frame, RETS, 1)
        c_p, c_d = buffer(frame, RETS, 2)
        packed_matmul(x, w, out_a, carray(pointer(b_p), (M, dim(b_d, 1)), dtype=np.float32),
                      carray(pointer(c_p), (M, dim(c_d, 1)), dtype=np.float32), rows, s, mn)
    elif Na == P * NR:
        none = np.empty((M, 0), np.float32)
        packed_matmul(x, w, out_a, none, none, rows, s, mn)
    else:
        packed_matmul_silu_mul(x, w, out_a, rows, s, mn)


# FFI handlers. Arguments: x f32[M, K], w f32[P, K, NR], rows i32[1] (x's real rows); the int8
# handler's w is int8[P, K, NR] with a fourth argument, its column scales f32[P * NR]; the grouped
# int8 handler's fourth and fifth are its packed scales and minimums f16[P, NG, NR]. Results, told
# apart by their count and shape (the wrappers below choose): one f32[M, P * NR], x @ W (matmul);
# three, x @ W in column groups (matmul_split); or one f32[M, P / 2 * NR], silu(gate) * up of a
# fused gate/up weight (matmul_silu_mul).
@cfunc(cpu_ffi.HANDLER_SIGNATURE, cache=_CACHE_HANDLERS)
def handler(frame_ptr):
    frame = cpu_ffi.frame_words(frame_ptr)
    if not cpu_ffi.answer_metadata(frame) and cpu_ffi.executing(frame):
        numba_threads.apply_limit()
        x_p, x_d = buffer(frame, ARGS, 0)
        w_p, w_d = buffer(frame, ARGS, 1)
        M, K, P = dim(x_d, 0), dim(x_d, 1), dim(w_d, 0)
        x = carray(pointer(x_p), (M, K), dtype=np.float32)
        w = carray(pointer(w_p), (P, K, NR), dtype=np.float32)
        none = np.empty(0, np.float32)
        _dispatch(frame, x, w, none, none, M, P)
    return cpu_ffi.success()


@cfunc(cpu_ffi.HANDLER_SIGNATURE, cache=_CACHE_HANDLERS)
def handler_int8(frame_ptr):
    frame = cpu_ffi.frame_words(frame_ptr)
    if not cpu_ffi.answer_metadata(frame) and cpu_ffi.executing(frame):
        numba_threads.apply_limit()
        x_p, x_d = buffer(frame, ARGS, 0)
        w_p, w_d = buffer(frame, ARGS, 1)
        s_p, _ = buffer(frame, ARGS, 3)
        M, K, P = dim(x_d, 0), dim(x_d, 1), dim(w_d, 0)
        x = carray(pointer(x_p), (M, K), dtype=np.float32)
        w = carray(pointer(w_p), (P, K, NR), dtype=np.int8)
        _dispatch(frame, x, w, carray(pointer(s_p), (P * NR,), dtype=np.float32), np.empty(0, np.float32), M, P)
    return cpu_ffi.success()


@cfunc(cpu_ffi.HANDLER_SIGNATURE, cache=_CACHE_HANDLERS)
def handler_int8_grouped(frame_ptr):
    frame = cpu_ffi.frame_words(frame_ptr)
    if not cpu_ffi.answer_metadata(frame) and cpu_ffi.executing(frame):
        numba_threads.apply_limit()
        x_p, x_d = buffer(frame, ARGS, 0)
        w_p, w_d = buffer(frame, ARGS, 1)
        s_p, s_d = buffer(frame, ARGS, 3)
        m_p, _ = buffer(frame, ARGS, 4)
        M, K, P = dim(x_d, 0), dim(x_d, 1), dim(w_d, 0)
        n = P * dim(s_d, 1) * NR
        x = carray(pointer(x_p), (M, K), dtype=np.float32)
        w = carray(pointer(w_p), (P, K, NR), dtype=np.int8)
        _dispatch(frame, x, w, carray(pointer(s_p), (n,), dtype=np.uint16),
                  carray(pointer(m_p), (n,), dtype=np.uint16), M, P)
    return cpu_ffi.success()


def packable(w) -> bool:
    """Whether a weight can be packed: float32 or int8 (quantized: its scales stay beside it, or are
    packed too where they are per group) [K, N] with N a multiple of NR."""
    return w.ndim == 2 and w.dtype in (np.float32, np.int8) and w.shape[1] % NR == 0 and w.shape[1] > 0


def pack(w: np.ndarray) -> np.ndarray:
    """[K, N] -> [N / NR, K, NR]: panel p holds columns p * NR ... (p + 1) * NR - 1, row by row."""
    K, N = w.shape
    return np.ascontiguousarray(np.asarray(w).reshape(K, N // NR, NR).transpose(1, 0, 2))


def unpack(wp: np.ndarray) -> np.ndarray:
    """pack's inverse."""
    P, K, _ = wp.shape
    return np.ascontiguousarray(np.asarray(wp).transpose(1, 0, 2).reshape(K, P * NR))


_HANDLERS = {"f32": handler, "i8": handler_int8, "i8g": handler_int8_grouped}


@functools.cache
def _target(kind: str = "f32") -> str:
    """The FFI target of a weight kind: "f32", "i8" (int8, scales per column) or "i8g" (int8 in groups)."""
    name = f"jaxsched_numba_matmul_{kind}"
    cpu_ffi.register(name, _HANDLERS[kind])
    return name


def matmul(x, wp, scale=None, minimum=None):
    """x [..., K] @ W with wp = pack(W) (a jax array), in float32, inside a jitted program. An int8
    wp comes with its column scales f32[N] (models/quantize.py), or, grouped, with its scales and
    minimums packed as it is (pack of f16[K / G, N])."""
    return _call(x, wp, (wp.shape[0] * NR,), scale, minimum)[0]


def matmul_split(x, wp, widths: tuple[int, int, int], scale=None, minimum=None):
    """x [..., K] @ W as three arrays [..., widths[i]], W's columns in that order, each written by the
    kernel where it lies (a fused q/k/v projection's q, k and v without slicing). The widths add up to
    W's columns and are multiples of NR."""
    if len(widths) != 3 or sum(widths) != wp.shape[0] * NR or any(n % NR or n <= 0 for n in widths):
        raise ValueError(f"matmul_split takes three positive widths, multiples of {NR}, that add up to the "
                         f"weight's {wp.shape[0] * NR} columns; got {widths}")
    return _call(x, wp, widths, scale, minimum)


def matmul_silu_mul(x, wp, scale=None, minimum=None):
    """silu(x @ Wg) * (x @ Wu) [..., F] with wp = pack([Wg Wu]) of an even number of panels (F a
    multiple of NR), in float32, inside a jitted program."""
    if wp.shape[0] % 2:
        raise ValueError(f"a fused gate/up weight needs an even number of {NR}-column panels, got {wp.shape[0]}")
    return _call(x, wp, (wp.shape[0] // 2 * NR,), scale, minimum)[0]


# While a step's model is traced (runner.py): {rows of an operand: how many of them are real}, for
# the step's T tokens and S sequences. A step's padding is at the end of both (batch.py), and a
# matmul's cost is linear in its rows: a decode step of 100 rows in the 112 bucket multiplied 12
# rows of zeros-to-be through every layer and the lm_head (docs/PERFORMANCE.md, "Decisions in the code").
_ROW_LIMITS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("numba_matmul_row_limits", default=None)


@contextlib.contextmanager
def row_limits(limits: dict):
    """Within: a matmul of an operand with n rows, n a key of `limits` (an int32 scalar, traced),
    multiplies only that many leading rows and gives zeros for the rest. Rows past the limit must
    be padding whose results nothing reads: the caller vouches for it."""
    token = _ROW_LIMITS.set(dict(limits))
    try:
        yield
    finally:
        _ROW_LIMITS.reset(token)


def _call(x, wp, widths: tuple[int, ...], scale=None, minimum=None):
    """The kernel's results, one [..., n] per width (the handler tells the three calls apart)."""
    import jax
    import jax.numpy as jnp

    int8 = wp.dtype == jnp.int8
    if int8 != (scale is not None):
        raise ValueError("an int8 packed weight takes its column scales (scale=), a float32 one none")
    if minimum is not None and (minimum.shape != scale.shape or scale.ndim != 3 or scale.shape[0] != wp.shape[0]
                                or wp.shape[1] % scale.shape[1] or wp.shape[1] // scale.shape[1] % 2):
        raise ValueError(f"a grouped int8 weight {wp.shape} takes packed scales and minimums [P, K / G, NR] of one "
                         f"shape, G even; got {scale.shape} and {minimum.shape}")

    K = wp.shape[1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).astype(jnp.float32)
    limit = (_ROW_LIMITS.get() or {}).get(x2.shape[0])
    rows = jnp.full((1,), x2.shape[0], jnp.int32) if limit is None else jnp.reshape(limit, (1,)).astype(jnp.int32)
    if minimum is not None:  # float16, read as such by the micro-kernel
        args = (x2, wp, rows, scale.astype(jnp.float16), minimum.astype(jnp.float16))
    else:
        args = (x2, wp, rows) + ((scale.astype(jnp.float32),) if int8 else ())
    kind = "i8g" if minimum is not None else ("i8" if int8 else "f32")
    outs = jax.ffi.ffi_call(_target(kind), tuple(jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32) for n in widths))(
        *args)
    return tuple(o.reshape(*lead, n).astype(x.dtype) for o, n in zip(outs, widths))
