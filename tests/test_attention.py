"""The attention backends against the plain reference on random ragged batches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import BACKENDS, paged_attention, reference_attention, write_kv
from pallas_kernels.backends import auto_order


def make_case(rng, q_lens, ctx_lens, *, N, K, H, P, S, T, NB=96, L=2, M=12, dtype=jnp.float32):
    """A random pool with randomly permuted block tables. Rows past len(q_lens) are padding."""
    n = len(q_lens)
    assert max(-(-(c + q) // P) for q, c in zip(q_lens, ctx_lens)) <= M
    perm = rng.permutation(NB - 1) + 1
    bt = np.zeros((S, M), np.int32)
    seq_lens = np.zeros(S, np.int32)
    qsl = np.zeros(S + 1, np.int32)
    used = 0
    for i, (q, c) in enumerate(zip(q_lens, ctx_lens)):
        nb = -(-(q + c) // P)
        bt[i, :nb] = perm[used : used + nb]
        used += nb
        seq_lens[i] = q + c
        qsl[i + 1] = qsl[i] + q
    qsl[n + 1 :] = qsl[n]
    k = jnp.asarray(rng.standard_normal((L, NB, K, P, H)), dtype)
    v = jnp.asarray(rng.standard_normal((L, NB, K, P, H)), dtype)
    q = jnp.asarray(rng.standard_normal((T, N, H)), dtype)
    return q, k, v, jnp.asarray(bt), jnp.asarray(seq_lens), jnp.asarray(qsl), jnp.asarray([n], jnp.int32)


CASES = {
    # name: (q_lens, ctx_lens)
    "decode only": ([1, 1, 1, 1], [5, 40, 0, 16]),
    "prefill only": ([23, 9], [0, 0]),
    "mixed with cached prefix": ([1, 17, 1, 40, 3], [30, 16, 0, 7, 61]),
    "chunk ends on a page boundary": ([16, 8, 1], [16, 0, 31]),
    "single long prefill": ([70], [10]),
}


def kT(k):
    """The "xla" backend's K pool: pages transposed, [L, NB, K, H, P] (kv_cache.k_transposed)."""
    return jnp.swapaxes(k, -1, -2)


def k_pool(k, backend):
    """A [L, NB, K, P, H] K pool in `backend`'s layout."""
    return kT(k) if BACKENDS[backend].k_transposed else k


# The backends "auto" may run on a CPU get the many cases below ("pallas" has its own file: in
# interpret mode it is too slow for them). One shape per (N, K, P) so each backend compiles once
# per head layout, not once per case.
CPU_NAMES = [b.name for b in auto_order("cpu")]
_cpu = {b: jax.jit(lambda q, k, *a, b=b: paged_attention(q, k_pool(k, b), *a, sm_scale=0.25, backend=b))
        for b in CPU_NAMES}
_ref = jax.jit(lambda *a: paged_attention(*a, sm_scale=0.25, backend="reference"))
CPU_BACKENDS = pytest.mark.parametrize("backend", CPU_NAMES)


