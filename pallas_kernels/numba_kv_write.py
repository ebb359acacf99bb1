"""Rotary embeddings and the KV write of one layer in one pass, for the "numba" backend on a float32
pool: q, k, v [T, heads, H] from the layer's projection -> q with rope applied, and k (with rope)
and v written into their pages at the step's slot mapping, the pools updated in place.

Why: in XLA the same work is rope's fusions on q and k (each writes a new array) and then a scatter
of k and v into the donated pools; here each token's heads are read once and written once, where
they go (about half XLA's time on a prefill step: docs/PERFORMANCE.md, "Decisions in the code").

Same results as layers.apply_rope followed by kv_cache.write_kv (HF's rotate-half convention; a
padding token's slot 0 writes the null page; a slot outside the pool writes nothing). Used by
numba_attention.rope_write_kv, which falls back to those two where this cannot run (another pool
storage or dtype).
"""

from __future__ import annotations

import numpy as np
from numba import carray, cfunc, njit, prange

from pallas_kernels import cpu_ffi, numba_parallel, numba_threads
from pallas_kernels.cpu_ffi import ARGS, RETS, buffer, dim, pointer
from pallas_kernels.numba_kernels import _CACHE_HANDLERS, _THREADS, _prefetch_write

numba_parallel.install()  # before this module's parallel kernels compile (numba_parallel.py)

# Steps of at most this many tokens run on the calling thread alone (rope_write_serial). Where a
# token's stores wait on memory, two threads nearly halve a larger step's call; where they hit
# cache, waking numba's worker costs more than a few dozen tokens' work (docs/PERFORMANCE.md,
# "Decisions in the code").
SERIAL_TOKENS = 32
AHEAD = 2  # tokens ahead whose page lines are prefetched for writing


@njit(inline="always", cache=True)
def _fetch_slot(slots, t, t1, layer, kc, vc):
    """Prefetch, for writing, the lines token t (if t < t1) writes: its column of each K page (one
    line per head dimension: the pages are [H, P]) and its row of each V page. A decode step's
    tokens write to pages anywhere in the pool, 3 x 64 lines of K each on the demo model; one
    after the other, every store waited for its line from memory."""
    if t >= t1:
        return
    L, NB, K, H, P = kc.shape
    slot = slots[t]
    blk, off = slot // P, slot % P
    if slot < 0 or blk >= NB or layer < 0 or layer >= L:
        return
    if t > 0 and slot == slots[t - 1] + 1 and off % 16 != 0:
        return  # a prefill chunk's next position: its K lines are its neighbour's (16 float32 to a line)
    kf, vf = kc.ravel(), vc.ravel()
    for kh in range(K):
        page = (layer * NB + blk) * K + kh
        for i in range(H):
            _prefetch_write(kf, (page * H + i) * P + off)
        for h in range(0, H, 16):  # 16 float32 to a 64-byte line
            _prefetch_write(vf, (page * P + off) * H + h)


@njit(fastmath=True, inline="always", cache=True)
def _rows(q, k, v, cos, sin, layer, slots, kc, vc, q_out, t0, t1):
    """Tokens t0 ... t1 - 1 of rope_write."""
    N, H = q.shape[1], q.shape[2]
    K = k.shape[1]
    half = H // 2
    L, NB, _, _, P = kc.shape
    for t in range(t0, min(t1, t0 + AHEAD)):
        _fetch_slot(slots, t, t1, layer, kc, vc)
    for t in range(t0, t1):
        _fetch_slot(slots, t + AHEAD, t1, layer, kc, vc)
        for n in range(N):
            for i in range(half):
                x1, x2, c, s = q[t, n, i], q[t, n, half + i], cos[t, i], sin[t, i]
                q_out[t, n, i] = x1 * c - x2 * s
                q_out[t, n, half + i] = x2 * c + x1 * s
        slot = slots[t]
        blk, off = slot // P, slot % P
        if slot < 0 or blk >= NB or layer < 0 or layer >= L:  # never from the engine's batches
            continue
        for kh in range(K):
            for i in range(half):  # K pages are [H, P]: a token is a column of its page
                x1, x2, c, s = k[t, kh, i], k[t, kh, half + i], cos[t, i], sin[t, i]
                kc[layer, blk, kh, i, off] = x1 * c - x2 * s
                kc[layer, blk, kh, half + i, off] = x2 * c + x1 * s
            for h in range(H):
                vc[layer, blk, kh, off, h] = v[t, kh, h]


