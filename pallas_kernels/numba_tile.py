"""Register-tile micro-kernels for numba code on a CPU, written as LLVM IR: c[MR, NR] = a[MR, kdim] .
b[kdim, NR] with the MR x NR block of the result held in vector registers (MR rows x NR / 16
16-lane float32 vectors, each one AVX-512 register or two AVX2 ones) through the whole sum over
kdim, one broadcast of a and one fused multiply-add per vector and term. NR and the callers' MR
follow the target's register file (below).

Why IR: numba vectorises a loop over 16 lanes but keeps the accumulators of plain Python loops in
memory, so every pass loads and stores them (numba_kernels.py's 4-rows-by-4-terms loops only
amortise that); phi nodes stay in registers. Used by numba_matmul.py (the layers' weight matmuls,
b a packed weight panel) and numba_kernels.py (the prefill tiles' and decode rows' score and value
dots, b a page of the KV pool).

A packed tile's b may also be int8 (a quantized weight panel): each row is widened to float32 as it
is loaded, and the caller scales the result. Made with grouped=True, the int8 panel's columns have a
scale and a minimum per group of `glen` terms (models/quantize.py's grouped weights: w = (q + 128)
* scale + minimum), and each row is dequantized as it is loaded, one more multiply-add per vector:
  packed grouped(a, a_off, lda, b, b_off, b_ahead, every, phase, c, c_off, ldc, kdim, s, m, s_off, glen)
      s and m the panel's scales and minimums, float16 as uint16 bits (what the weights hold:
      models/quantize.py), group g's NR at s_off + g * NR; glen even (a pass of
      two terms never straddles two groups), kdim a multiple of it. The group's scale and
      minimum + 128 * scale stay in four vector registers (AVX-512: 24 accumulators, 2 rows of b, a
      broadcast and these fill 31 of the 32), reloaded once per group.

Two forms, each an intrinsic made for one MR and a number of columns (NR, or a strided tile's
own: a decode row's tiles hold whole page rows of 64 or 128; every array flat float32
C-contiguous, offsets in elements, a's rows lda apart and c's ldc apart):
  packed(a, a_off, lda, b, b_off, b_ahead, every, phase, c, c_off, ldc, kdim)
      a a packed row tile (`pack_rows`: term k of row r at a_off + k * MR + r; lda unused), b's
      rows NR apart (a packed panel); writes c. Two terms per pass (a remainder term after), and
      in the passes with pass % every == phase it prefetches the pass's two rows of the panel at
      b_ahead (the weights come from memory: see numba_matmul.py): into L1 when the panel's row
      tiles are SPREAD or more (every), else into L2 (below).
  strided(a, a_off, lda, b, b_off, ldb, c, c_off, ldc, kdim)
      b's rows ldb apart (a page in cache); accumulates into c when made with accumulate=True,
      else writes it.
  strided with ahead=True: (a, a_off, lda, b, b_off, ldb, b_ahead, ahead_rows, c, c_off, ldc, kdim)
      the same, and for k < ahead_rows it prefetches row k of its columns at b_ahead (the same
      place in the next page) into L2 as it reads row k of b: a decode row's pages lie anywhere in
      the pool, where the hardware's prefetcher cannot see them coming (numba_kernels.decode_row).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils, config
from numba.core.codegen import get_host_cpu_features
from numba.extending import intrinsic


def _target_has_avx512() -> bool:
    """Whether the code numba compiles here has AVX-512's 32 vector registers of 16 float32 lanes
    (zmm0-31), rather than AVX2's 16 of 8 (ymm0-15, where a 16-lane vector of the IR takes two).
    numba's own target features (NUMBA_CPU_FEATURES, else the host's), which are part of its
    cache's key: code cached on one kind of CPU is never loaded on the other."""
    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else get_host_cpu_features()
    return "+avx512f" in features.split(",")


# A register tile must fit the vector registers with room for the row of b it multiplies and a
# broadcast of a. Sized for AVX-512's 32, the tiles spill to the stack on AVX2's 16, where the
# packed matmul then ran at half of numpy's speed or less (docs/PERFORMANCE.md, "Decisions in the code"): the tiles' shapes follow the target.
AVX512 = _target_has_avx512()
VECTOR_REGISTERS, LANES = (32, 16) if AVX512 else (16, 8)  # and float32 lanes in each
NR = 32 if AVX512 else 16  # columns of a packed tile: two 16-lane vectors per row, else one

