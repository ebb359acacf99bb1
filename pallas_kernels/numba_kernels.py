"""The CPU attention kernels of the "numba" backend, in numba-compiled Python: ragged paged
attention over decode rows and prefill chunks, reading K/V pages where they lie in the pool.

Layouts are the "xla" backend's (backends.py): k_cache [L, NB, K, H, P] (pages transposed, so a
score row is a sum of contiguous page rows), v_cache [L, NB, K, P, H], float32 or uint16 holding
bfloat16 bits. All math is float32 with an online softmax, page by page.

Two kinds of work item, dealt out to numba's threads by estimated cost (`ragged`):
  decode row    one query token: its G heads per KV head against every cached page, each byte
                read once, the next page prefetched. On a float32 pool with G <= 3, pages a
                multiple of 64 and heads of 64 or 128, both dots are register tiles holding whole
                page rows (the page read in memory order); otherwise loops of 4 terms per pass.
  prefill tile  up to Q_TILE query tokens of one sequence, causal over the cached prefix and
                themselves: a [Q_TILE * G, H] x [H, P] block per page. On a float32 pool with pages
                and heads a multiple of NR, both dots are numba_tile.py's register tiles; otherwise
                loops of 4 rows and 4 terms per pass (docs/PERFORMANCE.md, "Decisions in the code").

Shapes are read at run time and the functions are cached on disk (`cache=True`): the first use of a
pool storage on a machine compiles its handler, later processes load the cache. The FFI handlers at
the bottom (`handler`) are what XLA calls (cpu_ffi.py).
"""

from __future__ import annotations

import threading

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, config, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from pallas_kernels import cpu_ffi, numba_parallel, numba_threads
from pallas_kernels.cpu_ffi import ARGS, RETS, buffer, dim, pointer
from pallas_kernels.numba_tile import AVX512, NR, TO_L1, TO_L2, make_tile

# before any parallel kernel here compiles: its regions must not wait for the GIL on XLA's threads
numba_parallel.install()

try:
    # Code loaded from numba's disk cache calls the thread pool's entry points (allocate_sched...)
    # by symbol; they exist only once the pool has started, else LLVM aborts the process while
    # loading. Starting it first makes the cached FFI handlers safe to load.
    from numba.np.ufunc.parallel import _launch_threads

    _launch_threads()
    _CACHE_HANDLERS = True
except (ImportError, AttributeError):  # another numba: compile the handlers in every process
    _CACHE_HANDLERS = False

Q_TILE = 16  # query tokens per prefill work item (a multiple of 4: rows go through 4 at a time)
_NEG_INF = np.float32(-1e30)  # finite, so a row with nothing visible yet stays NaN-free
_ZERO = np.float32(0.0)
_LOG2E = np.float32(1.4426950408889634)
_EXP_LO = np.float32(-87.0)  # below this exp underflows float32; the exponent bits stay valid
_C1, _C2, _C3, _C4, _C5, _C6 = (np.float32(c) for c in (
    0.6931471805599453, 0.2402265069591007, 0.05550410866482158, 0.009618129107628477,
    0.0013333558146428443, 0.00015403530393381606))
_SHIFT = np.uint32(16)


_E4M3_BIAS = np.uint32(120 << 23)  # e4m3's exponent bias 7 -> float32's 127
_E4M3_SUB_BITS = np.uint32(141 << 23)  # 2^14 (2^(141 - 127)): its mantissa's last 3 bits are 2^-9 apart
_E4M3_SUB = np.float32(2.0**14)
_ONE_BITS = np.uint32(0x3F800000)  # 1.0


@njit(inline="always", fastmath=True, cache=True)
def _e4m3(x):
    """uint8 fp8 e4m3fn bits -> float32 (NaN patterns aside: the pool saturates, never holds one).
    A normal value's exponent and mantissa move into float32's fields, rebiased by an integer add;
    a subnormal's mantissa m (its value m * 2^-9) is put in the low bits of 2^14 and 2^14
    subtracted, so no float32 subnormal is ever made: XLA runs the kernels with denormals flushed
    to zero, which turned the multiply-by-2^120 form's small values into zeros. The choice between
    the two is a 1.0 / 0.0 factor made from a bit mask (an add and a shift: no compare, no branch)
    and the sign a +-1.0 factor, so that a row's conversions stay one vector loop in numba: a table
    lookup (a gather per element), a compare-and-select and an integer blend of the two ran decode
    attention 5-6x slower than a bfloat16 pool, this form 2x (docs/PERFORMANCE.md)."""
    u = np.uint32(x)
    em = u & np.uint32(0x7F)
    sign = np.uint32(_ONE_BITS | ((u & np.uint32(0x80)) << np.uint32(24))).view(np.float32)  # +-1
    normal = np.uint32((em << np.uint32(20)) + _E4M3_BIAS).view(np.float32)
    sub = np.uint32(_E4M3_SUB_BITS | em).view(np.float32) - _E4M3_SUB
    keep = np.uint32(0) - ((em + np.uint32(120)) >> np.uint32(7))  # all ones where em >= 8 (normal)
    is_normal = np.uint32(_ONE_BITS & keep).view(np.float32)  # 1.0 or 0.0
    is_sub = np.uint32(_ONE_BITS & ~keep).view(np.float32)
    return (normal * is_normal + sub * is_sub) * sign


# Threads the work is dealt to: numba's pool size, fixed when this module is first compiled (calling
# numba.get_num_threads() inside a kernel would make it uncacheable). A smaller pool at run time
# (numba.set_num_threads) still runs every item, less evenly.
_THREADS = max(1, int(config.NUMBA_NUM_THREADS))


