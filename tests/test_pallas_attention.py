"""The "pallas" attention backend in interpret mode against the plain reference, its validation, and
the engine end to end with it. Lowering for the GPU is tested in test_pallas_lowering.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention import make_case

from pallas_kernels import backends, paged_attention, reference_attention, tuning
from pallas_kernels.pallas_attention import pallas_attention, unsupported_reason

T, S, M, NB, H = 64, 8, 16, 96, 16
SCALE = 0.25

# Two batches of one shape, so each (N, K, P, dtype) compiles once. Rows past the listed ones are
# padding: block table rows of zeros (the null page), seq_len 0, no tokens. Contexts above 64 tokens
# make the kernels' KV loops (64-token chunks by default) run more than once.
BATCHES = {
    # (q_len, cached context) per row
    "mixed": [
        (1, 100),  # decode over a long context
        (16, 112),  # prefill chunk that ends exactly on a page (and KV chunk) boundary
        (1, 0),  # decode of a sequence of length 1
        (13, 70),  # prefill chunk after an unaligned cached prefix
        (9, 0),  # fresh prompt
        (1, 15),  # decode whose token is the last of a page (P = 16)
    ],
    "decode only": [(1, c) for c in (127, 1, 64, 8, 17, 0, 100, 63)],  # every row real, no padding
}

_pallas = jax.jit(lambda *a: paged_attention(*a, sm_scale=SCALE, backend="pallas"))
_ref = jax.jit(lambda *a: reference_attention(*a, sm_scale=SCALE))
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def check(got, q, k, v, layer, bt, sl, qsl, ns, tol):
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = np.asarray(_ref(*f32, layer, bt, sl, qsl, ns))  # in float32 from the same rounded inputs
    assert got.dtype == q.dtype and got.shape == q.shape
    got = np.asarray(got, np.float32)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    n_real = int(qsl[int(ns[0])])
    assert np.all(got[n_real:] == 0), "padding tokens must produce zeros"
    assert np.abs(got[:n_real]).max() > 0.05, "real tokens must produce non-trivial output"


# Every pair of (query heads per KV head, block size, dtype) values once, not all 12 triples: each
# case interprets the kernel on every batch of BATCHES (~5 s).
PAIRWISE = [((4, 4), 8, jnp.float32), ((4, 4), 16, jnp.bfloat16), ((8, 2), 8, jnp.bfloat16),
            ((8, 2), 16, jnp.float32), ((8, 1), 8, jnp.float32), ((8, 1), 16, jnp.bfloat16)]


@pytest.mark.parametrize("N,K,P,dtype", [(N, K, P, dt) for (N, K), P, dt in PAIRWISE],
                         ids=[f"G{N // K}-{P}-{'f32' if dt == jnp.float32 else 'bf16'}" for (N, K), P, dt in PAIRWISE])
def test_pallas_matches_reference(N, K, P, dtype):
    for i, (name, rows) in enumerate(BATCHES.items()):
        rng = np.random.default_rng([i, N, K, P, int(dtype == jnp.bfloat16)])
        q_lens, ctx = zip(*rows)
        args = make_case(rng, q_lens, ctx, N=N, K=K, H=H, P=P, S=S, T=T, NB=NB, M=M, dtype=dtype)
        layer = jnp.int32(1)
        got = _pallas(*args[:3], layer, *args[3:])
        check(got, *args[:3], layer, *args[3:], TOL[dtype])


def test_pallas_reads_fp8_pages_in_interpret_mode():
    """An e4m3 pool under a bfloat16 and a float32 q: the kernels convert each tile to q's dtype;
    the reference gets the same rounded values in float32."""
    from pallas_kernels.pool_storage import pool_values, to_pool

    for i, dtype in enumerate((jnp.bfloat16, jnp.float32)):
        rng = np.random.default_rng([7, i])
        q_lens, ctx = zip(*BATCHES["mixed"])
        q, k, v, *rest = make_case(rng, q_lens, ctx, N=8, K=2, H=H, P=16, S=S, T=T, NB=NB, M=M, dtype=dtype)
        k8, v8 = to_pool(k, jnp.float8_e4m3fn), to_pool(v, jnp.float8_e4m3fn)
        layer = jnp.int32(1)
        got = _pallas(q, k8, v8, layer, *rest)
        check(got, q, pool_values(k8), pool_values(v8), layer, *rest, TOL[dtype])


def test_small_tiles_splits_and_odd_group():
    """Many prefill tiles per row (windows clamped at the end of T), many KV chunks split four ways,
    and G = 3 query heads per KV head (padded to 4 inside)."""
    rng = np.random.default_rng(7)
    N, K, P = 6, 2, 8
    cfg = tuning.PallasConfig(q_tile=4, prefill_kv_pages=2, prefill_warps=4, prefill_stages=2,
                              decode_kv_pages=2, decode_splits=4, decode_warps=4, decode_stages=2)
    f = jax.jit(lambda *a: pallas_attention(*a, sm_scale=SCALE, config=cfg))
    for rows in (BATCHES["mixed"], [(1, 63), (30, 2), (1, 5), (33, 0)]):
        q_lens, ctx = zip(*rows)
        args = make_case(rng, q_lens, ctx, N=N, K=K, H=H, P=P, S=S, T=T, NB=NB, M=M)
        check(f(*args[:3], jnp.int32(0), *args[3:]), *args[:3], jnp.int32(0), *args[3:], TOL[jnp.float32])


def test_tuning_is_powers_of_two_and_splits_only_small_steps():
    for T_, S_ in ((16, 8), (256, 256), (2048, 64)):
        for N_, K_, H_, P_ in ((32, 8, 128, 16), (28, 4, 128, 128), (4, 4, 16, 8)):
            c = tuning.pallas_config(T_, S_, N_, K_, H_, P_, M=512)
            for v in (c.q_tile, c.prefill_kv_pages, c.decode_kv_pages, c.decode_splits):
                assert v & (v - 1) == 0, c
            Gp = tuning.next_pow2(N_ // K_)
            assert c.q_tile * Gp >= 16 and c.prefill_kv_pages * P_ >= 16 and c.decode_kv_pages * P_ >= 16
    assert tuning.pallas_config(16, 8, 32, 8, 128, 16, 512).decode_splits > 1
    assert tuning.pallas_config(256, 256, 32, 8, 128, 16, 512).decode_splits == 1


def test_unsupported_reason_for_choosing_a_backend():
    assert unsupported_reason(128, 16, jnp.bfloat16) is None
    assert unsupported_reason(64, 128, jnp.float32) is None
    assert "head_dim H=80" in unsupported_reason(80, 16, jnp.bfloat16)
    assert "block size P=256" in unsupported_reason(128, 256, jnp.bfloat16)
    assert "dtype int8" in unsupported_reason(128, 16, jnp.int8)


def _args(rng, *, H=16, P=8, N=4, K=2):
    q, k, v, bt, sl, qsl, ns = make_case(rng, [2, 1], [0, 3], N=N, K=K, H=H, P=P, S=4, T=16, NB=12, M=4)
    return {"q": q, "k_cache": k, "v_cache": v, "layer": 0, "block_tables": bt, "seq_lens": sl,
            "query_start_loc": qsl, "num_seqs": ns}


@pytest.mark.parametrize("make,match", [
    (lambda rng: _args(rng, P=24), r"k_cache: block size P=24 .* one of \(8, 16, 32, 64, 128\)"),
    (lambda rng: _args(rng, P=4), r"k_cache: block size P=4"),
    (lambda rng: _args(rng, H=24), r"q: head_dim H=24 .* power of two >= 16"),
    (lambda rng: _args(rng, H=8), r"q: head_dim H=8"),
    (lambda rng: {**_args(rng), "seq_lens": jnp.zeros(3, jnp.int32)}, r"seq_lens must be \[S\]=\[4\]"),
    (lambda rng: {**_args(rng), "q": jnp.zeros((16, 3, 16))}, "multiple of KV heads"),
    (lambda rng: {**_args(rng), "num_seqs": jnp.zeros(1, jnp.float32)}, "num_seqs must be int32"),
])
def test_validation_names_the_argument_before_tracing(make, match, monkeypatch):
    def kernel_reached(*a, **k):
        raise AssertionError("validation must reject the arguments before the kernel is traced")

    monkeypatch.setattr(backends, "pallas_attention", kernel_reached)  # what the "pallas" record calls
    args = make(np.random.default_rng(0))
    with pytest.raises(ValueError, match=match):
        paged_attention(**args, sm_scale=1.0, backend="pallas")
    with pytest.raises(ValueError, match=match):  # the same under jit: raised while tracing the caller
        jax.jit(lambda a: paged_attention(**a, sm_scale=1.0, backend="pallas"))(args)


def test_engine_greedy_tokens_equal_xla_backend(llama_dir):
    from jaxsched import LLM, SamplingParams

    engine = {"max_model_len": 64, "max_num_seqs": 4, "max_num_batched_tokens": 32, "block_size": 8}
    tok_ids = [[5, 17, 33, 2, 9, 41, 8, 100, 7, 3, 11, 12, 13], [40, 41], [7] * 21, [99]]
    prompts = [{"prompt_token_ids": p} for p in tok_ids]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for backend in ("xla", "pallas"):
        llm = LLM(llama_dir, attention_backend=backend, **engine)
        assert llm.llm_engine.config.attention_backend == backend
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    assert all(len(t) == 12 for t in outs["pallas"])
    assert outs["pallas"] == outs["xla"]