@CPU_BACKENDS
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("N,K", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("P", [8, 16])
def test_cpu_backends_match_reference(backend, case, N, K, P):
    rng = np.random.default_rng(sorted(CASES).index(case) * 100 + N * 10 + K + P)
    q_lens, ctx = CASES[case]
    q, k, v, bt, sl, qsl, ns = make_case(rng, q_lens, ctx, N=N, K=K, H=16, P=P, S=8, T=128)
    layer = jnp.int32(1)
    want = _ref(q, k, v, layer, bt, sl, qsl, ns)
    got = _cpu[backend](q, k, v, layer, bt, sl, qsl, ns)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    n_real = int(qsl[int(ns[0])])
    assert np.all(np.asarray(got)[n_real:] == 0), "padding tokens must produce zeros"


@CPU_BACKENDS
@pytest.mark.parametrize("P,S", [(8, 32), (16, 32), (8, 26)])  # 26: groups of 9, 9 and 8 rows
def test_many_decode_rows_match_reference(backend, P, S):
    """Enough decode rows for the xla backend to sort them by length and split them into 4 loops
    (and for the numba kernel to spread them over its threads): rows of very different lengths, a
    prefill row among them and padding rows at the end, so a wrong permutation or a group stopping
    at the wrong length shows up as a mismatch."""
    rng = np.random.default_rng(7 + P)
    n_decode = S - 6
    q_lens = [1] * 13 + [9] + [1] * (n_decode - 13)
    ctx = [int(c) for c in rng.integers(0, 12 * P - 9, len(q_lens))]
    ctx[3], ctx[20] = 0, 12 * P - 1  # an empty context and the longest allowed
    q, k, v, bt, sl, qsl, ns = make_case(rng, q_lens, ctx, N=8, K=2, H=16, P=P, S=S, T=64, NB=400)
    layer = jnp.int32(0)
    want = _ref(q, k, v, layer, bt, sl, qsl, ns)
    got = _cpu[backend](q, k, v, layer, bt, sl, qsl, ns)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert np.all(np.asarray(got)[int(qsl[int(ns[0])]):] == 0)


def test_numba_head_dim_not_a_multiple_of_4():
    """The numba kernel's dots take 4 head-dim terms per pass with a remainder loop: H = 18 runs both."""
    rng = np.random.default_rng(11)
    q, k, v, bt, sl, qsl, ns = make_case(rng, [1, 23, 1, 6], [40, 9, 0, 17], N=6, K=2, H=18, P=8, S=8, T=64)
    want = _ref(q, k, v, jnp.int32(0), bt, sl, qsl, ns)
    got = _cpu["numba"](q, k, v, jnp.int32(0), bt, sl, qsl, ns)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("P,H,N,K", [(32, 32, 9, 3), (64, 64, 4, 1), (128, 64, 9, 3)])
def test_numba_prefill_register_tiles_match_reference(P, H, N, K):
    """Pages and heads a multiple of 32 take the prefill tiles' register-tile dots (numba_tile.py):
    tiles of 16 tokens whose rows (16 x G) fill whole tiles of 8 or end in a part-filled one, chunks
    starting and ending inside pages and on page boundaries, a cached prefix of several pages, and
    decode rows beside them."""
    rng = np.random.default_rng(P + H + N)
    q_lens = [1, 45, 16, 1, 3 * P + 5, 7]
    ctx = [2 * P + 3, P - 3, P, 0, 0, 2 * P + 17]
    q, k, v, bt, sl, qsl, ns = make_case(rng, q_lens, ctx, N=N, K=K, H=H, P=P, S=8, T=4 * P + 80, NB=40, M=6)
    want = _ref(q, k, v, jnp.int32(1), bt, sl, qsl, ns)
    got = _cpu["numba"](q, k, v, jnp.int32(1), bt, sl, qsl, ns)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert np.all(np.asarray(got)[int(qsl[int(ns[0])]):] == 0)


def test_numba_max_of_equals_numpy_over_whole_vectors_and_tails():
    """The online softmax's row max (numba_kernels._max_of): 16 lanes at a time, then a tail; the
    largest element placed in the vector part, in the tail, at the first and last element, and a
    start value larger than every element."""
    from numba import njit

    from pallas_kernels.numba_kernels import _max_of

    @njit
    def max_of(a, off, n, init):
        return _max_of(a, off, n, init)

    rng = np.random.default_rng(5)
    s = rng.standard_normal((3, 128)).astype(np.float32)
    for off in (0, 1, 128 + 5, 256):
        for n in (0, 1, 15, 16, 17, 33, 100, 128 - (off % 128)):
            part = s.ravel()[off : off + n].copy()
            for where in ([] if n == 0 else [0, n - 1, n // 2]):
                a = s.copy()
                a.ravel()[off + where] = 50.0 + where  # the largest, at `where`
                want = max(np.float32(-1e30), a.ravel()[off : off + n].max())
                assert max_of(a, off, n, np.float32(-1e30)) == want, (off, n, where)
            assert max_of(s, off, n, np.float32(1e3)) == np.float32(1e3)  # the start value wins
            if n:
                assert max_of(s, off, n, np.float32(-1e30)) == part.max()
            else:
                assert max_of(s, off, n, np.float32(-7.0)) == np.float32(-7.0)


def test_numba_exp_sum_matches_numpy_and_leaves_the_rest_untouched():
    """The online softmax's exponentials (numba_kernels._exp_sum): elements off .. off + n - 1
    become exp(x - mx), 16 lanes at a time and then a tail, and their sum is returned; elements
    outside the range keep their values. Includes arguments below the polynomial's floor (-87),
    whose exponentials are ~0, and x == mx (exactly 1)."""
    from numba import njit

    from pallas_kernels.numba_kernels import _exp_sum

    @njit
    def exp_sum(a, off, n, mx):
        return _exp_sum(a, off, n, mx)

    rng = np.random.default_rng(6)
    s = (rng.standard_normal((3, 128)) * 8).astype(np.float32)
    s[1, 7] = -200.0
    mx = np.float32(s.max())
    for off in (0, 1, 128 + 5, 256):
        for n in (0, 1, 15, 16, 17, 33, 100, 128 - (off % 128)):
            a = s.copy()
            got = exp_sum(a, off, n, mx)
            flat, orig = a.ravel(), s.ravel()
            # float32 rounds x * log2(e): relative error ~|x| * 6e-8, 1e-6 at x = -16
            want = np.exp(orig[off : off + n].astype(np.float64) - float(mx))
            np.testing.assert_allclose(flat[off : off + n], want, rtol=1e-5, atol=1e-30)
            np.testing.assert_allclose(got, want.sum(), rtol=1e-5, atol=1e-30)
            assert np.array_equal(flat[:off], orig[:off]) and np.array_equal(flat[off + n :], orig[off + n :])
    one = np.zeros(20, np.float32)
    assert exp_sum(one, 0, 20, np.float32(0.0)) == np.float32(20.0) and np.all(one == 1.0)


@pytest.mark.parametrize("N,K", [(4, 4), (4, 2), (9, 3), (8, 2)])
@pytest.mark.parametrize("P,H", [(64, 64), (128, 128)])
def test_numba_decode_register_tiles_match_reference(N, K, P, H):
    """Decode rows on a float32 pool with pages a multiple of 64 and heads of 64 or 128 take
    whole-row register tiles for both dots when G = N / K <= 3 (numba_kernels._decode_tiles; G = 4
    takes the loops): chunks of 128 and 64 columns, contexts ending on, just past and inside page
    boundaries, a lone token, and more rows than threads (each prefetches its next row's pages)."""
    rng = np.random.default_rng(N * 100 + K + P)
    ctx = [0, P - 1, P, P + 1, 3 * P - 7, 5 * P, 2, 4 * P + 9]
    q, k, v, bt, sl, qsl, ns = make_case(rng, [1] * len(ctx), ctx, N=N, K=K, H=H, P=P, S=8, T=16, NB=48, M=6)
    want = _ref(q, k, v, jnp.int32(1), bt, sl, qsl, ns)
    got = _cpu["numba"](q, k, v, jnp.int32(1), bt, sl, qsl, ns)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert np.all(np.asarray(got)[len(ctx):] == 0)


def test_numba_skips_a_row_whose_context_does_not_fit_its_block_table():
    """A row claiming more KV than its block table holds (never from the engine) must not make the
    kernel read past the table: its tokens get zeros and every other row is untouched."""
    rng = np.random.default_rng(12)
    q, k, v, bt, sl, qsl, ns = make_case(rng, [1, 9, 1], [30, 4, 2], N=4, K=2, H=16, P=8, S=4, T=16, M=6)
    want = np.asarray(_ref(q, k, v, jnp.int32(0), bt, sl, qsl, ns))
    bad = sl.at[1].set(6 * 8 + 1)  # one token more than 6 blocks of 8
    got = np.asarray(_cpu["numba"](q, k, v, jnp.int32(0), bt, bad, qsl, ns))
    rows = np.asarray(qsl)
    np.testing.assert_allclose(got[rows[0]:rows[1]], want[rows[0]:rows[1]], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got[rows[2]:rows[3]], want[rows[2]:rows[3]], rtol=2e-5, atol=2e-5)
    assert np.all(got[rows[1]:rows[2]] == 0)


def test_reference_matches_dense_softmax():
    """The reference itself against a direct per-sequence computation with numpy."""
    rng = np.random.default_rng(0)
    q_lens, ctx = [3, 1, 5], [4, 9, 0]
    q, k, v, bt, sl, qsl, ns = make_case(rng, q_lens, ctx, N=4, K=2, H=8, P=8, S=4, T=16)
    out = np.asarray(reference_attention(q, k, v, 0, bt, sl, qsl, ns, sm_scale=0.5))
    kn, vn, qn = np.asarray(k[0]), np.asarray(v[0]), np.asarray(q)
    for i, (ql, c) in enumerate(zip(q_lens, ctx)):
        L = ql + c
        blocks = np.asarray(bt[i, : -(-L // 8)])
        keys = kn[blocks].transpose(0, 2, 1, 3).reshape(-1, 2, 8)[:L]  # [L, K, H]
        vals = vn[blocks].transpose(0, 2, 1, 3).reshape(-1, 2, 8)[:L]
        for j in range(ql):
            t = int(qsl[i]) + j
            pos = c + j
            for h in range(4):
                kh = h // 2
                s = keys[: pos + 1, kh] @ qn[t, h] * 0.5
                p = np.exp(s - s.max())
                p /= p.sum()
                np.testing.assert_allclose(out[t, h], p @ vals[: pos + 1, kh], rtol=1e-5, atol=1e-6)


@CPU_BACKENDS
def test_bfloat16_inputs(backend):
    rng = np.random.default_rng(1)
    args = make_case(rng, [1, 12, 1], [20, 5, 3], N=8, K=2, H=16, P=8, S=4, T=16, dtype=jnp.bfloat16)
    q, k, v, bt, sl, qsl, ns = args
    want = reference_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), 0, bt, sl,
                               qsl, ns, sm_scale=0.25)
    got = paged_attention(q, k_pool(k, backend), v, 0, bt, sl, qsl, ns, sm_scale=0.25, backend=backend)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("backend", [b.name for b in BACKENDS.values() if b.bf16_as_bits])
def test_uint16_pool_holds_bfloat16_bits(backend):
    """A bfloat16 pool stored as uint16 bits (AttentionBackend.pool_dtype) writes and attends exactly like a
    bfloat16 pool: same rounding on write, same values read back."""
    rng = np.random.default_rng(2)
    q, k, v, bt, sl, qsl, ns = make_case(rng, [1, 9, 1], [30, 4, 2], N=8, K=2, H=16, P=8, S=4, T=16)
    kt = BACKENDS[backend].k_transposed
    bf_k, bf_v = k_pool(k, backend).astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    u_k, u_v = (jax.lax.bitcast_convert_type(x, jnp.uint16) for x in (bf_k, bf_v))
    assert BACKENDS[backend].pool_dtype("bfloat16") == jnp.uint16 and BACKENDS["pallas"].pool_dtype("bfloat16") == jnp.bfloat16
    want = paged_attention(q, bf_k.astype(jnp.float32), bf_v.astype(jnp.float32), 0, bt, sl, qsl, ns,
                           sm_scale=0.25, backend=backend)
    got = paged_attention(q, u_k, u_v, 0, bt, sl, qsl, ns, sm_scale=0.25, backend=backend)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    new = jnp.asarray(rng.standard_normal((2, k.shape[2], k.shape[4])), jnp.float32)
    slots = jnp.asarray([3, 17], jnp.int32)
    uk2, _ = write_kv(u_k, u_v, 0, new, new, slots, k_transposed=kt)
    bk2, _ = write_kv(bf_k, bf_v, 0, new, new, slots, k_transposed=kt)
    assert uk2.dtype == jnp.uint16
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(uk2, jnp.bfloat16), np.float32),
                                  np.asarray(bk2, np.float32))


@pytest.mark.parametrize("T,N,K,H,P", [(5, 4, 2, 16, 8), (300, 9, 3, 64, 128)])
def test_numba_rope_write_equals_rope_then_write_kv(T, N, K, H, P):
    """The "numba" backend's rope + KV write in one kernel (numba_kv_write.py) gives the values of
    layers.apply_rope followed by write_kv: q with rope, k (with rope) and v in their slots, padding
    tokens (slot 0) in the null page, every other slot and layer untouched; and where the program
    still reads the pool it wrote (XLA must then hand the kernel a copy), that pool is unchanged."""
    from jaxsched.models.layers import apply_rope
    from pallas_kernels import numba_attention

    rng = np.random.default_rng(T + H)
    L, NB = 2, 3 + -(-T // P)
    q, k, v = (jnp.asarray(rng.standard_normal((T, n, H)), jnp.float32) for n in (N, K, K))
    ang = rng.uniform(0, 50, (T, H // 2)).astype(np.float32)
    cos, sin = jnp.asarray(np.cos(ang)), jnp.asarray(np.sin(ang))
    slots = np.asarray(rng.permutation(np.arange(P, NB * P))[:T], np.int32)
    slots[-2:] = 0  # padding tokens
    slots = jnp.asarray(slots)
    kc = jnp.asarray(rng.standard_normal((L, NB, K, H, P)), jnp.float32)
    vc = jnp.asarray(rng.standard_normal((L, NB, K, P, H)), jnp.float32)
    layer = jnp.int32(1)

    def xla(q, k, v, kc, vc):
        q2, k2 = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return (q2, *write_kv(kc, vc, layer, k2, v, slots, k_transposed=True))

    def fused(q, k, v, kc, vc):
        return (*numba_attention.rope_write_kv(q, k, v, cos, sin, kc, vc, layer, slots), kc.sum(), vc.sum())

    want = jax.jit(xla)(q, k, v, kc, vc)
    got = jax.jit(fused)(q, k, v, kc, vc)
    real = np.asarray(slots) != 0
    for a, b in zip(got[:3], want[:3]):
        a, b = np.asarray(a), np.asarray(b)
        if a.ndim == 5:  # the null page holds whichever padding token came last: compare the rest
            a, b = a[:, 1:], b[:, 1:]
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6)
    assert real.sum() == T - 2
    np.testing.assert_allclose(float(got[3]), float(jnp.sum(kc)), rtol=1e-6)  # the inputs as they were
    np.testing.assert_allclose(float(got[4]), float(jnp.sum(vc)), rtol=1e-6)
    assert numba_attention.rope_write_kv(q.astype(jnp.bfloat16), k, v, cos, sin, kc, vc, layer, slots) is None


def test_write_kv_by_slot_mapping():
    L, NB, K, P, H = 2, 6, 2, 8, 4
    kc = jnp.zeros((L, NB, K, P, H))
    vc = jnp.zeros((L, NB, K, P, H))
    k = jnp.arange(3 * K * H, dtype=jnp.float32).reshape(3, K, H) + 1
    slots = jnp.asarray([5 * 8 + 7, 2 * 8 + 0, 0], jnp.int32)  # last: a padding token -> null page
    kc2, vc2 = write_kv(kc, vc, 1, k, -k, slots, k_transposed=False)
    np.testing.assert_array_equal(kc2[1, 5, :, 7], k[0])
    np.testing.assert_array_equal(vc2[1, 2, :, 0], -k[1])
    assert float(jnp.abs(kc2[0]).sum()) == 0  # other layers untouched
    touched = np.zeros((NB, P), bool)
    touched[5, 7] = touched[2, 0] = touched[0, 0] = True
    assert (np.asarray(jnp.abs(kc2[1]).sum((1, 3))) > 0).tolist() == touched.tolist()
    # the same write into a pool of transposed K pages lands on the same (page, offset, head) slots
    kt2, vt2 = write_kv(kT(kc), vc, 1, k, -k, slots, k_transposed=True)
    np.testing.assert_array_equal(kT(kt2), kc2)
    np.testing.assert_array_equal(vt2, vc2)


def test_xla_backend_names_its_k_layout():
    rng = np.random.default_rng(4)
    q, k, v, bt, sl, qsl, ns = make_case(rng, [1, 3], [5, 0], N=4, K=2, H=16, P=8, S=4, T=8)
    with pytest.raises(ValueError, match=r"k_cache must be \[L, NB, K, H, P\] = \(2, 96, 2, 16, 8\)"):
        paged_attention(q, k, v, 0, bt, sl, qsl, ns, sm_scale=0.25, backend="xla")
    with pytest.raises(ValueError, match=r"k_cache must be \[L, NB, K, P, H\]"):
        paged_attention(q, kT(k), v, 0, bt, sl, qsl, ns, sm_scale=0.25, backend="reference")


@pytest.mark.parametrize("bad,match", [
    (lambda a: {**a, "q": a["q"][:, :3]}, "multiple of KV heads"),
    (lambda a: {**a, "seq_lens": a["seq_lens"][:2]}, "seq_lens must be"),
    (lambda a: {**a, "query_start_loc": a["query_start_loc"][:3]}, "query_start_loc must be"),
    (lambda a: {**a, "block_tables": a["block_tables"].astype(jnp.float32)}, "block_tables must be int32"),
    (lambda a: {**a, "v_cache": a["v_cache"][:, :, :1]}, r"k_cache must be .* \(v_cache is \(2, 96, 1, 8, 16\)\)"),
    (lambda a: {**a, "q": a["q"][..., :8]}, "head_dim mismatch"),
])
def test_validation_names_the_argument(bad, match):
    rng = np.random.default_rng(0)
    q, k, v, bt, sl, qsl, ns = make_case(rng, [2, 1], [0, 3], N=4, K=2, H=16, P=8, S=4, T=16)
    a = {"q": q, "k_cache": kT(k), "v_cache": v, "layer": 0, "block_tables": bt, "seq_lens": sl, "query_start_loc": qsl, "num_seqs": ns}
    with pytest.raises(ValueError, match=match):
        paged_attention(**bad(a), sm_scale=1.0)
    with pytest.raises(ValueError, match="backend must be one of"):
        paged_attention(**a, sm_scale=1.0, backend="cuda-magic")