# Where a prefetch puts its line: llvm.prefetch's locality 3 is x86's prefetcht0 (L1 and out),
# 2 is prefetcht1 (L2 and out). A prefetch one page or one panel ahead asks for as much data as
# the tile is reading, while it reads it; sent to an L1 no larger than a page, it evicts the
# lines in use, and decode attention and the small-T matmuls ran slower than with the same
# prefetch sent to L2 (docs/PERFORMANCE.md, "Decisions in the code"). A packed panel's prefetch
# is dealt out over its row tiles (`every`): with SPREAD or more, each pass asks for little
# enough that L1 measured a little faster, so only then does it go to L1.
TO_L1, TO_L2 = 3, 2
SPREAD = 3


def registers(rows: int, cols: int) -> int:
    """Vector registers a tile of rows x cols takes through its sum over k at the least: its
    accumulators, then either the row of b (held while each row's broadcast of a comes and goes)
    or the rows' broadcasts (held while b comes a vector at a time), and one more for the other."""
    per_row = cols // LANES
    return rows * per_row + min(per_row, rows) + 1


def make_tile(MR: int, form: str, accumulate: bool = False, ahead: bool = False, cols: int = NR,
              grouped: bool = False):
    """The intrinsic of `form` ("packed" or "strided", above) for MR rows of `cols` columns (NR
    unless a strided tile says otherwise; a multiple of 16); grouped: a packed int8 panel with
    scales and minimums per group of terms (above)."""
    if form not in ("packed", "strided"):
        raise ValueError(f"form must be 'packed' or 'strided', got {form!r}")
    if grouped and form != "packed":
        raise ValueError("only a packed tile reads a grouped panel")
    if cols % 16 or (form == "packed" and cols != NR):
        raise ValueError(f"a tile's columns are a multiple of 16 (NR = {NR} for a packed one), got {cols}")
    nv = cols // 16
    packed = form == "packed"
    ahead = ahead and not packed

    def codegen(context, builder, signature, args):
        if packed and grouped:
            a_arr, a_off, lda, b_arr, b_off, b_ahead, every, phase, c_arr, c_off, ldc, kdim, s_arr, m_arr, s_off, glen = args
            a_ty, b_ty, c_ty = signature.args[0], signature.args[3], signature.args[8]
        elif packed:
            a_arr, a_off, lda, b_arr, b_off, b_ahead, every, phase, c_arr, c_off, ldc, kdim = args
            a_ty, b_ty, c_ty = signature.args[0], signature.args[3], signature.args[8]
        elif ahead:
            a_arr, a_off, lda, b_arr, b_off, ldb, b_ahead, ahead_rows, c_arr, c_off, ldc, kdim = args
            a_ty, b_ty, c_ty = signature.args[0], signature.args[3], signature.args[8]
        else:
            a_arr, a_off, lda, b_arr, b_off, ldb, c_arr, c_off, ldc, kdim = args
            a_ty, b_ty, c_ty = signature.args[0], signature.args[3], signature.args[6]
        f32, i64, i32 = ir.FloatType(), ir.IntType(64), ir.IntType(32)
        v16 = ir.VectorType(f32, 16)
        ap = context.make_array(a_ty)(context, builder, a_arr).data
        bp = context.make_array(b_ty)(context, builder, b_arr).data
        cp = context.make_array(c_ty)(context, builder, c_arr).data
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16] * 3), "llvm.fma.v16f32")
        i8p = ir.IntType(8).as_pointer()
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0")

        def const(n):
            return ir.Constant(i64, n)

        def c_ptr(r, j):
            at = builder.add(c_off, builder.add(builder.mul(const(r), ldc), const(16 * j)))
            return builder.bitcast(builder.gep(cp, [at]), v16.as_pointer())

        b_step = const(NR) if packed else ldb
        if accumulate:
            start = [[builder.load(c_ptr(r, j), align=4) for j in range(nv)] for r in range(MR)]
        else:
            start = [[ir.Constant(v16, [0.0] * 16)] * nv for _ in range(MR)]
        lanes = ir.Constant(ir.VectorType(i32, 16), [0] * 16)

        # an int8 b (a packed panel of int8 weights: numba_matmul) is widened to float32 as it is
        # loaded (vpmovsxbd + vcvtdq2ps: two instructions per 16 columns and term, against MR
        # multiply-adds); its scales are the caller's to apply to c
        b_int8 = packed and b_ty.dtype == types.int8
        v16i8 = ir.VectorType(ir.IntType(8), 16)
        group = {}  # grouped: the current group's "scale" and "low" (minimum + 128 * scale) vectors

        def b_vector(at, j):
            if b_int8:
                raw = builder.load(builder.bitcast(builder.gep(bp, [at]), v16i8.as_pointer()), align=1)
                q = builder.sitofp(raw, v16)
                return builder.call(fma, [q, group["scale"][j], group["low"][j]]) if grouped else q
            return builder.load(builder.bitcast(builder.gep(bp, [at]), v16.as_pointer()), align=4)

        def group_vectors(k):
            """The scale and low vectors of the group term k starts (k // glen: once per group)."""
            sp = context.make_array(signature.args[12])(context, builder, s_arr).data
            mp = context.make_array(signature.args[13])(context, builder, m_arr).data
            base = builder.add(s_off, builder.mul(builder.sdiv(k, glen), const(NR)))
            scale, low = [], []
            c128 = ir.Constant(v16, [ir.Constant(f32, 128.0)] * 16)
            v16h = ir.VectorType(ir.HalfType(), 16)

            def half_vector(ptr, at):  # 16 float16 (their uint16 bits) -> float32
                return builder.fpext(builder.load(builder.bitcast(builder.gep(ptr, [at]), v16h.as_pointer()), align=2),
                                     v16)

            for j in range(nv):
                at = builder.add(base, const(16 * j))
                sv, mv = half_vector(sp, at), half_vector(mp, at)
                scale.append(sv)
                low.append(builder.call(fma, [c128, sv, mv]))
            return scale, low

        def term(k, acc):
            """acc + a[:, k] (x) b[k, :]: one broadcast of a and nv fused multiply-adds per row."""
            b_row = builder.add(b_off, builder.mul(k, b_step))
            bv = [b_vector(builder.add(b_row, const(16 * j)), j) for j in range(nv)]
            new = []
            for r in range(MR):
                if packed:  # the tile's MR terms k lie together, so every address is a constant offset
                    at = builder.add(a_off, builder.add(builder.mul(k, const(MR)), const(r)))
                else:
                    at = builder.add(a_off, builder.add(builder.mul(const(r), lda), k))
                splat = builder.insert_element(ir.Constant(v16, ir.Undefined), builder.load(builder.gep(ap, [at])),
                                               ir.Constant(i32, 0))
                splat = builder.shuffle_vector(splat, ir.Constant(v16, ir.Undefined), lanes)
                new.append([builder.call(fma, [splat, bv[j], acc[r][j]]) for j in range(nv)])
            return new

        def prefetch_row(row, width, step, level):
            at_row = builder.add(b_ahead, builder.mul(row, step))
            for j in range(0, width, 64 if b_int8 else 16):  # one 64-byte line per 16 float32 (64 int8)
                addr = builder.bitcast(builder.gep(bp, [builder.add(at_row, const(j))]), i8p)
                builder.call(prefetch, [addr, ir.Constant(i32, 0), ir.Constant(i32, level), ir.Constant(i32, 1)])

        def phis(incoming, block):
            acc = [[builder.phi(v16) for _ in range(nv)] for _ in range(MR)]
            for r in range(MR):
                for j in range(nv):
                    acc[r][j].add_incoming(incoming[r][j], block)
            return acc

        def close(acc, new, block):
            for r in range(MR):
                for j in range(nv):
                    acc[r][j].add_incoming(new[r][j], block)

        entry = builder.block
        done = builder.append_basic_block("k_done")

        def term_by_term(k0, acc_in, loop, came_from, fetch_row=None):
            """The loop from term k0 to kdim, one term per pass, in block `loop` (entered from
            `came_from` with the accumulators acc_in); fetch_row(k) is called for k < ahead_rows.
            Ends in `done`; returns the accumulators there."""
            body = builder.append_basic_block("k_one")
            builder.position_at_end(loop)
            k = builder.phi(i64)
            k.add_incoming(k0, came_from)
            acc = phis(acc_in, came_from)
            builder.cbranch(builder.icmp_signed("<", k, kdim), body, done)
            builder.position_at_end(body)
            if fetch_row is not None:
                with builder.if_then(builder.icmp_signed("<", k, ahead_rows)):
                    fetch_row(k)
            new = term(k, acc)
            end = builder.block
            k.add_incoming(builder.add(k, const(1)), end)
            close(acc, new, end)
            builder.branch(loop)
            return acc

        if packed:
            # Two terms per pass: the loop's own instructions (counter, compare, the prefetch's
            # test) are paid once per 48 multiply-adds instead of 24, and with a's terms packed
            # the addresses need no arithmetic per row (docs/PERFORMANCE.md, "Decisions in the code").
            loop, fetch, body, tail = (builder.append_basic_block(n) for n in ("k_loop", "k_fetch", "k_body", "k_tail"))
            spread = builder.icmp_signed(">=", every, const(SPREAD))  # the prefetch's level, once per call
            builder.branch(loop)
            builder.position_at_end(loop)
            k = builder.phi(i64)
            k.add_incoming(const(0), entry)
            n_pass = builder.phi(i64)  # pass % every, counted along: a division per pass slowed the FMAs
            n_pass.add_incoming(const(0), entry)
            acc = phis(start, entry)
            if grouped:  # the group's vectors and where the next group starts, carried along
                g_next = builder.phi(i64)
                g_next.add_incoming(const(0), entry)
                undef = ir.Constant(v16, ir.Undefined)
                carried = [[builder.phi(v16) for _ in range(nv)] for _ in range(2)]
                for vec in carried[0] + carried[1]:
                    vec.add_incoming(undef, entry)
                group["scale"], group["low"] = carried
            builder.cbranch(builder.icmp_signed("<=", builder.add(k, const(2)), kdim), fetch, tail)

            builder.position_at_end(fetch)
            # rows k and k + 1 of panel b_ahead (the thread's next one) in the passes with
            # pass % every == phase: while this panel is in cache, the next one is on its way from
            # memory. The row tiles of a panel take turns (every = their number), so the requests
            # are spread over the panel's time rather than all sent by its first tile, faster than
            # one core's misses can go.
            with builder.if_then(builder.icmp_signed("==", n_pass, phase)), builder.if_else(spread) as (to_l1, to_l2):
                for level, branch in ((TO_L1, to_l1), (TO_L2, to_l2)):
                    with branch:
                        for u in range(2):
                            prefetch_row(builder.add(k, const(u)), NR, const(NR), level)
            if grouped:  # a new group: its scale and low vectors, once
                reload, merged = builder.append_basic_block("g_reload"), builder.append_basic_block("g_merged")
                before = builder.block
                builder.cbranch(builder.icmp_signed("==", k, g_next), reload, merged)
                builder.position_at_end(reload)
                fresh = group_vectors(k)
                fresh_next = builder.add(k, glen)
                builder.branch(merged)
                builder.position_at_end(merged)
                now = []
                for old_v, new_v in zip(carried, fresh):
                    row = []
                    for o, n in zip(old_v, new_v):
                        ph = builder.phi(v16)
                        ph.add_incoming(o, before)
                        ph.add_incoming(n, reload)
                        row.append(ph)
                    now.append(row)
                next_at = builder.phi(i64)
                next_at.add_incoming(g_next, before)
                next_at.add_incoming(fresh_next, reload)
                group["scale"], group["low"] = now
            builder.branch(body)

            builder.position_at_end(body)
            new = term(builder.add(k, const(1)), term(k, acc))
            end = builder.block
            if grouped:
                g_next.add_incoming(next_at, end)
                for ph_row, val_row in zip(carried, now):
                    for ph, val in zip(ph_row, val_row):
                        ph.add_incoming(val, end)
                group["scale"], group["low"] = carried  # what the tail (an odd kdim: never, glen even) sees
            k.add_incoming(builder.add(k, const(2)), end)
            n_next = builder.add(n_pass, const(1))
            n_pass.add_incoming(builder.select(builder.icmp_signed("==", n_next, every), const(0), n_next), end)
            close(acc, new, end)
            builder.branch(loop)

            acc = term_by_term(k, acc, tail, loop)  # an odd kdim's last term
        else:
            loop = builder.append_basic_block("k_loop")
            builder.branch(loop)
            # row k of the next page, as row k of this one is read
            acc = term_by_term(const(0), start, loop, entry,
                               (lambda k: prefetch_row(k, cols, ldb, TO_L2)) if ahead else None)

        builder.position_at_end(done)
        for r in range(MR):
            for j in range(nv):
                builder.store(acc[r][j], c_ptr(r, j), align=4)
        return context.get_dummy_value()

    if packed and grouped:
        @intrinsic
        def tile(typingctx, a, a_off, lda, b, b_off, b_ahead, every, phase, c, c_off, ldc, kdim, s, m, s_off, glen):
            i = types.intp
            return types.void(a, i, i, b, i, i, i, i, c, i, i, i, s, m, i, i), codegen
    elif packed:
        @intrinsic
        def tile(typingctx, a, a_off, lda, b, b_off, b_ahead, every, phase, c, c_off, ldc, kdim):
            i = types.intp
            return types.void(a, i, i, b, i, i, i, i, c, i, i, i), codegen
    elif ahead:
        @intrinsic
        def tile(typingctx, a, a_off, lda, b, b_off, ldb, b_ahead, ahead_rows, c, c_off, ldc, kdim):
            i = types.intp
            return types.void(a, i, i, b, i, i, i, i, c, i, i, i), codegen
    else:
        @intrinsic
        def tile(typingctx, a, a_off, lda, b, b_off, ldb, c, c_off, ldc, kdim):
            i = types.intp
            return types.void(a, i, i, b, i, i, c, i, i, i), codegen
    return tile
