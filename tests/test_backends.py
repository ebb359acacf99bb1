"""The registry of attention backends: what "auto" picks on each platform and why it skips a backend,
what an explicit backend that cannot run says, each record's pool, and every registered backend
against the reference."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention import make_case

from pallas_kernels import BACKENDS, backends, choose, paged_attention, reference_attention

BF16 = "bfloat16"


def _say(monkeypatch, name: str, reason: str | None):
    """Make backend `name` answer `reason` (None: it can run) whatever this machine has."""
    monkeypatch.setitem(BACKENDS, name, dataclasses.replace(BACKENDS[name], why_unsupported=lambda *a: reason))


def test_auto_on_cpu_prefers_numba(monkeypatch):
    _say(monkeypatch, "numba", None)
    backend, skipped = choose("auto", "cpu", 64, None, BF16, BF16)
    assert backend.name == "numba" and skipped == []
    assert backend.default_block_size == 128


def test_auto_on_cpu_falls_back_to_xla_saying_why(monkeypatch):
    _say(monkeypatch, "numba", "numba is broken here")
    backend, skipped = choose("auto", "cpu", 64, None, BF16, BF16)
    assert backend.name == "xla" and skipped == ["using 'xla' because numba is broken here"]


def test_numba_check_sees_a_missing_numba(monkeypatch):
    """The numba record's own check, not a stand-in: `import numba` failing is a reason to skip it."""
    monkeypatch.setitem(sys.modules, "numba", None)  # what `import numba` sees where it is not installed
    backend, skipped = choose("auto", "cpu", 64, None, BF16, BF16)
    assert backend.name == "xla"
    assert len(skipped) == 1 and skipped[0].startswith("using 'xla' because numba is not importable")


def test_auto_on_gpu_picks_pallas_with_its_block_size():
    backend, skipped = choose("auto", "gpu", 128, None, BF16, BF16)
    assert backend.name == "pallas" and skipped == []
    assert backend.default_block_size == 16


@pytest.mark.parametrize("head_dim,block_size,kv_dtype,reason", [
    (80, None, BF16, "q: head_dim H=80 is not supported by attention backend 'pallas'"),
    (128, 24, BF16, r"k_cache: block size P=24 is not supported .* set block_size to one of them"),
    (128, 256, BF16, "block size P=256"),
    (128, None, "float32", "kv_cache_dtype 'float32' differs from the model dtype 'bfloat16'"),
])
def test_auto_on_gpu_falls_back_to_xla_saying_why(head_dim, block_size, kv_dtype, reason):
    backend, skipped = choose("auto", "gpu", head_dim, block_size, BF16, kv_dtype)
    assert backend.name == "xla"
    assert len(skipped) == 1 and skipped[0].startswith("using 'xla' because "), skipped
    assert re.search(reason, skipped[0]), skipped


def test_auto_elsewhere_is_the_portable_backend():
    assert choose("auto", "tpu", 128, None, BF16, BF16) == (BACKENDS["xla"], [])


@pytest.mark.parametrize("args,match", [
    (("pallas", "gpu", 80, None, BF16, BF16),
     r"attention_backend='pallas' cannot run here: q: head_dim H=80 .*; or use attention_backend='xla'"),
    (("pallas", "cpu", 64, 16, BF16, "float32"),
     (r"attention_backend='pallas' cannot run here: kv_cache_dtype 'float32' differs from the model dtype "
      r"'bfloat16'.*use kv_cache_dtype='auto' or 'fp8'; or use attention_backend='numba'")),
    (("pallas", "tpu", 64, None, BF16, BF16), r"not on 'tpu'; or use attention_backend='xla'"),
])
def test_explicit_backend_that_cannot_run_says_what_to_change(monkeypatch, args, match):
    _say(monkeypatch, "numba", None)  # so that "auto" on a CPU means numba whatever this machine has
    with pytest.raises(ValueError, match=match):
        choose(*args)


def test_explicit_numba_on_a_gpu_names_pallas():
    pytest.importorskip("numba")  # without it the reason is that numba is missing
    with pytest.raises(ValueError, match=r"attention_backend='numba' cannot run here: the numba kernels run on "
                                         r"a CPU only; or use attention_backend='pallas'"):
        choose("numba", "gpu", 64, None, BF16, BF16)