@njit(fastmath=True, parallel=True, cache=True)
def rope_write(q, k, v, cos, sin, layer, slots, kc, vc, q_out):
    """q f32[T, N, H], k, v f32[T, K, H], cos, sin f32[T, H / 2], slots i32[T];
    kc f32[L, NB, K, H, P], vc f32[L, NB, K, P, H] (updated); q_out f32[T, N, H] (written)."""
    T = q.shape[0]
    n_threads = min(_THREADS, max(T, 1))
    for th in prange(n_threads):
        _rows(q, k, v, cos, sin, layer, slots, kc, vc, q_out, T * th // n_threads, T * (th + 1) // n_threads)


@njit(fastmath=True, cache=True)
def rope_write_serial(q, k, v, cos, sin, layer, slots, kc, vc, q_out):
    """rope_write on the calling thread alone, for steps of few tokens (SERIAL_TOKENS)."""
    _rows(q, k, v, cos, sin, layer, slots, kc, vc, q_out, 0, q.shape[0])


# FFI handler. Arguments: q f32[T, N, H], k, v f32[T, K, H], cos, sin f32[T, H / 2], slots i32[T],
# layer i32[1], k_cache f32[L, NB, K, H, P], v_cache f32[L, NB, K, P, H]; results: q with rope
# f32[T, N, H], and the two pools, which alias arguments 7 and 8 (input_output_aliases).
@cfunc(cpu_ffi.HANDLER_SIGNATURE, cache=_CACHE_HANDLERS)
def handler(frame_ptr):
    frame = cpu_ffi.frame_words(frame_ptr)
    if not cpu_ffi.answer_metadata(frame) and cpu_ffi.executing(frame):
        numba_threads.apply_limit()
        q_p, q_d = buffer(frame, ARGS, 0)
        k_p, k_d = buffer(frame, ARGS, 1)
        _, kc_d = buffer(frame, ARGS, 7)
        T, N, H, K = dim(q_d, 0), dim(q_d, 1), dim(q_d, 2), dim(k_d, 1)
        L, NB, P = dim(kc_d, 0), dim(kc_d, 1), dim(kc_d, 4)
        kc = carray(pointer(buffer(frame, RETS, 1)[0]), (L, NB, K, H, P), dtype=np.float32)
        vc = carray(pointer(buffer(frame, RETS, 2)[0]), (L, NB, K, P, H), dtype=np.float32)
        # aliased by the call; should XLA ever not, start from a copy
        if buffer(frame, ARGS, 7)[0] != buffer(frame, RETS, 1)[0]:
            kc[:] = carray(pointer(buffer(frame, ARGS, 7)[0]), (L, NB, K, H, P), dtype=np.float32)
        if buffer(frame, ARGS, 8)[0] != buffer(frame, RETS, 2)[0]:
            vc[:] = carray(pointer(buffer(frame, ARGS, 8)[0]), (L, NB, K, P, H), dtype=np.float32)
        q = carray(pointer(q_p), (T, N, H), dtype=np.float32)
        k = carray(pointer(k_p), (T, K, H), dtype=np.float32)
        v = carray(pointer(buffer(frame, ARGS, 2)[0]), (T, K, H), dtype=np.float32)
        cos = carray(pointer(buffer(frame, ARGS, 3)[0]), (T, H // 2), dtype=np.float32)
        sin = carray(pointer(buffer(frame, ARGS, 4)[0]), (T, H // 2), dtype=np.float32)
        layer = carray(pointer(buffer(frame, ARGS, 6)[0]), (1,), dtype=np.int32)[0]
        slots = carray(pointer(buffer(frame, ARGS, 5)[0]), (T,), dtype=np.int32)
        q_out = carray(pointer(buffer(frame, RETS, 0)[0]), (T, N, H), dtype=np.float32)
        if T <= SERIAL_TOKENS:
            rope_write_serial(q, k, v, cos, sin, layer, slots, kc, vc, q_out)
        else:
            rope_write(q, k, v, cos, sin, layer, slots, kc, vc, q_out)
    return cpu_ffi.success()
