"""The layer loop (layers.DecoderLayers) in every weight layout, with stand-in halves: it returns the
final hidden state at the wanted rows, and with per-layer weights the last layer's second half runs
on those rows alone. Real models' numerics are test_parity.py's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsched.models.layers import LAYER_WEIGHTS, DecoderLayers

T, D, L = 12, 8, 3
ROWS = np.array([3, 0, 11, 0], np.int32)  # S = 4; a repeated row, as a batch's padding rows repeat 0


def run(layout: str):
    layers = DecoderLayers({"w": ((D, D), None)}, L, jnp.float32, nnx.Rngs(0), layout)
    seen: list[tuple[int, ...]] = []  # the shapes of h that `after` was traced with

    def before(p, h):
        q = jnp.tanh(h @ p["w"])
        return q, q * 0.5, q * 0.25

    def attend(q, k, v, k_cache, v_cache, li):
        return q + k * v + li.astype(q.dtype), k_cache, v_cache

    def after(p, h, o):
        seen.append(h.shape)
        return h + jnp.tanh(o @ p["w"].T)

    h0 = jax.random.normal(jax.random.key(1), (T, D))
    kv = (jnp.zeros((L, 1)), jnp.zeros((L, 1)))
    out, _ = jax.jit(lambda h, rows: layers(h, kv, before, after, attend, rows))(h0, ROWS)

    ws = [np.asarray(layers.stacked["w"][...][i]) for i in range(L)] if layout == "stacked" else \
        [np.asarray(p["w"][...]) for p in layers.per_layer]
    h = np.asarray(h0, np.float64)
    for i, w in enumerate(ws):  # every layer on every row, then the rows picked
        q = np.tanh(h @ w)
        h = h + np.tanh((q + q * 0.5 * q * 0.25 + i) @ w.T)
    return np.asarray(out), h[ROWS], set(seen)


@pytest.mark.parametrize("layout", LAYER_WEIGHTS)
def test_the_loop_returns_the_final_hidden_state_at_the_rows(layout):
    out, want, _ = run(layout)
    assert out.shape == (len(ROWS), D)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["per_layer", "unrolled"])
def test_per_layer_weights_run_the_last_layers_second_half_on_the_rows_only(layout):
    _, _, seen = run(layout)
    assert seen == {(T, D), (len(ROWS), D)}, seen  # the earlier layers on all T; the last on S
    _, _, seen = run("stacked")
    assert seen == {(T, D)}, seen  # one scan body for every layer: all T (layers.DecoderLayers)


def test_unrolled_layers_run_without_a_loop():
    """"unrolled" traces each layer into the program: no scan (a while loop) and no switch."""
    layers = DecoderLayers({"w": ((D, D), None)}, L, jnp.float32, nnx.Rngs(0), "unrolled")
    kv = (jnp.zeros((L, 1)), jnp.zeros((L, 1)))
    before = lambda p, h: (h @ p["w"],) * 3
    after = lambda p, h, o: h + o
    attend = lambda q, k, v, kc, vc, li: (q + li.astype(q.dtype), kc, vc)
    jaxpr = str(jax.make_jaxpr(lambda h, rows: layers(h, kv, before, after, attend, rows))(jnp.ones((T, D)), ROWS))
    assert "scan" not in jaxpr and "while" not in jaxpr and "cond" not in jaxpr
    assert jaxpr.count("dot_general") == L
