"""Sliding-window attention's one number, as the compiled kernels (numba, Pallas) take it: beside the
layer index in one int32 pair, with "no window" a window longer than any context, so that one
kernel serves models with and without windows (paged_attention's docstring has the semantics)."""

from __future__ import annotations

import jax.numpy as jnp

NO_WINDOW = 1 << 30  # a window longer than any context


def layer_and_window(layer, window=None):
    """i32[2]: the layer index and the window (NO_WINDOW for None); traced values welcome."""
    return jnp.stack([jnp.asarray(layer, jnp.int32).reshape(()),
                      jnp.asarray(NO_WINDOW if window is None else window, jnp.int32).reshape(())])
