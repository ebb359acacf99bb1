"""The "pallas" attention backend: ragged paged attention as Pallas kernels with the Triton lowering.

Same arguments and result as pallas_kernels.paged_attention (see its docstring for shapes). Two
kernels run every step; both are always launched, so a (T, S) bucket compiles to one program
whatever mix of prefill and decode it carries, and a program whose row is not of its kind returns
after reading one or two scalars. That costs an almost empty launch per layer (estimated at a few
microseconds, not yet measured) where a lax.cond around each kernel would have XLA:GPU read the
predicate back to the host, a synchronisation per layer.

  decode kernel   grid (S, K, NS). One decode row (a single query token) and one KV head: the G
                  query heads of that KV head are the rows of one dot, padded to Rd = max(16, Gp)
                  rows because Triton's dot needs 16. With few rows a step would leave most SMs
                  idle, so NS > 1 splits each row's KV range over NS programs (split-K, "flash
                  decoding"); their results are merged by log-sum-exp in XLA. NS comes from
                  tuning.pallas_config per bucket, so the split is chosen per step shape.
  prefill kernel  grid (NT, K). One tile of Qb query tokens of one multi-token row and one KV head:
                  its Qb * Gp (token, head) pairs are the rows of one dot, and the tile loops over its
                  row's KV in chunks up to its own causal limit with an online softmax. NT bounds the
                  tiles any step of the bucket can need; the tile map (row and first token of each
                  tile, -1 for unused tiles) is computed in XLA before the call.

Triton has no scalar prefetch, so block tables, lengths and the tile map are ordinary int32 inputs
read inside the kernels, and K/V pages are gathered by page id: cache[layer, ids, kv] is one
[pages, P, H] load. Every loaded tensor has power-of-2 sizes (validate_pallas checks H and P; the
tile sizes in tuning.py are powers of 2; G is padded to Gp). A prefill tile reads a fixed window of
Qb tokens clamped into [0, T) and stores only its own rows with a masked store, so no access leaves
an array. On CPU the kernels run with interpret=True, which is how the tests check them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxsched import platforms
from pallas_kernels import tuning
from pallas_kernels.softcap import soft_cap
from pallas_kernels.window import layer_and_window

try:  # the Triton backend of Pallas; deprecated from jax 0.11 on but still shipped
    from jax.experimental.pallas import triton as plgpu
    _MISSING: str | None = None
except ImportError as e:  # a jax without it: this backend cannot run, and says why (backends.choose)
    plgpu = None
    _MISSING = (f"jax {jax.__version__} has no jax.experimental.pallas.triton ({e}); attention backend 'pallas' "
                "needs a jax release that ships it (0.10 or 0.11)")

_NEG_INF = -1e30  # finite, so exp(s - m) of a fully masked chunk is exp(0), never NaN
# Triton's dot reads float32 operands as TF32 unless asked for HIGHEST (IEEE); float32 pools are
# for checking against the reference, so they get full precision. 16-bit operands are unaffected.
_PRECISION = jax.lax.Precision.HIGHEST
PAGE_SIZES = (8, 16, 32, 64, 128)
DTYPES = ("float32", "bfloat16", "float16")


def unsupported_reason(head_dim: int, block_size: int, dtype) -> str | None:
    """Why backend "pallas" cannot run these shapes, or None. The other backend to use instead is
    not named here: backends.choose names the one "auto" would pick on the platform."""
    H, P = head_dim, block_size
    if _MISSING is not None:
        return _MISSING
    if H < 16 or H & (H - 1):
        return (f"q: head_dim H={H} is not supported by attention backend 'pallas'; it needs a power of "
                f"two >= 16 (16, 32, 64, 128, 256)")
    if P not in PAGE_SIZES:
        return (f"k_cache: block size P={P} is not supported by attention backend 'pallas'; it needs one "
                f"of {PAGE_SIZES} (Triton tiles are powers of two); set block_size to one of them")
    if jnp.dtype(dtype).name not in DTYPES:
        return f"q: dtype {jnp.dtype(dtype).name} is not supported by attention backend 'pallas'; use one of {DTYPES}"
    return None


def validate_pallas(q, k_cache, block_tables) -> None:
    """Shape rules of the Triton lowering, checked before tracing; raises ValueError naming the argument.

    The general rules (shapes agree, int32 metadata) are paged_attention.validate's; call it first.
    """
    reason = unsupported_reason(q.shape[-1], k_cache.shape[3], q.dtype)
    if reason:
        raise ValueError(reason)
    if q.dtype != k_cache.dtype and k_cache.dtype not in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        raise ValueError(f"q dtype {q.dtype} must equal the cache dtype {k_cache.dtype} for attention backend "
                         "'pallas' (kv_cache_dtype='auto'), or the cache be fp8 (kv_cache_dtype='fp8'), or use "
                         "attention_backend='xla'")
    if block_tables.shape[1] < 1:
        raise ValueError(f"block_tables must have at least one column (M >= 1), got shape {block_tables.shape}")


def _compiler_params(num_warps: int, num_stages: int):
    # current releases (0.10, 0.11) name it CompilerParams; older ones TritonCompilerParams
    cls = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams
    return cls(num_warps=num_warps, num_stages=num_stages)


def _dot_nt(a, b):
    """a f[R, H] times b f[C, H] transposed: f32[R, C]."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_PRECISION,
                               preferred_element_type=jnp.float32)


