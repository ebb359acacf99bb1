"""Weight-only quantization at load (`--quantization int8 | fp8`): each linear weight kept on the
device as 8-bit values with one float32 scale per output channel, dequantized inside the matmul.

    w [.., D_in, N]  ->  q [.., D_in, N] int8 or float8_e4m3fn,  scale f32[.., N]
    w ~= q * scale   (symmetric: scale = max |w| over D_in / 127 for int8, / 448 for e4m3)

A layer's quantized weight `name` sits in its dict beside `name + "_scale"` (SCALE); the layer code
(layers.linear, qkv_projection, silu_gate_up; moe.py) sees the scale and multiplies the matmul's
result by it. The embedding (and an untied lm_head) quantize only when asked (quantize_embedding):
the table [V, D] gets one scale per row (token), which is also the tied lm_head's output channel.

Why our own and not qwix (Google's JAX quantization library, which tpu-inference uses): qwix's
post-training path intercepts a Flax module's dot_general calls by module path and swaps that
module's params; our layers are one scan over stacked weight dicts with fused projections, and on a
CPU the weights go through numba_matmul's packed kernel, which no interception reaches. What is
left of qwix for weight-only 8-bit (an absmax per channel and a dequantizing dot) is the dozen
lines below; its weight-only dot_general also dequantizes before a float dot, as linear() does.

GGUF's block-quantized weights (Q4_1, Q8_0, ...: `gguf_blocks` in ModelConfig) are kept in
groups instead, with `--quantization int8`: the file's weights are the dequantized blocks, and a
scale per output channel would round them again (on the demo's Q4_1 weights to 0.89 % of a row's
RMS, 6.6x bfloat16's 0.13 %, which lost float32's greedy tokens on 10 of 16 prompts). Each GROUP of
32 inputs of a column gets a float16 scale and minimum (llama.cpp's blocks are 32 inputs long):

    w [.., D_in, N]  ->  q [.., D_in, N] int8,  scale, minimum f16[.., D_in / 32, N]
    w ~= (q + 128) * scale + minimum   (per group: q + 128 in 0 .. 255)

quantize_grouped finds each block's own grid from its values: Q4_1 / Q5_1 blocks (min + d * q, q in
0 .. 15 or 31) and Q8_0 / Q4_0 / Q5_0 ones (d * q, |q| up to 127, 8 or 16) come back exactly (their
d and min are float16 numbers already); other blocks (the K-quants' sub-blocks) take 255 steps from
their min to their max, an error under 1/17 of a 4-bit step. Why not keep the 4-bit codes as int4:
the bytes are within 0.1x of float32 either way (0.43x against 0.34x of it for the demo), and every
kernel here reads 8-bit weights already (docs/PERFORMANCE.md, "Weight quantization and the fp8 KV
cache, demo model").

Quantized after the model is built, one weight at a time on its own device(s) (the float weight is
dropped as its quantized one replaces it): the load's peak is the float model's, the steady state
the quantized one's. A weight keeps its sharding; its scale takes the sharding of its output axis
(a grouped weight's scales and minimums take the weight's own: its input axis, grouped, and columns).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

QUANTIZATIONS = ("int8", "fp8")
SCALE = "_scale"  # a quantized layer weight `name` has its scales at name + SCALE
MINIMUM = "_min"  # and a grouped one (quantize_grouped) its groups' minimums at name + MINIMUM
GROUP = 32  # inputs per group of a grouped weight (a GGUF block)
# the grids quantize_grouped tries, in order: a symmetric d * q with |q| <= A, an affine min + d * q
# with q in 0 .. L; a block that is neither takes the last, 255 steps from its min to its max
_SYMMETRIC = (127, 16, 8)  # Q8_0, Q5_0, Q4_0
_AFFINE = (15, 31, 255)  # Q4_1, Q5_1, any
# what each mode stores (e4m3, as vLLM's fp8 weights)
_QTYPE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
# the layer weights quantized: the linear ones (layers.LINEAR_WEIGHTS) and an MoE layer's experts
QUANTIZED_LAYER_WEIGHTS = ("qkv", "o_proj", "gate_up", "down", "experts_gate_up", "experts_down",
                           "shared_gate_up", "shared_down")


def is_quantized(w) -> bool:
    return w.dtype in (jnp.int8, jnp.float8_e4m3fn)


@functools.partial(jax.jit, static_argnames=("mode", "axis"))
def quantize_array(w, mode: str, axis: int = -2):
    """(q, scale) of w, the scale over `axis` (the input axis of a [.., in, out] weight; -1 for a
    table's rows): q has w's shape, scale w's without `axis`, float32."""
    qtype = _QTYPE[mode]
    top = float(jnp.iinfo(qtype).max if mode == "int8" else jnp.finfo(qtype).max)  # 127, 448
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=axis, keepdims=True)
    scale = jnp.where(amax > 0, amax / top, 1.0)  # an all-zero channel stays zero, with scale 1
    x = w32 / scale
    q = jnp.clip(jnp.round(x), -top, top).astype(qtype) if mode == "int8" else x.astype(qtype)
    return q, jnp.squeeze(scale, axis)


