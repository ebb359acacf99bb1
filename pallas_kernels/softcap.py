"""Gemma 2's attention-score soft-capping, cap * tanh(s / cap) on the scaled scores before the mask
(transformers' order), as every backend that supports it applies it. The cap is a model constant, so
it is compiled in (a Python float), not passed as an argument."""

from __future__ import annotations

import jax.numpy as jnp


def soft_cap(s, cap: float | None):
    """Scores s (already scaled by sm_scale) soft-capped at `cap`; unchanged for None."""
    return s if cap is None else cap * jnp.tanh(s / cap)