def test_explicit_backend_that_can_run_is_taken_without_reasons():
    assert choose("xla", "gpu", 80, None, BF16, "float32") == (BACKENDS["xla"], [])
    assert choose("pallas", "cpu", 16, 8, "float32", "float32") == (BACKENDS["pallas"], [])  # interpret mode


def test_unknown_name_lists_the_backends():
    with pytest.raises(ValueError, match=r"attention_backend must be 'auto' or one of \('pallas', 'numba', 'xla', "
                                         r"'reference'\), got 'tpu-magic'"):
        choose("tpu-magic", "cpu", 64, None, BF16, BF16)
    with pytest.raises(ValueError, match="must be one of"):
        backends.get("auto")  # "auto" is a choice among backends, not one


def test_pool_layout_and_dtype_of_each_record():
    L, NB, K, P, H = 2, 10, 4, 16, 64
    for b in BACKENDS.values():
        k_shape, v_shape = b.pool_shapes(L, NB, K, P, H)
        assert v_shape == (L, NB, K, P, H)
        assert k_shape == ((L, NB, K, H, P) if b.k_transposed else v_shape)
        assert b.pool_dtype("float32") == jnp.float32
    assert [b.name for b in BACKENDS.values() if b.k_transposed] == ["numba", "xla"]
    assert BACKENDS["pallas"].pool_dtype(BF16) == jnp.bfloat16
    assert all(BACKENDS[n].pool_dtype(BF16) == jnp.uint16 for n in ("numba", "xla", "reference"))


@pytest.mark.parametrize("v_scale", [4.0, 0.003])
@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("name", list(BACKENDS))
def test_each_backend_reads_an_fp8_pool(name, kv, v_scale):
    """An fp8 pool in the record's own storage (e4m3 as uint8 bits for the CPU backends, float8
    for Pallas; e5m2 as float8 everywhere) gives the reference's attention over the same rounded
    values in float32; writing saturates at the format's largest value instead of making NaN.
    v_scale 0.003 makes nearly every V value an fp8 subnormal, which a kernel run with denormals
    flushed to zero (XLA runs the numba kernels so) must still read as itself."""
    from pallas_kernels.pool_storage import pool_values, to_pool

    b = BACKENDS[name]
    rng = np.random.default_rng(5)
    q, k, v, bt, sl, qsl, ns = make_case(rng, [1, 9, 1, 5], [20, 7, 0, 0], N=4, K=2, H=16, P=8, S=6, T=32,
                                         NB=16, M=6, dtype=jnp.float32)
    storage = b.pool_dtype(kv)
    assert storage == ({"fp8": jnp.uint8 if b.fp8_as_bits else jnp.float8_e4m3fn,
                        "fp8_e5m2": jnp.float8_e5m2}[kv])
    k8, v8 = to_pool(k * 4, storage), to_pool(v * v_scale, storage)
    assert k8.dtype == storage and k8.dtype.itemsize == 1
    k32, v32 = pool_values(k8), pool_values(v8)  # the values the pool holds
    assert 0 < float(jnp.abs(k32 - k * 4).max()) < 0.2 * float(jnp.abs(k * 4).max())  # rounded, not garbage
    want = np.asarray(reference_attention(q, k32, v32, 1, bt, sl, qsl, ns, sm_scale=0.25))
    assert np.abs(want).max() > 0.5 * v_scale
    k_pool = jnp.swapaxes(k8, -1, -2) if b.k_transposed else k8
    got = jax.jit(lambda *a: paged_attention(*a, sm_scale=0.25, backend=name))(
        q, k_pool, v8, jnp.int32(1), bt, sl, qsl, ns)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    big = pool_values(to_pool(jnp.asarray([1e9, -1e9, 500.0], jnp.float32), storage))
    top = 448.0 if kv == "fp8" else 57344.0
    assert np.asarray(big).tolist() == [top, -top, 448.0 if kv == "fp8" else 512.0]