@njit(fastmath=True, inline="always", cache=True)
def _exp(x):
    """exp(x) for x <= 0 in float32: 2^(x log2 e) as an exponent and a degree-6 polynomial, which
    numba vectorises (libm's exp is a scalar call per element; docs/PERFORMANCE.md, "Decisions in the code"). Relative error ~2e-7,
    float32's own resolution."""
    t = max(x, _EXP_LO) * _LOG2E
    fi = np.floor(t)
    f = t - fi
    p = np.float32(1.0) + f * (_C1 + f * (_C2 + f * (_C3 + f * (_C4 + f * (_C5 + f * _C6)))))
    return p * np.int32((np.int32(fi) + 127) << 23).view(np.float32)


def _val(x):
    """A pool element as float32 (compiled per pool storage through the overload below)."""


@overload(_val, inline="always")
def _val_impl(x):
    if isinstance(x, types.Integer) and x.bitwidth == 8:  # uint8 fp8 e4m3 bits
        return lambda x: _e4m3(x)
    if isinstance(x, types.Integer):  # uint16 bfloat16 bits: the upper half of a float32
        return lambda x: np.uint32(np.uint32(x) << _SHIFT).view(np.float32)
    return lambda x: x


def _prefetch_codegen(write: int, level: int = TO_L1):
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0")
        # (address, 0 read / 1 write, locality: the cache level, data cache)
        builder.call(fn, [builder.bitcast(builder.gep(data, [args[1]]), i8p),
                          ir.Constant(i32, write), ir.Constant(i32, level), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return codegen


@intrinsic
def _prefetch(typingctx, arr, idx):
    """Ask the CPU to bring the cache line holding arr's flat element idx into L2 (arr
    C-contiguous). Never faults, whatever the address; a hint only. L2, not L1: it is used a
    whole page ahead, which L1 cannot hold beside the page in hand (numba_tile.TO_L2)."""
    return types.void(arr, types.intp), _prefetch_codegen(0, TO_L2)


@intrinsic
def _prefetch_write(typingctx, arr, idx):
    """A prefetch into L1 of a line about to be written: the CPU fetches it in a state it may write, so
    the store does not wait for the line's read."""
    return types.void(arr, types.intp), _prefetch_codegen(1)


# (a score is never NaN unless its inputs are, and then the row's output is NaN either way: max
# without the NaN tests llvm.maxnum would otherwise add to every vector)
_NO_NAN = ("nnan",)


def _span_args(context, builder, signature, args):
    """The IR values of an (arr, off, n, x) intrinsic's arguments: arr's data pointer, off and n as
    intp, x as float32."""
    data = context.make_array(signature.args[0])(context, builder, args[0]).data
    start = context.cast(builder, args[1], signature.args[1], types.intp)
    count = context.cast(builder, args[2], signature.args[2], types.intp)
    return data, start, count, context.cast(builder, args[3], signature.args[3], types.float32)


@intrinsic
def _max_of(typingctx, arr, off, n, init):
    """max(init, arr's flat elements off .. off + n - 1), arr float32 and C-contiguous: 16 lanes at
    a time in vector max instructions, then the tail one by one. numba compiles a max reduction in
    a loop (mx = max(mx, x)) to scalar compares, each waiting for the one before: in a prefill
    tile's online softmax that loop took a large share of the kernel's time (docs/PERFORMANCE.md,
    "Decisions in the code")."""
    def codegen(context, builder, signature, args):
        data, start, count, first = _span_args(context, builder, signature, args)
        f32, idx = ir.FloatType(), start.type
        v16 = ir.VectorType(f32, 16)
        fn = ir.FunctionType
        vmax = cgutils.get_or_insert_function(builder.module, fn(v16, [v16, v16]), "llvm.maxnum.v16f32")
        smax = cgutils.get_or_insert_function(builder.module, fn(f32, [f32, f32]), "llvm.maxnum.f32")
        vred = cgutils.get_or_insert_function(builder.module, fn(f32, [v16]), "llvm.vector.reduce.fmax.v16f32")
        lanes = ir.Constant(idx, 16)
        # (allocas in the entry block: LLVM keeps them in registers)
        acc = cgutils.alloca_once_value(builder, ir.Constant(v16, [ir.Constant(f32, -3.0e38)] * 16))
        whole = builder.sdiv(count, lanes)
        with cgutils.for_range(builder, whole) as loop:
            at = builder.gep(data, [builder.add(start, builder.mul(loop.index, lanes))])
            v = builder.load(builder.bitcast(at, v16.as_pointer()), align=4)
            builder.store(builder.call(vmax, [builder.load(acc), v], fastmath=_NO_NAN), acc)
        top = builder.call(vred, [builder.load(acc)], fastmath=_NO_NAN)
        res = cgutils.alloca_once_value(builder, builder.call(smax, [top, first], fastmath=_NO_NAN))
        done = builder.mul(whole, lanes)
        with cgutils.for_range(builder, builder.sub(count, done)) as loop:
            x = builder.load(builder.gep(data, [builder.add(start, builder.add(done, loop.index))]))
            builder.store(builder.call(smax, [builder.load(res), x], fastmath=_NO_NAN), res)
        return builder.load(res)
    return types.float32(arr, off, n, init), codegen


def _ir_exp(builder, x, ty):
    """IR for _exp over x of type ty (float or a vector of floats), the same steps in the same order:
    2^floor(t) from the exponent bits, 2^(t - floor(t)) from the degree-6 polynomial in fused
    multiply-adds."""
    lanes = ty.count if isinstance(ty, ir.VectorType) else None
    ity = ir.VectorType(ir.IntType(32), lanes) if lanes else ir.IntType(32)

    def const(t, v):
        return ir.Constant(t, [ir.Constant(t.element, v)] * lanes) if lanes else ir.Constant(t, v)

    suffix = f"v{lanes}f32" if lanes else "f32"
    fn = ir.FunctionType
    maxnum = cgutils.get_or_insert_function(builder.module, fn(ty, [ty, ty]), f"llvm.maxnum.{suffix}")
    floor = cgutils.get_or_insert_function(builder.module, fn(ty, [ty]), f"llvm.floor.{suffix}")
    fma = cgutils.get_or_insert_function(builder.module, fn(ty, [ty, ty, ty]), f"llvm.fma.{suffix}")
    t = builder.fmul(builder.call(maxnum, [x, const(ty, float(_EXP_LO))]), const(ty, float(_LOG2E)))
    fi = builder.call(floor, [t])
    f = builder.fsub(t, fi)
    p = const(ty, float(_C6))
    for c in (_C5, _C4, _C3, _C2, _C1, 1.0):
        p = builder.call(fma, [p, f, const(ty, float(c))])
    bits = builder.shl(builder.add(builder.fptosi(fi, ity), const(ity, 127)), const(ity, 23))
    return builder.fmul(p, builder.bitcast(bits, ty))


@intrinsic
def _exp_sum(typingctx, arr, off, n, mx):
    """arr's flat elements off .. off + n - 1 become exp(element - mx) (_exp: mx at least each of
    them), and their sum is returned; arr float32 and C-contiguous. 16 lanes at a time in vector
    instructions, then the tail one by one. numba vectorised the same loop over 8 lanes only (LLVM
    prefers 256-bit vectors on these CPUs), and with the polynomial's constants reloaded in every
    pass the online softmax took a large share of a prefill tile (docs/PERFORMANCE.md, "Decisions in
    the code")."""
    def codegen(context, builder, signature, args):
        data, start, count, top = _span_args(context, builder, signature, args)
        f32, idx = ir.FloatType(), start.type
        v16 = ir.VectorType(f32, 16)
        vadd = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(f32, [f32, v16]), "llvm.vector.reduce.fadd.v16f32")
        lanes = ir.Constant(idx, 16)
        i32 = ir.IntType(32)
        top16 = builder.insert_element(ir.Constant(v16, ir.Undefined), top, ir.Constant(i32, 0))
        lane0 = ir.Constant(ir.VectorType(i32, 16), [0] * 16)
        top16 = builder.shuffle_vector(top16, ir.Constant(v16, ir.Undefined), lane0)  # top in every lane
        acc = cgutils.alloca_once_value(builder, ir.Constant(v16, [ir.Constant(f32, 0.0)] * 16))
        whole = builder.sdiv(count, lanes)
        with cgutils.for_range(builder, whole) as loop:
            at = builder.gep(data, [builder.add(start, builder.mul(loop.index, lanes))])
            at = builder.bitcast(at, v16.as_pointer())
            e = _ir_exp(builder, builder.fsub(builder.load(at, align=4), top16), v16)
            builder.store(e, at, align=4)
            builder.store(builder.fadd(builder.load(acc), e), acc)
        # (reassoc: a tree of adds, not 16 in a row)
        total = builder.call(vadd, [ir.Constant(f32, 0.0), builder.load(acc)], fastmath=("reassoc",))
        res = cgutils.alloca_once_value(builder, total)
        done = builder.mul(whole, lanes)
        with cgutils.for_range(builder, builder.sub(count, done)) as loop:
            at = builder.gep(data, [builder.add(start, builder.add(done, loop.index))])
            e = _ir_exp(builder, builder.fsub(builder.load(at), top), f32)
            builder.store(e, at)
            builder.store(builder.fadd(builder.load(res), e), res)
        return builder.load(res)
    return types.float32(arr, off, n, mx), codegen


@njit(fastmath=True, inline="always", cache=True)
def _softmax_row(s, i, lim, n, m, l_sum, acc):
    """One step of online softmax for row i over a page's scores s[i, :lim] (1 <= lim <= n):
    s[i, :lim] becomes exp(s - running max), s[i, lim:n] zero (masked), and the row's running max
    m[i], sum l_sum[i] and accumulator acc[i] are rescaled to the new max."""
    mx = _max_of(s, i * s.shape[1], lim, m[i])  # s C-contiguous: row i starts at i * its width
    corr = _exp(m[i] - mx)
    tot = _exp_sum(s, i * s.shape[1], lim, mx)
    for p in range(lim, n):
        s[i, p] = _ZERO
    l_sum[i] = l_sum[i] * corr + tot
    m[i] = mx
    for h in range(acc.shape[1]):
        acc[i, h] *= corr


@njit(fastmath=True, inline="always", cache=True)
def _rows_acc(a, b, c, j, terms, rows, cols):
    """c[:rows, :cols] += a[:rows, j:j + terms] . b[j:j + terms, :cols], a row of a at a time: 4
    terms per pass (terms == 4), or one at a time (a remainder, terms < 4). b may hold pool
    storage (read through _val)."""
    for g in range(rows):
        if terms == 4:
            a0, a1, a2, a3 = a[g, j], a[g, j + 1], a[g, j + 2], a[g, j + 3]
            for x in range(cols):
                c[g, x] += (a0 * _val(b[j, x]) + a1 * _val(b[j + 1, x])
                            + a2 * _val(b[j + 2, x]) + a3 * _val(b[j + 3, x]))
        else:
            for t in range(j, j + terms):
                e = a[g, t]
                for x in range(cols):
                    c[g, x] += e * _val(b[t, x])


@njit(inline="always", cache=True)
def _pages(blocks, k, b, b0, nb, K, kv_len, P, NB, next_blk):
    """A decode row's page (head k, block b) and the one it reads after: (block, next block, next
    head, next filled positions). Its pages are one stream, KV head by KV head, block by block from
    b0 (the first its window holds) to nb, and after its last comes block next_blk, the first of the
    thread's next item, whose fill is not known here (P). A block outside the pool (never from the
    block manager) reads block 0."""
    blk = blocks[b]
    if blk < 0 or blk >= NB:
        blk = 0
    span = nb - b0
    j = k * span + b - b0 + 1
    if j < K * span:
        nb_next = b0 + j % span
        nxt, nk, n_next = blocks[nb_next], j // span, min(P, kv_len - nb_next * P)
    else:
        nxt, nk, n_next = next_blk, 0, P
    if nxt < 0 or nxt >= NB:
        nxt = 0
    return blk, nxt, nk, n_next


@njit(fastmath=True, inline="always", cache=True)
def _head_start(qs, m, l_sum, acc, q, tok, k, G, H, scale):
    """qs[:G] = token tok's G query heads of KV head k, scaled; the online softmax's running max,
    sum and accumulator start afresh."""
    m[:] = _NEG_INF
    l_sum[:] = 0.0
    acc[:] = 0.0
    for g in range(G):
        for h in range(H):
            qs[g, h] = q[tok, k * G + g, h] * scale


@njit(fastmath=True, inline="always", cache=True)
def _before_window(s, G, b, P, lo):
    """Scores of a decode row's page b at positions before lo (its window's first) become -inf:
    the online softmax then gives them no weight."""
    for p in range(min(P, lo - b * P)):
        for g in range(G):
            s[g, p] = _NEG_INF


@njit(fastmath=True, inline="always", cache=True)
def _head_out(out, acc, l_sum, tok, k, G, H, kv_len):
    """out[tok, KV head k's G query heads] = acc / l_sum (zeros with nothing cached)."""
    for g in range(G):
        inv = np.float32(1.0) / l_sum[g] if kv_len > 0 else _ZERO
        for h in range(H):
            out[tok, k * G + g, h] = acc[g, h] * inv


# decode_row and prefill_tile are called once per work item, not inlined into `ragged`, and so are
# the bodies under them that run once per row or page (_decode_tiles, _decode_loops, _matmul_acc,
# _page_dot_loops); only the small helpers of the inner loops are inlined at numba's level
# (inline="always"). Inlining the large bodies too made the handlers' cold compile far longer for
# no measurable change in the kernel's speed (docs/PERFORMANCE.md, "Decisions in the code").
@njit(fastmath=True, cache=True)
def decode_row(q, kc, vc, layer, blocks, tok, kv_len, lo, scale, out, next_blk):
    """One query token (its G heads per KV head) over kv_len cached tokens, page by page.

    Its pages are read as one stream (_pages), and the page after the one in hand is
    prefetched as this one is read: the pages lie anywhere in the pool, where the hardware's
    prefetcher, which follows addresses, cannot see them coming. Both dots in register tiles
    (_decode_tiles) where they fit, else in loops (_decode_loops). lo: the first position its
    sliding window holds (0 without one); the pages before it are not read."""
    _decode_heads(q, kc, vc, layer, blocks, tok, kv_len, lo, scale, out, next_blk)


def _decode_heads(q, kc, vc, layer, blocks, tok, kv_len, lo, scale, out, next_blk):
    """decode_row's work: _decode_tiles on a float32 pool with G <= 3, pages a multiple of 64 and
    heads of 64 or 128, else _decode_loops (compiled per pool storage through the overload below)."""


@overload(_decode_heads, inline="always")
def _decode_heads_impl(q, kc, vc, layer, blocks, tok, kv_len, lo, scale, out, next_blk):
    if not isinstance(kc.dtype, types.Float):  # a uint16 pool: read through _val in the loops
        def loops(q, kc, vc, layer, blocks, tok, kv_len, lo, scale, out, next_blk):
            _decode_loops(q, kc, vc, layer, blocks, tok, kv_len, lo, scale, out, next_blk)
        return loops

    def pick(q, kc, vc, layer, blocks, tok, kv_len, lo, scale, out, next_blk):
        K, H, P = kc.shape[2], kc.shape[3], kc.shape[4]
        if q.shape[1] // K <= 3 and P % 64 == 0 and (H == 64 or H == 128):
            _decode_tiles(q, kc, vc, layer, blocks, tok, kv_len, lo, scale, out, next_blk)
        else:
            _decode_loops(q, kc, vc, layer, blocks, tok, kv_len, lo, scale, out, next_blk)
    return pick


# A decode row's dots in register tiles that hold whole rows of a page, so that a page is read in
# its memory order, row after row (tiles of 32 columns took each row a quarter at a time, one
# strided pass over the page per quarter, and were no faster than the loops from memory): 3 rows
# of 64 or 128 columns (at most 24 of the 32 vector registers), for G <= 3 query heads per KV head;
# with G < 3 the rows past G are zeros, so that one row count serves all three (every tile shape
# more is a loop of its own to compile, and a shape per G lengthened the float32 handler's cold
# compile: docs/PERFORMANCE.md, "Decisions in the code"). Each prefetches the same rows of the next page
# as it reads its own. On AVX2 (16 registers) these tiles spill part of their accumulators to the
# stack, in cache; reading the pages bounds them there, and tiles of 32 columns that fit measured
# level with them ("Decisions in the code").
_TILE_ROWS = 3
_set64, _set128 = (make_tile(_TILE_ROWS, "strided", ahead=True, cols=w) for w in (64, 128))
_add64, _add128 = (make_tile(_TILE_ROWS, "strided", accumulate=True, ahead=True, cols=w) for w in (64, 128))


@njit(fastmath=True, cache=True)
def _decode_tiles(q, kc, vc, layer, blocks, tok, kv_len, lo, scale, out, next_blk):
    """decode_row with both dots in whole-row register tiles (_set64 ... _add128; G <= 3, pages a
    multiple of 64 positions, heads of 64 or 128): scores s [G, :n] = qs [G, H] . K page [H, :n], values
    acc [G, H] += s [G, :n] . V page [:n, H]. In the loops every pass loads and stores its
    accumulators, and from memory the dots and the page reads did not overlap on a CPU whose
    float32 rate is low beside its memory bandwidth (docs/PERFORMANCE.md, "Decisions in the code")."""
    _, NB, K, H, P = kc.shape
    G = q.shape[1] // K
    R = _TILE_ROWS  # rows G.. of qs, s and acc are zeros or unread
    m = np.empty(G, np.float32)
    l_sum = np.empty(G, np.float32)
    acc = np.zeros((R, H), np.float32)
    s = np.zeros((R, P), np.float32)
    qs = np.zeros((R, H), np.float32)
    nb = (kv_len + P - 1) // P
    b0 = lo // P  # the first page the window holds
    wide_pages = P % 128 == 0
    for k in range(K):
        _head_start(qs, m, l_sum, acc, q, tok, k, G, H, scale)
        for b in range(b0, nb):
            blk, nxt, nk, n_next = _pages(blocks, k, b, b0, nb, K, kv_len, P, NB, next_blk)
            page = ((layer * NB + blk) * K + k) * H * P  # flat offset of a page, K and V alike
            ahead = ((layer * NB + nxt) * K + nk) * H * P
            n = min(P, kv_len - b * P)
            # scores over the page's filled positions, in chunks of 128 columns (64 for the last
            # ones): those past n are stale slots, never read
            c0 = 0
            while c0 < n:
                wide = wide_pages and n - c0 > 64
                rows = H if c0 < n_next else 0
                if wide:
                    _set128(qs, 0, H, kc, page + c0, P, ahead + c0, rows, s, c0, P, H)
                else:
                    _set64(qs, 0, H, kc, page + c0, P, ahead + c0, rows, s, c0, P, H)
                c0 += 128 if wide else 64
            for x in range(c0, (n_next + 15) // 16 * 16, 16):  # the next page's columns past these
                for h in range(H):
                    _prefetch(kc, ahead + h * P + x)
            _before_window(s, G, b, P, lo)
            for g in range(G):  # online softmax over this page's n positions
                _softmax_row(s, g, n, n, m, l_sum, acc)
            if H == 128:
                _add128(s, 0, P, vc, page, H, ahead, min(n, n_next), acc, 0, H, n)
            else:
                _add64(s, 0, P, vc, page, H, ahead, min(n, n_next), acc, 0, H, n)
            for x in range(n * H, n_next * H, 16):  # the next page's rows past this page's n
                _prefetch(vc, ahead + x)
        _head_out(out, acc, l_sum, tok, k, G, H, kv_len)


@njit(fastmath=True, cache=True)
def _decode_loops(q, kc, vc, layer, blocks, tok, kv_len, lo, scale, out, next_blk):
    """decode_row in loops (any pool storage, any page shape). Both dots take 4 terms per pass, a
    quarter of the accumulator loads and stores; unrolled without the prefetch, the same loops
    ran no faster (docs/PERFORMANCE.md, "Decisions in the code")."""
    _, NB, K, H, P = kc.shape
    G = q.shape[1] // K
    m = np.empty(G, np.float32)
    l_sum = np.empty(G, np.float32)
    acc = np.empty((G, H), np.float32)
    s = np.empty((G, P), np.float32)
    qs = np.empty((G, H), np.float32)
    nb = (kv_len + P - 1) // P
    b0 = lo // P  # the first page the window holds
    h4 = H - H % 4
    for k in range(K):
        _head_start(qs, m, l_sum, acc, q, tok, k, G, H, scale)
        for b in range(b0, nb):
            blk, nxt, nk, n_next = _pages(blocks, k, b, b0, nb, K, kv_len, P, NB, next_blk)
            ahead = ((layer * NB + nxt) * K + nk) * H * P  # flat offset of that page, K and V alike
            n = min(P, kv_len - b * P)
            # A page's last filled position bounds what is read: a row of the K page holds all P
            # positions, so the score dot runs over the filled ones only (in whole 16-lane vectors),
            # and the prefetch asks for the next page's filled lines only. With short contexts
            # most pages are partly filled (a context of 150 fills 22 of a second 128-token page).
            cols = min(P, (n + 15) // 16 * 16)
            cols_next = min(P, (n_next + 15) // 16 * 16)
            kp = kc[layer, blk, k]  # [H, P]: scores are sums of rows of the page
            vp = vc[layer, blk, k]  # [P, H]
            for g in range(G):
                for x in range(cols):
                    s[g, x] = _ZERO
            for h in range(0, h4, 4):  # scores s [G, :cols] += qs [G, H] . page [H, :cols]
                for r in range(4):
                    for x in range(0, cols_next, 16):  # 16 float32 to a 64-byte line
                        _prefetch(kc, ahead + (h + r) * P + x)
                _rows_acc(qs, kp, s, h, 4, G, cols)
            _rows_acc(qs, kp, s, h4, H - h4, G, cols)
            _before_window(s, G, b, P, lo)
            for g in range(G):  # online softmax over this page's n positions
                _softmax_row(s, g, n, n, m, l_sum, acc)
            n4 = n - n % 4
            for p in range(0, n4, 4):  # values acc [G, H] += s [G, :n] . page [:n, H]
                if p < n_next:
                    for x in range(0, 4 * H, 16):
                        _prefetch(vc, ahead + p * H + x)
                _rows_acc(s, vp, acc, p, 4, G, H)
            for x in range(n4 * H, n_next * H, 16):  # the next page's rows past this page's n4
                _prefetch(vc, ahead + x)
            _rows_acc(s, vp, acc, n4, n - n4, G, H)
        _head_out(out, acc, l_sum, tok, k, G, H, kv_len)

# Both dots of a prefill tile's page, scores [R, H] x [H, P] and values [R, P] x [P, H], where the
# register tiles cannot run (a uint16 pool, pages or heads not a multiple of NR). numba
# vectorises the innermost loop over 16 lanes but keeps its accumulators in memory, so each pass
# over a row loads and stores them; 4 rows at a time and 4 terms per pass (16 multiply-adds per
# accumulator load) run several times faster (docs/PERFORMANCE.md, "Decisions in the code").
@njit(fastmath=True, cache=True)
def _matmul_acc(a, b, c, R, kdim, cols):
    """c[:R, :cols] += a[:R, :kdim] . b[:kdim, :cols] (all row-major), 4 rows of a and 4 terms of
    the sum per pass; R a multiple of 4. b may hold pool storage (read through _val)."""
    k4 = kdim - kdim % 4
    for i0 in range(0, R, 4):
        for j in range(0, k4, 4):
            a0, a1, a2, a3 = a[i0, j], a[i0, j + 1], a[i0, j + 2], a[i0, j + 3]
            b0, b1, b2, b3 = a[i0 + 1, j], a[i0 + 1, j + 1], a[i0 + 1, j + 2], a[i0 + 1, j + 3]
            c0, c1, c2, c3 = a[i0 + 2, j], a[i0 + 2, j + 1], a[i0 + 2, j + 2], a[i0 + 2, j + 3]
            d0, d1, d2, d3 = a[i0 + 3, j], a[i0 + 3, j + 1], a[i0 + 3, j + 2], a[i0 + 3, j + 3]
            for x in range(cols):
                v0, v1 = _val(b[j, x]), _val(b[j + 1, x])
                v2, v3 = _val(b[j + 2, x]), _val(b[j + 3, x])
                c[i0, x] += a0 * v0 + a1 * v1 + a2 * v2 + a3 * v3
                c[i0 + 1, x] += b0 * v0 + b1 * v1 + b2 * v2 + b3 * v3
                c[i0 + 2, x] += c0 * v0 + c1 * v1 + c2 * v2 + c3 * v3
                c[i0 + 3, x] += d0 * v0 + d1 * v1 + d2 * v2 + d3 * v3
        for j in range(k4, kdim):
            e0, e1, e2, e3 = a[i0, j], a[i0 + 1, j], a[i0 + 2, j], a[i0 + 3, j]
            for x in range(cols):
                v = _val(b[j, x])
                c[i0, x] += e0 * v
                c[i0 + 1, x] += e1 * v
                c[i0 + 2, x] += e2 * v
                c[i0 + 3, x] += e3 * v


# a prefill tile's page dots: 8 rows of NR columns (16 of AVX-512's 32 registers), 4 on AVX2 (8 of 16)
_PAGE_ROWS = 8 if AVX512 else 4
_page_set = make_tile(_PAGE_ROWS, "strided")
_page_add = make_tile(_PAGE_ROWS, "strided", accumulate=True)


def _page_dot(a, pool, layer, blk, k, c, rows, kdim, cols, add):
    """c[:rows, :cols] = (or += with add) a[:rows, :kdim] . page[:kdim, :cols], the page
    pool[layer, blk, k] (a K page [H, P] for the scores, a V page [P, H] for the values); rows a
    multiple of 8. The register tiles write whole tiles of NR columns: columns cols.. of c up to the
    next multiple of NR get scores of stale slots, which callers do not read."""


@njit(fastmath=True, cache=True)
def _page_dot_loops(a, pool, layer, blk, k, c, rows, kdim, cols, add):
    """_page_dot through _matmul_acc (any pool storage, any page shape)."""
    if not add:
        c[:rows, :cols] = 0.0
    _matmul_acc(a, pool[layer, blk, k], c, rows, kdim, cols)


@overload(_page_dot, inline="always")
def _page_dot_impl(a, pool, layer, blk, k, c, rows, kdim, cols, add):
    if not isinstance(pool.dtype, types.Float):  # a uint16 pool: read through _val in the loops
        def loops(a, pool, layer, blk, k, c, rows, kdim, cols, add):
            _page_dot_loops(a, pool, layer, blk, k, c, rows, kdim, cols, add)
        return loops

    def tiles(a, pool, layer, blk, k, c, rows, kdim, cols, add):
        _, NB, K, page_rows, W = pool.shape  # a page: page_rows rows of W
        if W % NR != 0:  # (pages or heads of 16: a tile would write past c's rows)
            _page_dot_loops(a, pool, layer, blk, k, c, rows, kdim, cols, add)
            return
        page = ((layer * NB + blk) * K + k) * page_rows * W
        lda, ldc = a.shape[1], c.shape[1]
        for c0 in range(0, cols, NR):
            for r0 in range(0, rows, _PAGE_ROWS):
                if add:
                    _page_add(a, r0 * lda, lda, pool, page + c0, W, c, r0 * ldc + c0, ldc, kdim)
                else:
                    _page_set(a, r0 * lda, lda, pool, page + c0, W, c, r0 * ldc + c0, ldc, kdim)
    return tiles


@njit(fastmath=True, cache=True)  # not inlined: see decode_row
def prefill_tile(q, kc, vc, layer, blocks, tok0, nq, pos0, window, scale, out):
    """Up to Q_TILE consecutive query tokens of one sequence (tokens tok0.., positions pos0..),
    causal over the cached prefix and themselves (both dots: _page_dot), each over its last
    `window` positions only: the pages before the first token's window are not read."""
    _, NB, K, H, P = kc.shape
    G = q.shape[1] // K
    R = Q_TILE * G  # query rows per KV head: (token, head of the group), token-major
    rows = min(R, (nq * G + 7) // 8 * 8)  # the rows with queries, in whole tiles of 8
    limit = pos0 + nq  # KV tokens the tile's last query sees
    m = np.empty(R, np.float32)
    l_sum = np.empty(R, np.float32)
    acc = np.empty((R, H), np.float32)
    s = np.empty((R, P), np.float32)
    qs = np.zeros((R, H), np.float32)
    for k in range(K):
        m[:] = _NEG_INF
        l_sum[:] = 0.0
        acc[:] = 0.0
        for i in range(nq):
            for g in range(G):
                for h in range(H):
                    qs[i * G + g, h] = q[tok0 + i, k * G + g, h] * scale
        for b in range(max(pos0 - window + 1, 0) // P, (limit + P - 1) // P):
            blk = blocks[b]
            if blk < 0 or blk >= NB:
                blk = 0
            start = b * P
            n = min(P, limit - start)
            _page_dot(qs, kc, layer, blk, k, s, rows, H, n, False)  # scores: qs [rows, H] x page [H, :n]
            # rows whose window starts inside or after this page (none without a window)
            windowed = pos0 + nq - window > start
            for i in range(rows):  # causal online softmax: row i sees positions <= its own
                lim = min(n, pos0 + i // G - start + 1) if i // G < nq else 0
                first = pos0 + i // G - window + 1 - start if windowed else 0  # ... from its window's first
                if lim <= 0 or first >= lim:
                    for p in range(n):
                        s[i, p] = _ZERO
                    continue
                if first > 0:
                    for p in range(first):
                        s[i, p] = _NEG_INF
                _softmax_row(s, i, lim, n, m, l_sum, acc)
            _page_dot(s, vc, layer, blk, k, acc, rows, n, H, True)  # values: weights [rows, :n] x page [:n, H]
        for i in range(nq * G):
            inv = np.float32(1.0) / l_sum[i]
            for h in range(H):
                out[tok0 + i // G, k * G + i % G, h] = acc[i, h] * inv


@njit(fastmath=True, parallel=True, cache=True)
def ragged(q, kc, vc, layer, window, bt, seq_lens, qsl, num_seqs, scale, out):
    """q f32[T, N, H]; kc [L, NB, K, H, P]; vc [L, NB, K, P, H]; bt i32[S, M]; seq_lens i32[S];
    qsl i32[S + 1]; out f32[T, N, H] (padding tokens get zeros). window: each token reads its last
    `window` positions only (a window longer than any context: all of them)."""
    T = q.shape[0]
    ns = min(max(num_seqs, 0), bt.shape[0])
    for t in range(min(max(qsl[ns], 0), T), T):
        out[t] = _ZERO
    # Work items: a prefill tile or a decode row. numba's prange hands each thread one
    # contiguous slice of the iterations whatever the cost of each (its chunk-size setting made
    # no difference here), so the items are dealt out here instead, longest first to the least
    # loaded thread, with a cost in units of one query row against one KV token (a decode row
    # costs ~2 of them per KV token: it is bound by reading the page, not by the dots).
    # A row whose tokens or context fall outside the arrays (never from the engine's batches) is
    # skipped: reading past them could touch memory that is not ours.
    max_ctx = bt.shape[1] * kc.shape[4]
    ok = np.empty(ns, np.bool_)
    n_items = 0
    for r in range(ns):
        ql = qsl[r + 1] - qsl[r]
        ok[r] = qsl[r] >= 0 and qsl[r + 1] <= T and ql <= seq_lens[r] <= max_ctx
        if ok[r]:
            n_items += (ql + Q_TILE - 1) // Q_TILE if ql > 1 else (1 if ql == 1 else 0)
        else:  # its tokens (where they are inside q) read zeros, like padding
            for t in range(max(qsl[r], 0), min(max(qsl[r + 1], 0), T)):
                out[t] = _ZERO
    item_row = np.empty(n_items, np.int32)
    item_first = np.empty(n_items, np.int32)
    cost = np.empty(n_items, np.int64)
    w = 0
    for r in range(ns):
        ql = qsl[r + 1] - qsl[r]
        if not ok[r]:
            continue
        if ql == 1:
            item_row[w] = r
            item_first[w] = 0
            cost[w] = 2 * seq_lens[r] + 64
            w += 1
        elif ql > 1:
            for f in range(0, ql, Q_TILE):
                item_row[w] = r
                item_first[w] = f
                cost[w] = Q_TILE * (seq_lens[r] - ql + f + min(Q_TILE, ql - f)) + 64
                w += 1
    # (plain loops: under parallel=True numba turns array expressions such as np.argmin into
    # parallel regions of their own, one launch per call, which cost more than the work here)
    n_threads = _THREADS
    load = np.empty(n_threads, np.int64)
    for t in range(n_threads):
        load[t] = 0
    owner = np.empty(n_items, np.int32)
    order = np.argsort(cost)
    for j in range(n_items - 1, -1, -1):
        item = order[j]
        least = 0
        for t in range(1, n_threads):
            if load[t] < load[least]:
                least = t
        owner[item] = least
        load[least] += cost[item]
    # The first block of the item each thread runs after this one (items run in index order),
    # which a decode row prefetches while it reads its last page.
    next_blk = np.empty(n_items, np.int32)
    following = np.empty(n_threads, np.int32)
    for t in range(n_threads):
        following[t] = 0
    for i in range(n_items - 1, -1, -1):
        next_blk[i] = following[owner[i]]
        following[owner[i]] = bt[item_row[i], 0]  # a prefill tile, too, starts at block 0
    for thread in prange(n_threads):
        for i in range(n_items):
            if owner[i] != thread:
                continue
            row = item_row[i]
            q_len = qsl[row + 1] - qsl[row]
            if q_len == 1:
                decode_row(q, kc, vc, layer, bt[row], qsl[row], seq_lens[row], max(seq_lens[row] - window, 0),
                           scale, out, next_blk[i])
            else:
                first = item_first[i]
                prefill_tile(q, kc, vc, layer, bt[row], qsl[row] + first, min(Q_TILE, q_len - first),
                             seq_lens[row] - q_len + first, window, scale, out)


# ---------------------------------------------------------------------------------------------------
# FFI handlers, one per pool storage (carray needs the dtype at compile time). Arguments, in order:
# q f32[T, N, H], k_cache, v_cache, (layer, window) i32[2], block_tables i32[S, M], seq_lens i32[S],
# query_start_loc i32[S + 1], num_seqs i32[1], sm_scale f32[1]; result f32[T, N, H].
# ---------------------------------------------------------------------------------------------------
@njit(cache=True)
def _scalar(frame, i, dtype, at=0):
    return carray(pointer(buffer(frame, ARGS, i)[0]), (at + 1,), dtype=dtype)[at]


@njit(cache=True)
def _run(frame, kc, vc):
    q_p, q_d = buffer(frame, ARGS, 0)
    bt_p, bt_d = buffer(frame, ARGS, 4)
    T, N, H = dim(q_d, 0), dim(q_d, 1), dim(q_d, 2)
    S, M = dim(bt_d, 0), dim(bt_d, 1)
    ragged(carray(pointer(q_p), (T, N, H), dtype=np.float32), kc, vc, _scalar(frame, 3, np.int32),
           _scalar(frame, 3, np.int32, 1), carray(pointer(bt_p), (S, M), dtype=np.int32),
           carray(pointer(buffer(frame, ARGS, 5)[0]), (S,), dtype=np.int32),
           carray(pointer(buffer(frame, ARGS, 6)[0]), (S + 1,), dtype=np.int32),
           _scalar(frame, 7, np.int32), _scalar(frame, 8, np.float32),
           carray(pointer(buffer(frame, RETS, 0)[0]), (T, N, H), dtype=np.float32))


@njit(cache=True)
def _pool_shapes(frame):
    _, k_d = buffer(frame, ARGS, 1)
    L, NB, K, H, P = dim(k_d, 0), dim(k_d, 1), dim(k_d, 2), dim(k_d, 3), dim(k_d, 4)
    return (L, NB, K, H, P), (L, NB, K, P, H)


def _handler_f32(frame_ptr):
    frame = cpu_ffi.frame_words(frame_ptr)
    if not cpu_ffi.answer_metadata(frame) and cpu_ffi.executing(frame):
        numba_threads.apply_limit()
        k_shape, v_shape = _pool_shapes(frame)
        _run(frame, carray(pointer(buffer(frame, ARGS, 1)[0]), k_shape, dtype=np.float32),
             carray(pointer(buffer(frame, ARGS, 2)[0]), v_shape, dtype=np.float32))
    return cpu_ffi.success()


def _handler_u16(frame_ptr):
    frame = cpu_ffi.frame_words(frame_ptr)
    if not cpu_ffi.answer_metadata(frame) and cpu_ffi.executing(frame):
        numba_threads.apply_limit()
        k_shape, v_shape = _pool_shapes(frame)
        _run(frame, carray(pointer(buffer(frame, ARGS, 1)[0]), k_shape, dtype=np.uint16),
             carray(pointer(buffer(frame, ARGS, 2)[0]), v_shape, dtype=np.uint16))
    return cpu_ffi.success()


def _handler_u8(frame_ptr):
    frame = cpu_ffi.frame_words(frame_ptr)
    if not cpu_ffi.answer_metadata(frame) and cpu_ffi.executing(frame):
        numba_threads.apply_limit()
        k_shape, v_shape = _pool_shapes(frame)
        _run(frame, carray(pointer(buffer(frame, ARGS, 1)[0]), k_shape, dtype=np.uint8),
             carray(pointer(buffer(frame, ARGS, 2)[0]), v_shape, dtype=np.uint8))
    return cpu_ffi.success()


_HANDLERS: dict[str, object] = {}
_HANDLERS_LOCK = threading.Lock()  # one cfunc per storage, even if two threads trace at once
STORAGES = {"f32": _handler_f32, "u16": _handler_u16, "u8": _handler_u8}


def handler(storage: str):
    """The FFI handler for a pool of float32 ("f32"), uint16 bfloat16 bits ("u16") or uint8 fp8
    e4m3 bits ("u8"), compiled (or loaded from numba's cache) on first use: an engine pays only
    for the storage its pool has, and importing this module (numba_matmul.py does) compiles nothing."""
    with _HANDLERS_LOCK:
        if storage not in _HANDLERS:
            _HANDLERS[storage] = cfunc(cpu_ffi.HANDLER_SIGNATURE, cache=_CACHE_HANDLERS)(STORAGES[storage])
        return _HANDLERS[storage]