def _online_softmax(carry, s, v):
    """One KV chunk of flash attention. s f32[R, C] masked scores, v f[C, H]."""
    m, l, acc = carry
    m_new = jnp.maximum(m, s.max(axis=1))
    p = jnp.exp(s - m_new[:, None])
    corr = jnp.exp(m - m_new)
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=_PRECISION,
                             preferred_element_type=jnp.float32)
    return m_new, l * corr + p.sum(axis=1), acc * corr[:, None] + pv


def _load_chunk(cache_ref, layer, bt_ref, row, chunk, kv, pages: int, dtype):
    """KV chunk `chunk` of sequence `row` for KV head kv: [pages * P, H] in `dtype` (q's), gathered
    page by page; an fp8 pool's tile is converted to it here, before the dots (which accumulate in
    float32), as Triton wants both of a dot's operands in one dtype."""
    ids = bt_ref[row, pl.ds(chunk * pages, pages)]  # i32[pages]
    x = cache_ref[layer, ids, kv, :, :]  # [pages, P, H]
    x = x.reshape(x.shape[0] * x.shape[1], x.shape[2])
    return x if x.dtype == dtype else x.astype(dtype)


def _decode_kernel(layer_ref, lens_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, sm_scale: float,
                   Gp: int, Rd: int, pages: int, splits: int, softcap: float | None = None):
    s_i, kv, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, window = layer_ref[0], layer_ref[1]  # window: NO_WINDOW when the model has none
    length = lens_ref[s_i]  # 0 for rows that are not decode rows: no chunk, nothing read
    P, H = k_ref.shape[3], k_ref.shape[4]
    C = pages * P
    n_chunks = (length + C - 1) // C
    lo = jnp.maximum(length - window, 0)  # the first position the window holds
    # the splits share the chunks from the window's first on: those before it are never read
    c_lo = jnp.minimum(lo // C, n_chunks)
    per_split = (n_chunks - c_lo + splits - 1) // splits
    c0 = c_lo + j * per_split
    c1 = jnp.minimum(c0 + per_split, n_chunks)
    q = q_ref[s_i, pl.ds(kv * Gp, Rd), :]  # [Rd, H]; rows >= Gp belong to the next KV head, unused

    def body(c, carry):
        k = _load_chunk(k_ref, layer, bt_ref, s_i, c, kv, pages, q.dtype)
        v = _load_chunk(v_ref, layer, bt_ref, s_i, c, kv, pages, q.dtype)
        s = soft_cap(_dot_nt(q, k) * sm_scale, softcap)
        pos = c * C + jnp.arange(C, dtype=jnp.int32)
        s = jnp.where(jnp.broadcast_to((pos[None, :] < length) & (pos[None, :] >= lo), (Rd, C)), s, _NEG_INF)
        return _online_softmax(carry, s, v)

    init = (jnp.full((Rd,), _NEG_INF, jnp.float32), jnp.zeros((Rd,), jnp.float32),
            jnp.zeros((Rd, H), jnp.float32))
    m, l, acc = jax.lax.fori_loop(c0, c1, body, init)
    seen = l > 0  # an empty split (its range past the row's end) has weight zero in the merge
    l_safe = jnp.where(seen, l, 1.0)
    o = acc / l_safe[:, None]
    lse = jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)
    own = jnp.arange(Rd, dtype=jnp.int32) < Gp
    plgpu.store(o_ref.at[j, s_i, pl.ds(kv * Gp, Rd), :], o, mask=jnp.broadcast_to(own[:, None], (Rd, H)))
    plgpu.store(lse_ref.at[j, s_i, pl.ds(kv * Gp, Rd)], lse, mask=own)