@jax.jit
def quantize_grouped(w):
    """(q int8, scale f16, minimum f16) of w [.., D_in, N] (D_in a multiple of GROUP), a scale and
    minimum per GROUP inputs of each column, such that w ~= (q + 128) * scale + minimum (module
    docstring). Every grid is tried on every group; a group takes the first that gives its values
    back within float32's rounding, and a group none gives back the 255-step one."""
    *lead, D, N = w.shape
    g = w.astype(jnp.float32).reshape(*lead, D // GROUP, GROUP, N)
    lo, hi = jnp.min(g, axis=-2), jnp.max(g, axis=-2)
    amax = jnp.maximum(-lo, hi)
    tol = 1e-5 * jnp.maximum(amax, jnp.finfo(jnp.float32).tiny)
    grids = [(amax / A, -128 * (amax / A)) for A in _SYMMETRIC] + [((hi - lo) / L, lo) for L in _AFFINE]

    def on(step, low):  # (codes, step, low, exact) of one grid, its step and low in float16
        step = step.astype(jnp.float16).astype(jnp.float32)
        low = low.astype(jnp.float16).astype(jnp.float32)
        safe = jnp.where(step > 0, step, 1.0)
        codes = jnp.clip(jnp.round((g - low[..., None, :]) / safe[..., None, :]), 0, 255)
        back = codes * step[..., None, :] + low[..., None, :]
        return codes, step, low, jnp.max(jnp.abs(back - g), axis=-2) <= tol

    # the last grid (255 steps) for every group, then each other grid, in order, where it is exact
    codes, step, low, _ = on(*grids[-1])
    taken = jnp.zeros(step.shape, bool)
    for grid in grids[:-1]:
        c, st, lw, exact = on(*grid)
        take = exact & ~taken
        codes = jnp.where(take[..., None, :], c, codes)
        step, low, taken = jnp.where(take, st, step), jnp.where(take, lw, low), taken | exact
    q = (codes - 128).astype(jnp.int8).reshape(w.shape)
    return q, step.astype(jnp.float16), low.astype(jnp.float16)


def dequantize(w, scale, dtype, axis: int = -2, minimum=None):
    """q * scale in `dtype` (the inverse of quantize_array, up to its rounding), or a grouped weight's
    (q + 128) * scale + minimum (quantize_grouped, with `minimum`); w as it is when not quantized
    (scale None)."""
    if scale is None:
        return w
    if minimum is not None:
        *lead, D, N = w.shape
        g = (w.astype(jnp.float32) + 128).reshape(*lead, D // GROUP, GROUP, N)
        g = g * scale.astype(jnp.float32)[..., None, :] + minimum.astype(jnp.float32)[..., None, :]
        return g.reshape(w.shape).astype(dtype)
    return (w.astype(jnp.float32) * jnp.expand_dims(scale, axis)).astype(dtype)


def quantized_dot(x, w, scale, out_dtype=None, minimum=None):
    """x [.., D] @ w [D, N] with w quantized: the dot in x's dtype (XLA converts the 8-bit weight
    inside the dot's fusion on a GPU), accumulated in float32, then one multiply by the channel
    scales; the result in out_dtype (x's by default). A grouped weight (`minimum` given) is
    dequantized to x's dtype before the dot: its scales vary along the sum."""
    if minimum is not None:
        y = jnp.dot(x, dequantize(w, scale, x.dtype, minimum=minimum), preferred_element_type=jnp.float32)
        return y.astype(out_dtype or x.dtype)
    y = jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * scale).astype(out_dtype or x.dtype)


def _grouped_like(w, rows: bool = False):
    """quantize_grouped of w [.., D_in, N] (with `rows`, of a table [V, D] in groups along its rows:
    the results transposed back), the scales and minimums split where the weight's inputs and
    columns are."""
    q, s, lowest = quantize_grouped(w.T if rows else w)
    if rows:
        q, s, lowest = q.T, s.T, lowest.T
    if isinstance(w, jax.Array):
        s, lowest = jax.device_put(s, w.sharding), jax.device_put(lowest, w.sharding)
    return q, s, lowest


def grouped(mode: str | None, model_config) -> bool:
    """Whether `mode` keeps the model's layer weights in groups (quantize_grouped): int8 of a GGUF
    file's block-quantized weights."""
    return mode == "int8" and model_config.gguf_blocks


def quantize_model(model, mode: str, embedding: bool = False, groups: bool = False) -> int:
    """Quantize `model`'s layer weights in place (QUANTIZED_LAYER_WEIGHTS, per output channel, or with
    `groups` per GROUP inputs where their input axis allows: quantize_grouped), and with `embedding`
    its embedding and lm_head too (per row). Returns how many weights it quantized."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {mode!r}")
    layers = model.layers
    dicts = [layers.stacked] if layers.stacked is not None else list(layers.per_layer)
    n = 0
    for d in dicts:
        for name in QUANTIZED_LAYER_WEIGHTS:
            if name in d and not is_quantized(d[name][...]):
                w = d[name][...]
                if groups and w.shape[-2] % GROUP == 0:
                    q, s, lowest = _grouped_like(w)
                    d[name + MINIMUM] = nnx.Param(lowest)
                else:
                    q, s = quantize_array(w, mode)
                del w
                d[name] = nnx.Param(q)  # the float weight goes as its quantized one replaces it
                d[name + SCALE] = nnx.Param(s)
                n += 1
    if embedding:
        for name, axis in (("embed", -1), ("lm_head", -2)):
            w = getattr(model, name, None)
            if w is None or is_quantized(w[...]):
                continue
            w = w[...]
            if groups and w.shape[axis] % GROUP == 0:
                # the table [V, D] in groups along D, the lm_head's input axis (a GGUF file's blocks)
                q, s, lowest = _grouped_like(w, rows=axis == -1)
                setattr(model, name + MINIMUM, nnx.data(nnx.Param(lowest)))
            else:
                q, s = quantize_array(w, mode, axis)
            del w
            setattr(model, name, nnx.data(nnx.Param(q)))
            setattr(model, name + SCALE, nnx.data(nnx.Param(s)))
            n += 1
    return n


def scale_of(model, name: str):
    """The scales of the model's `name` ("embed", "lm_head") when it is quantized: f32[V] (per row of
    the table, per column of the lm_head), or (scale, minimum) of a grouped one ([V, D / GROUP] for
    the table, [D / GROUP, V] for the lm_head); None when it is not quantized."""
    s = getattr(model, name + SCALE, None)
    lowest = getattr(model, name + MINIMUM, None)
    if s is None:
        return None
    return s[...] if lowest is None else (s[...], lowest[...])
