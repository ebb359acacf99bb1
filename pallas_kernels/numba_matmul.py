"""The layers' weight matmuls on a CPU, x [T, K] @ w [K, N] in float32, as a numba kernel over weights
packed once at start: w [K, N] -> [N / NR, K, NR], NR columns at a time, each panel contiguous.

Why: a matmul library packs the weight into panels on every call. With few rows (a decode step's
T = 8 ... 128) that copy costs as much as the arithmetic: XLA:CPU's dots ran at 100-300 GFLOP/s
there against ~450 at T = 2048 on the demo model's shapes, and vLLM's CPU path holds its weights
prepacked for oneDNN for the same reason. With the panels packed at start, this kernel runs every
T near the machine's float32 peak (docs/PERFORMANCE.md, "Decisions in the code").

The micro-kernel is LLVM IR written here (`_tile`): an MR x NR block of the result held in vector
registers (MR rows x NR / 16 zmm-sized vectors) through the whole sum over K, one broadcast of x and
one fused multiply-add per vector and term. numba keeps loop accumulators of plain Python in memory
(numba_kernels.py works around it); IR phi nodes stay in registers. The driver deals panels out to
numba's threads and walks the rows in blocks of MB, so a block of x stays in L2 while every panel of
the thread passes over it.

Used by the "numba" attention backend's engines (runner.py packs the weights; models/layers.linear
calls `matmul` on a packed weight). Shapes are read at run time; the functions are cached on disk.
"""

from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from pallas_kernels import cpu_ffi
from pallas_kernels.cpu_ffi import ARGS, RETS, buffer, dim, pointer
from pallas_kernels.numba_kernels import _CACHE_HANDLERS, _THREADS

NR = 32  # columns per panel: two 16-lane vectors per row of a tile
MB = 192  # rows per outer block: 192 x K float32 of x stays in a 1 MB L2 for K up to ~1300


def _make_tile(MR: int):
    """An intrinsic tile(a, a_off, lda, b, b_off, b_ahead, every, phase, c, c_off, ldc, kdim):
    c[r, 0:NR] = sum over k < kdim of a[a_off + r * lda + k] * b[b_off + k * NR + 0:NR], r < MR
    (flat float32 arrays; c's rows ldc apart), prefetching b[b_ahead + k * NR + 0:NR] for the k
    with k % every == phase.
    Written, not accumulated: c needs no zeroing."""
    nv = NR // 16

    @intrinsic
    def tile(typingctx, a, a_off, lda, b, b_off, b_ahead, every, phase, c, c_off, ldc, kdim):
        sig = types.void(a, types.intp, types.intp, b, types.intp, types.intp, types.intp, types.intp, c,
                         types.intp, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            a_arr, a_off, lda, b_arr, b_off, b_ahead, every, phase, c_arr, c_off, ldc, kdim = args
            f32, i64, i32 = ir.FloatType(), ir.IntType(64), ir.IntType(32)
            v16 = ir.VectorType(f32, 16)
            ap = context.make_array(signature.args[0])(context, builder, a_arr).data
            bp = context.make_array(signature.args[3])(context, builder, b_arr).data
            cp = context.make_array(signature.args[8])(context, builder, c_arr).data
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16] * 3), "llvm.fma.v16f32")
            i8p = ir.IntType(8).as_pointer()
            prefetch = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0")

            def const(n):
                return ir.Constant(i64, n)

            entry = builder.block
            loop, fetch, body, done = (builder.append_basic_block(n) for n in ("k_loop", "k_fetch", "k_body", "k_done"))
            builder.branch(loop)
            builder.position_at_end(loop)
            k = builder.phi(i64)
            k.add_incoming(const(0), entry)
            acc = [[builder.phi(v16) for _ in range(nv)] for _ in range(MR)]
            zero = ir.Constant(v16, [0.0] * 16)
            for row in acc:
                for v in row:
                    v.add_incoming(zero, entry)
            go = builder.icmp_signed("<", k, kdim)
            mine = builder.icmp_signed("==", builder.srem(k, every), phase)
            builder.cbranch(go, fetch, done)

            # the row k of panel b_ahead (the thread's next one), when k % every == phase: while
            # this panel is in cache, the next one is on its way from memory. The row tiles of a
            # panel take turns (every = their number), so the requests are spread over the panel's
            # time rather than all sent by its first tile, faster than one core's misses can go.
            builder.position_at_end(fetch)
            with builder.if_then(mine):
                ahead_row = builder.add(b_ahead, builder.mul(k, const(NR)))
                for j in range(0, NR, 16):  # one 64-byte line per 16 float32
                    addr = builder.bitcast(builder.gep(bp, [builder.add(ahead_row, const(j))]), i8p)
                    builder.call(prefetch, [addr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
            builder.branch(body)

            builder.position_at_end(body)
            b_row = builder.add(b_off, builder.mul(k, const(NR)))
            bv = [builder.load(builder.bitcast(builder.gep(bp, [builder.add(b_row, const(16 * j))]), v16.as_pointer()),
                               align=4) for j in range(nv)]
            lanes = ir.Constant(ir.VectorType(i32, 16), [0] * 16)
            new = []
            for r in range(MR):
                x = builder.load(builder.gep(ap, [builder.add(a_off, builder.add(builder.mul(const(r), lda), k))]))
                splat = builder.insert_element(ir.Constant(v16, ir.Undefined), x, ir.Constant(i32, 0))
                splat = builder.shuffle_vector(splat, ir.Constant(v16, ir.Undefined), lanes)
                new.append([builder.call(fma, [splat, bv[j], acc[r][j]]) for j in range(nv)])
            end = builder.block
            k.add_incoming(builder.add(k, const(1)), end)
            for r in range(MR):
                for j in range(nv):
                    acc[r][j].add_incoming(new[r][j], end)
            builder.branch(loop)

            builder.position_at_end(done)
            for r in range(MR):
                for j in range(nv):
                    at = builder.add(c_off, builder.add(builder.mul(const(r), ldc), const(16 * j)))
                    builder.store(acc[r][j], builder.bitcast(builder.gep(cp, [at]), v16.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile


_tile8, _tile4, _tile2, _tile1 = (_make_tile(r) for r in (8, 4, 2, 1))


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