@pytest.mark.parametrize("name", list(BACKENDS))
def test_each_backend_matches_the_reference(name):
    """A mixed step (decode rows, a prefill chunk over a cached prefix, a fresh prompt, padding rows)
    through paged_attention with the pool in the record's own layout and storage."""
    b = BACKENDS[name]
    rng = np.random.default_rng(3)
    q, k, v, bt, sl, qsl, ns = make_case(rng, [1, 9, 1, 5], [20, 7, 0, 0], N=4, K=2, H=16, P=8, S=6, T=32,
                                         NB=16, M=6, dtype=jnp.float32)
    want = np.asarray(reference_attention(q, k, v, 1, bt, sl, qsl, ns, sm_scale=0.25))
    storage = b.pool_dtype("float32")
    k_pool = (jnp.swapaxes(k, -1, -2) if b.k_transposed else k).astype(storage)
    assert k_pool.shape == b.pool_shapes(*v.shape)[0]
    got = jax.jit(lambda *a: paged_attention(*a, sm_scale=0.25, backend=name))(
        q, k_pool, v.astype(storage), jnp.int32(1), bt, sl, qsl, ns)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    assert np.all(np.asarray(got)[int(qsl[int(ns[0])]):] == 0), "padding tokens must produce zeros"


def test_importing_the_registry_does_not_import_numba():
    """numba takes seconds to import and is absent on some machines; only the numba backend needs it."""
    code = "import sys, pallas_kernels.backends; assert 'numba' not in sys.modules, 'numba imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=pathlib.Path(__file__).parents[1],
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_xla_options_only_where_they_pay():
    """YNNPACK's elementwise fusion speeds the "xla" backend's attention on a CPU and slows the rest
    of the step otherwise: only that pair gets it (the platform record's step_compiler_options)."""
    from jaxsched import platforms

    assert "xla_cpu_experimental_ynn_fusion_type" in platforms.CPU.step_compiler_options("xla")
    assert platforms.CPU.step_compiler_options("numba") == {}
    assert platforms.GPU.step_compiler_options("xla") == platforms.GPU.step_compiler_options("pallas") == {}