def _prefill_kernel(layer_ref, tile_row_ref, tile_first_ref, qsl_ref, lens_ref, bt_ref, q_ref, k_ref, v_ref,
                    o_ref, *, sm_scale: float, Qb: int, Gp: int, pages: int, softcap: float | None = None):
    i, kv = pl.program_id(0), pl.program_id(1)
    row = tile_row_ref[i]

    @pl.when(row >= 0)
    def _():
        layer, window = layer_ref[0], layer_ref[1]
        P, H = k_ref.shape[3], k_ref.shape[4]
        C, R = pages * P, Qb * Gp
        first = tile_first_ref[i]  # the tile's first token, counted within its row's chunk
        q_start = qsl_ref[row]
        q_len = qsl_ref[row + 1] - q_start
        count = jnp.minimum(Qb, q_len - first)
        ctx = lens_ref[row] - q_len  # tokens cached before this step's chunk
        tok0 = q_start + first
        # A window of Qb tokens, clamped into the array; rows outside [tok0, tok0 + count) belong to
        # other tiles: computed, then left out of the masked store.
        w = jnp.minimum(tok0, q_ref.shape[0] - Qb)
        q = q_ref[pl.ds(w, Qb), kv, :, :].reshape(R, H)  # row r = (token w + r // Gp, head r % Gp)
        q_pos = ctx + w + jax.lax.div(jnp.arange(R, dtype=jnp.int32), Gp) - q_start
        kv_end = ctx + first + count  # causal limit of the tile's last token

        def body(c, carry):
            k = _load_chunk(k_ref, layer, bt_ref, row, c, kv, pages, q.dtype)
            v = _load_chunk(v_ref, layer, bt_ref, row, c, kv, pages, q.dtype)
            s = soft_cap(_dot_nt(q, k) * sm_scale, softcap)
            pos = c * C + jnp.arange(C, dtype=jnp.int32)
            s = jnp.where((pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window), s, _NEG_INF)
            return _online_softmax(carry, s, v)

        init = (jnp.full((R,), _NEG_INF, jnp.float32), jnp.zeros((R,), jnp.float32),
                jnp.zeros((R, H), jnp.float32))
        n_chunks = (kv_end + C - 1) // C
        # the tile's first token reads from (its position - window + 1) on: no chunk before that one's
        c_lo = jnp.minimum(jnp.maximum(ctx + first - window + 1, 0) // C, n_chunks)
        _, l, acc = jax.lax.fori_loop(c_lo, n_chunks, body, init)
        o = (acc / jnp.where(l > 0, l, 1.0)[:, None]).reshape(Qb, Gp, H).astype(o_ref.dtype)
        tok = w + jnp.arange(Qb, dtype=jnp.int32)
        own = (tok >= tok0) & (tok < tok0 + count)
        plgpu.store(o_ref.at[pl.ds(w, Qb), kv, :, :], o, mask=jnp.broadcast_to(own[:, None, None], (Qb, Gp, H)))


def _tile_map(q_lens, is_prefill, NT: int, Qb: int):
    """Row and first token of each of NT prefill tiles; row -1 for tiles past the step's last. i32[NT] x 2."""
    n_tiles = jnp.where(is_prefill, (q_lens + Qb - 1) // Qb, 0)
    tile_end = jnp.cumsum(n_tiles)
    t = jnp.arange(NT, dtype=jnp.int32)
    # compare_all: one fused op; the default binary search is a loop of small kernels on a GPU
    row = jnp.searchsorted(tile_end, t, side="right", method="compare_all")
    row = jnp.clip(row, 0, q_lens.shape[0] - 1).astype(jnp.int32)
    first = (t - (tile_end[row] - n_tiles[row])) * Qb
    used = t < tile_end[-1]
    return jnp.where(used, row, -1).astype(jnp.int32), jnp.where(used, first, 0).astype(jnp.int32)


class StepMeta(NamedTuple):
    """What every layer's call needs from the step's metadata alone, computed once a step (prepare)
    outside the layer loop, not in each layer: the block table padded to whole chunks, the decode
    rows' lengths and first tokens, the prefill tile map, and where each token's output comes from."""

    bt: jax.Array  # i32[S, M'] the block table padded to a multiple of the chunk's pages
    dec_lens: jax.Array  # i32[S] a decode row's length, 0 for the others
    starts: jax.Array  # i32[S] each row's first token
    tile_row: jax.Array  # i32[NT] the row of each prefill tile (-1 past the last)
    tile_first: jax.Array  # i32[NT] its first token within the row
    keep: jax.Array  # bool[Tq] tokens of prefill rows (their output is the prefill kernel's)
    dest: jax.Array  # i32[S] where a decode row's output goes (Tq: nowhere)


def prepare(T: int, N: int, K: int, H: int, P: int, block_tables, seq_lens, query_start_loc, num_seqs,
            config: tuning.PallasConfig | None = None) -> StepMeta:
    """The step's StepMeta for T tokens of N query heads over K KV heads of dim H in P-token pages."""
    S, M = block_tables.shape
    cfg = config or tuning.pallas_config(T, S, N, K, H, P, M)
    Qb = cfg.q_tile
    Tq = max(T, Qb)
    step = max(cfg.prefill_kv_pages, cfg.decode_kv_pages)
    bt = jnp.pad(block_tables, ((0, 0), (0, (-M) % step)))  # a chunk's page ids stay in range
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    real = jnp.arange(S) < num_seqs[0]
    is_decode = real & (q_lens == 1)
    is_prefill = real & (q_lens > 1)
    starts = query_start_loc[:-1]
    # Prefill rows: NT tiles cover any step of this bucket (each row adds at most one partial tile,
    # and a prefill row has >= 2 tokens).
    NT = -(-T // Qb) + min(S, T // 2)
    tile_row, tile_first = _tile_map(q_lens, is_prefill, NT, Qb)
    t = jnp.arange(Tq, dtype=jnp.int32)
    tok_row = jnp.clip(jnp.searchsorted(query_start_loc, t, side="right", method="compare_all") - 1, 0, S - 1)
    keep = is_prefill[tok_row] & (t < query_start_loc[S])
    dest = jnp.where(is_decode, starts, Tq)  # Tq is out of range: dropped
    return StepMeta(bt, jnp.where(is_decode, seq_lens, 0), starts, tile_row, tile_first, keep, dest)


def pallas_attention(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc, num_seqs, *,
                     sm_scale: float, interpret: bool | None = None, config: tuning.PallasConfig | None = None,
                     meta: StepMeta | None = None, window=None, softcap: float | None = None):
    """Ragged paged attention with the Pallas kernels; interpret=None means interpret on CPU only.
    meta: the step's StepMeta (prepare), computed once for all layers; None computes it here.
    window: sliding-window attention (paged_attention's docstring): each loop starts at the first
    chunk its window holds. softcap: Gemma 2's score soft-capping (softcap.py)."""
    if interpret is None:
        interpret = not platforms.of(jax.default_backend()).triton
    T, N, H = q.shape
    _, _, K, P, _ = k_cache.shape
    S, M = block_tables.shape
    G = N // K
    Gp = tuning.next_pow2(G)
    cfg = config or tuning.pallas_config(T, S, N, K, H, P, M)
    if meta is None:
        meta = prepare(T, N, K, H, P, block_tables, seq_lens, query_start_loc, num_seqs, cfg)
    Qb = cfg.q_tile
    Tq = max(T, Qb)  # a tile's window needs Qb rows even in a step of fewer tokens
    layer = layer_and_window(layer, window)  # the kernels' two scalars
    bt = meta.bt
    qg = q.reshape(T, K, G, H)  # f[T, K, Gp, H] after the padding below
    if Gp != G:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, Gp - G), (0, 0)))

    # Decode rows: their single query gathered to [S, K * Gp + Rd - Gp, H] so that every
    # program's window of Rd rows lies inside the array.
    Rd = max(16, Gp)
    NS = cfg.decode_splits
    NPAD = K * Gp + Rd - Gp
    starts = meta.starts
    q_dec = qg[jnp.clip(starts, 0, T - 1)].reshape(S, K * Gp, H)
    q_dec = jnp.pad(q_dec, ((0, 0), (0, NPAD - K * Gp), (0, 0)))  # f[S, NPAD, H]
    decode = pl.pallas_call(
        functools.partial(_decode_kernel, sm_scale=sm_scale, Gp=Gp, Rd=Rd, pages=cfg.decode_kv_pages,
                          splits=NS, softcap=softcap),
        grid=(S, K, NS),
        out_shape=(jax.ShapeDtypeStruct((NS, S, NPAD, H), jnp.float32),
                   jax.ShapeDtypeStruct((NS, S, NPAD), jnp.float32)),
        interpret=interpret, name="ragged_paged_attention_decode",
        compiler_params=_compiler_params(cfg.decode_warps, cfg.decode_stages),
    )
    # f32[NS, S, NPAD, H] normalised per split, f32[NS, S, NPAD] its log-sum-exp
    o_parts, lse = decode(layer, meta.dec_lens, bt, q_dec, k_cache, v_cache)
    o_parts, lse = o_parts[:, :, : K * Gp], lse[:, :, : K * Gp]
    if NS == 1:
        o_dec = o_parts[0]  # f32[S, K * Gp, H]
    else:  # merge the splits: weight each by its share of the softmax denominator
        wgt = jnp.exp(lse - lse.max(axis=0, keepdims=True))
        o_dec = (wgt[..., None] * o_parts).sum(axis=0) / wgt.sum(axis=0)[..., None]

    NT = meta.tile_row.shape[0]
    tile_row, tile_first = meta.tile_row, meta.tile_first
    qp = qg if Tq == T else jnp.pad(qg, ((0, Tq - T), (0, 0), (0, 0), (0, 0)))
    prefill = pl.pallas_call(
        functools.partial(_prefill_kernel, sm_scale=sm_scale, Qb=Qb, Gp=Gp, pages=cfg.prefill_kv_pages,
                          softcap=softcap),
        grid=(NT, K),
        out_shape=jax.ShapeDtypeStruct((Tq, K, Gp, H), q.dtype),
        interpret=interpret, name="ragged_paged_attention_prefill",
        compiler_params=_compiler_params(cfg.prefill_warps, cfg.prefill_stages),
    )
    o = prefill(layer, tile_row, tile_first, query_start_loc, seq_lens, bt, qp, k_cache, v_cache)  # f[Tq, K, Gp, H]

    # Assemble: prefill rows as the kernel wrote them (other rows were never written), decode rows
    # scattered in, everything else (padding tokens) zero.
    o = jnp.where(meta.keep[:, None, None, None], o, 0)
    o = o.at[meta.dest].set(o_dec.reshape(S, K, Gp, H).astype(o.dtype), mode="drop")
    return o[:T, :, :G].reshape(T, N, H)
