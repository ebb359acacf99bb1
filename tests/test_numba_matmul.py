"""numba_matmul: the layers' weight matmuls over packed weights (the "numba" backend's engines on a
CPU), against numpy in float64, through the same FFI call the compiled step makes; and the engine
running its layers on packed weights."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny

from pallas_kernels import numba_matmul as nm


@pytest.mark.parametrize("K,N", [(64, 32), (1, 32), (37, 64), (96, 160), (576, 1728)])  # 1, 37: odd K
@pytest.mark.parametrize("T", [1, 3, 8, 13, 23, 200, 400])
def test_packed_matmul_matches_numpy(K, N, T):
    # T covers every row tile (MR, then 8 (AVX-512 only), 4, 2 and 1: 23 = 12 + 8 + 2 + 1 there,
    # 6 * 3 + 4 + 1 on AVX2) and more than one outer block of MB rows
    rng = np.random.default_rng(T * 1000 + N)
    w = rng.standard_normal((K, N)).astype(np.float32)
    x = rng.standard_normal((T, K)).astype(np.float32)
    wp = nm.pack(w)
    assert wp.shape == (N // nm.NR, K, nm.NR) and np.array_equal(nm.unpack(wp), w)
    y = np.asarray(jax.jit(nm.matmul)(jnp.asarray(x), jnp.asarray(wp)))
    ref = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


@pytest.mark.parametrize("K,F", [(64, 32), (37, 32), (96, 96), (576, 1536)])
@pytest.mark.parametrize("T", [1, 3, 8, 13, 23, 200, 400])
def test_fused_gate_up_matches_numpy(K, F, T):
    # silu(x @ Wg) * (x @ Wu) from the packed [Wg Wu]: every row tile, more than one block of MB
    # rows, and gate values far on both sides of zero (large |g|: the sigmoid's two branches)
    rng = np.random.default_rng(T * 1000 + F)
    w = rng.standard_normal((K, 2 * F)).astype(np.float32)
    w[:, : F // 4] *= 20
    x = rng.standard_normal((T, K)).astype(np.float32)
    y = np.asarray(jax.jit(nm.matmul_silu_mul)(jnp.asarray(x), jnp.asarray(nm.pack(w))))
    ref = x.astype(np.float64) @ w.astype(np.float64)
    g, u = ref[:, :F], ref[:, F:]
    e = np.exp(-np.abs(g))  # the sigmoid without overflow: 1 / (1 + e) for g >= 0, e / (1 + e) below
    want = g * np.where(g >= 0, 1 / (1 + e), e / (1 + e)) * u
    assert y.shape == (T, F) and np.abs(g).max() > 50
    np.testing.assert_allclose(y, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_fused_gate_up_needs_whole_panels_for_each_half():
    w = jnp.zeros((3, 64, nm.NR), jnp.float32)  # 96 columns: the gate would end inside a panel
    with pytest.raises(ValueError, match="even number"):
        nm.matmul_silu_mul(jnp.zeros((2, 64)), w)


@pytest.mark.parametrize("widths", [(576, 192, 192), (32, 32, 32), (64, 32, 96)])
@pytest.mark.parametrize("T", [1, 13, 200, 400])
def test_split_matmul_writes_each_column_group_to_its_own_array(widths, T):
    # a fused q/k/v projection's q, k and v, each written where it lies: the groups of x @ W's
    # columns in order, every row tile and more than one block of MB rows
    rng = np.random.default_rng(T + sum(widths))
    K = 96
    w = rng.standard_normal((K, sum(widths))).astype(np.float32)
    x = rng.standard_normal((T, K)).astype(np.float32)
    got = jax.jit(lambda x, wp: nm.matmul_split(x, wp, widths))(jnp.asarray(x), jnp.asarray(nm.pack(w)))
    ref = x.astype(np.float64) @ w.astype(np.float64)
    edges = np.cumsum((0, *widths))
    for g, a, b in zip(got, edges[:-1], edges[1:]):
        assert g.shape == (T, b - a)
        np.testing.assert_allclose(np.asarray(g), ref[:, a:b], rtol=0, atol=2e-5 * np.abs(ref).max())


@pytest.mark.parametrize("units", [(2, 1), (2, 1, 1.5), (3, 1.5, 0.5), (4, 0, 1)])  # in panels of NR columns
def test_split_matmul_refuses_widths_that_are_not_three_whole_groups(units):
    wp = jnp.zeros((5, 64, nm.NR), jnp.float32)  # 5 panels
    with pytest.raises(ValueError, match="three positive widths"):
        nm.matmul_split(jnp.zeros((2, 64)), wp, tuple(int(u * nm.NR) for u in units))


@pytest.mark.parametrize("rows", [0, 5, 13, 16, 40])
def test_row_limits_multiply_only_the_real_rows(rows):
    # inside row_limits, an operand of 16 rows (a step's T) has its first `rows` multiplied by all
    # three kernels and zeros past them (a step's padding), bit for bit the rows of the call without
    # a limit; an operand of another row count (8: S) keeps all its rows; a limit past T is T
    rng = np.random.default_rng(rows)
    K, T = 64, 16
    w = jnp.asarray(nm.pack(rng.standard_normal((K, 96)).astype(np.float32)))
    x = jnp.asarray(rng.standard_normal((T, K)).astype(np.float32))
    xs = jnp.asarray(rng.standard_normal((8, K)).astype(np.float32))

    def all_kernels(x, xs):
        return (nm.matmul(x, w), nm.matmul_silu_mul(x, w[:2]), *nm.matmul_split(x, w, (32, 32, 32)), nm.matmul(xs, w))

    def limited(x, xs, n):
        with nm.row_limits({T: n}):
            return all_kernels(x, xs)

    full = jax.jit(all_kernels)(x, xs)
    got = jax.jit(limited)(x, xs, jnp.int32(rows))  # the limit traced, as a step's token count is
    n = min(rows, T)
    for a, b in zip(got[:-1], full[:-1]):
        np.testing.assert_array_equal(np.asarray(a)[:n], np.asarray(b)[:n])
        assert not np.asarray(a)[n:].any()
    assert np.asarray(full[0])[n:].all()  # (the rows zeroed were not zeros anyway)
    np.testing.assert_array_equal(np.asarray(got[-1]), np.asarray(full[-1]))


@pytest.mark.parametrize("rows", [150, 192, 250, 400])
def test_a_large_operand_split_by_rows_gives_the_bits_of_one_split_by_panels(rows):
    # more than MB rows, at least MB / 2 for each thread: the threads take runs of rows and every
    # panel (numba_matmul._plan); fewer: they share the rows and split the panels. A row limit
    # moves one call between the two, and each real row's result must be the same bits either
    # way (and match float64), with zeros past the limit
    rng = np.random.default_rng(rows)
    K, T = 576, 400
    w = rng.standard_normal((K, 4 * nm.NR)).astype(np.float32)
    wp = jnp.asarray(nm.pack(w))
    x = rng.standard_normal((T, K)).astype(np.float32)

    def both(x):
        return nm.matmul(x, wp), nm.matmul_silu_mul(x, wp)

    def limited(x, n):
        with nm.row_limits({T: n}):
            return both(x)

    full = jax.jit(both)(jnp.asarray(x))
    got = jax.jit(limited)(jnp.asarray(x), jnp.int32(rows))
    one_block = jax.jit(both)(jnp.asarray(x[:nm.MB]))  # MB rows: the panels split
    for a, b, c in zip(got, full, one_block):
        a, b, c = np.asarray(a), np.asarray(b), np.asarray(c)
        np.testing.assert_array_equal(a[:rows], b[:rows])
        np.testing.assert_array_equal(b[:nm.MB], c)
        assert not a[rows:].any()
    ref = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(np.asarray(full[0]), ref, rtol=0, atol=2e-5 * np.abs(ref).max())


def test_leading_axes_and_no_rows():
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 1e3
    x = np.ones((2, 3, 64), np.float32)
    y = np.asarray(nm.matmul(jnp.asarray(x), jnp.asarray(nm.pack(w))))
    np.testing.assert_allclose(y, x @ w, rtol=1e-5)
    assert nm.matmul(jnp.zeros((0, 64)), jnp.asarray(nm.pack(w))).shape == (0, 32)


def test_the_matmul_and_prefill_tiles_fit_the_targets_vector_registers():
    # a tile that spills its accumulators to the stack ran at about a third of the speed (AVX-512's
    # shapes on AVX2: docs/PERFORMANCE.md, "Decisions in the code"); every row tile of the matmul and the
    # prefill tiles' page dots fit the target numba compiles for
    from pallas_kernels import numba_kernels, numba_tile

    for rows in (nm.MR, 4, 2, 1) + ((8,) if nm.MR > 8 else ()):
        assert numba_tile.registers(rows, nm.NR) <= numba_tile.VECTOR_REGISTERS, (rows, nm.NR)
    assert numba_tile.registers(numba_kernels._PAGE_ROWS, nm.NR) <= numba_tile.VECTOR_REGISTERS
    assert numba_tile.registers(12, 32) > 16  # (AVX-512's matmul tile would not fit AVX2)


@pytest.mark.parametrize("features,want", [("+avx,+avx2,+fma,-avx512f", "False 16 16"),
                                           ("+avx,+avx2,+fma,+avx512f,+avx512bw", "True 32 32")])
def test_numbas_target_features_choose_the_tile_shapes(features, want):
    # numba's target (NUMBA_CPU_FEATURES, part of its cache key, else the host's) sets the tiles:
    # AVX-512's 32 registers or AVX2's 16 (importing numba_tile compiles nothing)
    code = "from pallas_kernels import numba_tile as t; print(t.AVX512, t.NR, t.VECTOR_REGISTERS)"
    env = {**os.environ, "NUMBA_CPU_FEATURES": features}
    got = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == want.split()


def test_what_can_be_packed():
    from jaxsched import platforms

    assert nm.packable(np.zeros((8, 64), np.float32))
    assert not nm.packable(np.zeros((8, nm.NR * 3 // 2), np.float32))  # not a whole number of panels
    assert not nm.packable(np.zeros((8, 64), np.float16))
    assert not nm.packable(np.zeros((64,), np.float32))
    assert platforms.CPU.packed_matmuls("numba", 1)
    assert not platforms.CPU.packed_matmuls("xla", 1) and not platforms.CPU.packed_matmuls("numba", 2)
    assert not platforms.GPU.packed_matmuls("pallas", 1)


@pytest.mark.parametrize("kind", ["llama", "llama3 tied, vocab 320"])
def test_the_engine_runs_its_layers_on_packed_weights_and_matches_the_unpacked_model(kind, model_dirs, tokenizer_dir,
                                                                                      tmp_path, monkeypatch):
    # the same tiny Llama with the "numba" backend (packed weights) and the "xla" one (XLA's dots):
    # the same greedy tokens and logprobs, and the packed engine's layer weights are all packed; a
    # tied lm_head whose vocabulary fills whole panels gets a packed copy of its own
    from jaxsched import LLM, SamplingParams

    split, row_limits = nm.matmul_split, nm.row_limits
    limits = []  # the step's padding skipped: (T, S) of each traced model program (runner._row_limits)
    monkeypatch.setattr(nm, "row_limits", lambda lim: limits.append(tuple(lim)) or row_limits(lim))
    if kind == "llama":
        path = model_dirs["llama"]
    else:
        path = tiny.build_model(str(tmp_path / "tied"), "llama3", tokenizer_dir, seed=3, vocab_size=320)
    n_limits = 0
    split_calls, traced = [], 0  # the q/k/v projection traced through the split kernel (layers.qkv_projection)
    monkeypatch.setattr(nm, "matmul_split", lambda *a: split_calls.append(a[2]) or split(*a))
    prompts = [[1, 5, 9, 13, 2, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs, logprobs = {}, {}
    for backend in ("numba", "xla"):
        # a 16-token budget: one step program to compile, and the 17-token prompt is chunked
        llm = LLM(path, attention_backend=backend, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=128)
        runner = llm.llm_engine.core.runner
        assert runner.packed_matmuls == (backend == "numba")
        layer0 = runner.state["layers"]["per_layer"][0]
        dims = {name: layer0[name][...].ndim for name in ("qkv", "o_proj", "gate_up", "down")}
        assert set(dims.values()) == ({3} if backend == "numba" else {2}), dims
        head = runner.state["lm_head"][...] if "lm_head" in runner.state else None
        if kind == "llama":  # untied, vocabulary ~300: not a whole number of panels
            assert head.ndim == 2 and head.shape[1] % nm.NR
        else:  # tied: a packed copy with the numba backend, the embedding itself with XLA
            assert (head.shape == (320 // nm.NR, 64, nm.NR)) if backend == "numba" else head is None
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        if backend == "numba":  # traced at warm-up, with q's, k's and v's widths
            cfg = llm.llm_engine.model_config
            H = cfg.head_dim
            assert set(split_calls) == {(cfg.num_heads * H, cfg.num_kv_heads * H, cfg.num_kv_heads * H)}
            assert limits, "the packed engine traced no step under numba_matmul.row_limits"
        else:  # XLA's dots: no packed weight, no split kernel, no row limits
            assert len(split_calls) == traced, split_calls[traced:]
            assert len(limits) == n_limits, limits[n_limits:]
        n_limits = len(limits)
        traced = len(split_calls)
        outs[backend] = [o.outputs[0].token_ids for o in got]
        logprobs[backend] = [o.outputs[0].logprobs for o in got]
    assert outs["numba"] == outs["xla"]
    for a, b in zip(logprobs["numba"], logprobs["xla"]):
        for step_a, step_b in zip(a, b):
            assert step_a.keys() == step_b.keys()
            for tok in step_a:
                assert step_a[tok].logprob == pytest.approx(step_b[tok].logprob, abs=1e-4)