def test_a_jax_without_pallas_triton_imports_and_auto_falls_back_with_a_reason():
    """Pallas' Triton backend is deprecated since jax 0.11: where a jax lacks it, pallas_kernels
    still imports, "auto" on a GPU takes the next backend and says why, and "pallas" asked by name
    is refused naming the module."""
    code = r'''
import importlib.abc, sys
class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "jax.experimental.pallas.triton":
            raise ImportError("removed in this jax")
sys.meta_path.insert(0, NoTriton())
from pallas_kernels import backends
b, skipped = backends.choose("auto", "gpu", 64, None, "bfloat16", "bfloat16")
print(b.name)
print(skipped[0])
try:
    backends.choose("pallas", "gpu", 64, None, "bfloat16", "bfloat16")
except ValueError as e:
    print("refused:", e)
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=pathlib.Path(__file__).parents[1], env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout
    name, why, refused = out.strip().splitlines()[-3:]
    assert name != "pallas" and "jax.experimental.pallas.triton" in why and "pallas" in why
    assert refused.startswith("refused:") and "jax.experimental.pallas.triton" in refused


def test_the_xla_backend_derives_its_step_values_outside_the_layer_scan(llama_dir):
    """The "xla" backend's padded block table and its decode rows' order (an argsort) come from the
    step's metadata alone: prepare() computes them once a step, so the stacked layers' scan body
    holds no sort and no pad of an int32 table (before, every layer padded the table and sorted)."""
    import functools

    from test_gpu_programs import functions, loop_body, reachable, sds

    from jaxsched import LLM
    from jaxsched.runner.batch import flat_sizes

    llm = LLM(llama_dir, max_model_len=64, max_num_seqs=16, max_num_batched_tokens=32, block_size=16,
              attention_backend="xla", layer_weights="stacked")
    r = llm.llm_engine.core.runner
    T, S = 32, 16  # 16 rows: several decode row groups, so the rows are sorted; M = 4 pads to 8
    args = (sds(r._state_leaves), sds(r.kv), sds(r.block_table),
            jax.ShapeDtypeStruct((r.scheduler_config.max_num_seqs,), "int32"),
            jax.ShapeDtypeStruct((flat_sizes(T, S)[0],), "int32"))
    text = jax.jit(functools.partial(r._forward, T=T, S=S)).lower(*args).as_text()
    funcs = functions(text)
    body = loop_body(funcs["main"])
    inside = body + "".join(funcs[f] for f in reachable(body, funcs))
    assert "stablehlo.sort" in text and re.search(r"stablehlo\.pad .*-> tensor<16x8xi32>", text)
    assert "stablehlo.sort" not in inside
    assert not re.search(r"stablehlo\.pad .*-> tensor<\d+x\d+xi32>", inside)


def windowed_by_hand(q, k, v, bt, sl, qsl, ns, window, sm_scale, softcap=None):
    """Sliding-window attention written out token by token in numpy (the reference's own check),
    scores soft-capped at `softcap` if given."""
    q, k, v, bt, sl, qsl = (np.asarray(x) for x in (q, k, v, bt, sl, qsl))
    N = q.shape[1]
    K, P = k.shape[2], k.shape[3]
    out = np.zeros_like(q)
    for r in range(int(ns[0])):
        for t in range(qsl[r], qsl[r + 1]):
            pos = sl[r] - (qsl[r + 1] - t)  # the token's position in its sequence
            seen = list(range(max(0, pos - window + 1), pos + 1))
            keys = np.stack([k[1, bt[r, p // P], :, p % P] for p in seen])  # [n, K, H]
            vals = np.stack([v[1, bt[r, p // P], :, p % P] for p in seen])
            for n in range(N):
                s = keys[:, n // (N // K)] @ q[t, n] * sm_scale
                if softcap is not None:
                    s = softcap * np.tanh(s / softcap)
                w = np.exp(s - s.max())
                out[t, n] = (w / w.sum()) @ vals[:, n // (N // K)]
    return out


@pytest.mark.parametrize("window", [1, 5, 8, 13, 100])
@pytest.mark.parametrize("name", list(BACKENDS))
def test_every_backend_matches_the_window_written_out(name, window):
    """Decode rows and prefill chunks over cached prefixes, with windows shorter than a page, a page,
    across pages and longer than any sequence: every backend agrees with the window written out."""
    b = BACKENDS[name]
    rng = np.random.default_rng(window)
    q, k, v, bt, sl, qsl, ns = make_case(rng, [1, 9, 1, 5, 20], [20, 7, 0, 33, 12], N=4, K=2, H=16, P=8, S=6, T=48,
                                         NB=40, M=8, dtype=jnp.float32)
    want = windowed_by_hand(q, k, v, bt, sl, qsl, ns, window, 0.25)
    k_pool = jnp.swapaxes(k, -1, -2) if b.k_transposed else k
    got = jax.jit(lambda *a: paged_attention(*a, sm_scale=0.25, backend=name, window=jnp.int32(window)))(
        q, k_pool, v, jnp.int32(1), bt, sl, qsl, ns)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", [n for n, b in BACKENDS.items() if b.softcap])
def test_soft_capped_scores_match_them_written_out(name):
    """Gemma 2's soft-capping (cap * tanh(s / cap) on the scaled scores, before the mask) with and
    without a window, in every backend that has it; at a cap of 1 the scores are capped hard, so
    leaving it out fails."""
    b = BACKENDS[name]
    rng = np.random.default_rng(7)
    q, k, v, bt, sl, qsl, ns = make_case(rng, [1, 9, 1, 5], [20, 7, 0, 33], N=4, K=2, H=16, P=8, S=6, T=32,
                                         NB=40, M=8, dtype=jnp.float32)
    k_pool = jnp.swapaxes(k, -1, -2) if b.k_transposed else k
    for window in (None, 6):
        want = windowed_by_hand(q, k, v, bt, sl, qsl, ns, window or 1000, 1.0, softcap=1.0)
        got = jax.jit(lambda *a, w=window: paged_attention(*a, sm_scale=1.0, backend=name, window=w, softcap=1.0))(
            q, k_pool, v, jnp.int32(1), bt, sl, qsl, ns)
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
        uncapped = windowed_by_hand(q, k, v, bt, sl, qsl, ns, window or 1000, 1.0)
        assert np.abs(uncapped - want).max() > 1e-2


def test_a_soft_capped_model_runs_on_a_backend_that_has_it():
    """numba has no soft-capping: asked for, it refuses naming the reason and what 'auto' picks;
    'auto' on a CPU takes 'xla' for such a model, and paged_attention refuses it too."""
    picked, skipped = backends.choose("auto", "cpu", 64, None, "float32", "float32", softcap=True)
    assert picked.name == "xla" and any("soft-capping" in s and "'numba'" in s for s in skipped)
    with pytest.raises(ValueError, match=r"'numba' has no attention logit soft-capping.*attention_backend='xla'"):
        backends.choose("numba", "cpu", 64, None, "float32", "float32", softcap=True)
    assert backends.choose("auto", "cpu", 64, None, "float32", "float32")[0].name == "numba"
    q, k, v, bt, sl, qsl, ns = make_case(np.random.default_rng(0), [1], [4], N=2, K=2, H=16, P=8, S=2, T=8,
                                         NB=4, M=2, dtype=jnp.float32)
    with pytest.raises(ValueError, match="'numba' has no score soft-capping"):
        paged_attention(q, jnp.swapaxes(k, -1, -2), v, 1, bt, sl, qsl, ns, sm_scale=1.0, backend="numba",
                        softcap=30.0)


@pytest.mark.parametrize("window", [3, 9, 40])
def test_pallas_windows_with_split_decode_rows_and_one_page_chunks(window):
    """The Pallas kernels' split-K decode (its splits share the chunks from the window's first on)
    and one-page chunks in both loops, in interpret mode, against the window written out."""
    from pallas_kernels import tuning
    from pallas_kernels.pallas_attention import pallas_attention

    rng = np.random.default_rng(window)
    q, k, v, bt, sl, qsl, ns = make_case(rng, [1, 1, 12, 1], [50, 7, 30, 0], N=4, K=2, H=16, P=8, S=4, T=16,
                                         NB=40, M=8, dtype=jnp.float32)
    cfg = tuning.PallasConfig(q_tile=8, prefill_kv_pages=1, prefill_warps=4, prefill_stages=1, decode_kv_pages=1,
                              decode_splits=3, decode_warps=4, decode_stages=1)
    got = pallas_attention(q, k, v, 1, bt, sl, qsl, ns, sm_scale=0.25, interpret=True, config=cfg,
                           window=jnp.int32(window))
    np.testing.assert_allclose(np.asarray(got), windowed_by_hand(q, k, v, bt, sl, qsl, ns, window, 0.25),
                               rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("storage", ["float32", "bfloat16"])
@pytest.mark.parametrize("window", [10, 64, 100, 1000])
def test_numba_windows_in_its_register_tile_path_and_bfloat16_pools(window, storage):
    """64-token pages and heads of 64 with G = 2 take the numba decode kernel's register tiles (a
    float32 pool) or its loops (bfloat16 bits): windows inside a page, of a page, across pages and
    longer than any context, against the window written out."""
    rng = np.random.default_rng(window)
    q, k, v, bt, sl, qsl, ns = make_case(rng, [1, 1, 20, 1], [150, 63, 90, 0], N=4, K=2, H=64, P=64, S=4, T=32,
                                         NB=16, M=4, dtype=jnp.float32)
    if storage == "bfloat16":  # the written-out window reads the same rounded values
        k, v = (x.astype(jnp.bfloat16).astype(jnp.float32) for x in (k, v))
    want = windowed_by_hand(q, k, v, bt, sl, qsl, ns, window, 0.125)
    b = BACKENDS["numba"]
    pool = b.pool_dtype(storage)
    kp = jnp.swapaxes(k, -1, -2).astype(storage)
    got = jax.jit(lambda *a: paged_attention(*a, sm_scale=0.125, backend="numba", window=jnp.int32(window)))(
        q, jax.lax.bitcast_convert_type(kp, pool) if storage == "bfloat16" else kp,
        jax.lax.bitcast_convert_type(v.astype(storage), pool) if storage == "bfloat16" else v,
        jnp.int32(1), bt, sl, qsl, ns)
    np.testing.assert_allclose(np.asarray(got), want, rtol=3e-5, atol=3e-5)
