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

Quantized after the model is built, one weight at a time on its own device(s) (the float weight is
dropped as its quantized one replaces it): the load's peak is the float model's, the steady state
the quantized one's. A weight keeps its sharding; its scale takes the sharding of its output axis.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

QUANTIZATIONS = ("int8", "fp8")
SCALE = "_scale"  # a quantized layer weight `name` has its scales at name + SCALE
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


def dequantize(w, scale, dtype, axis: int = -2):
    """q * scale in `dtype` (the inverse of quantize_array, up to its rounding); w as it is when not
    quantized (scale None)."""
    if scale is None:
        return w
    return (w.astype(jnp.float32) * jnp.expand_dims(scale, axis)).astype(dtype)


def quantized_dot(x, w, scale, out_dtype=None):
    """x [.., D] @ w [D, N] with w quantized: the dot in x's dtype (XLA converts the 8-bit weight
    inside the dot's fusion on a GPU), accumulated in float32, then one multiply by the channel
    scales; the result in out_dtype (x's by default)."""
    y = jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * scale).astype(out_dtype or x.dtype)


def quantize_model(model, mode: str, embedding: bool = False) -> int:
    """Quantize `model`'s layer weights in place (QUANTIZED_LAYER_WEIGHTS, per output channel), and
    with `embedding` its embedding and lm_head too. Returns how many weights it quantized."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {mode!r}")
    layers = model.layers
    dicts = [layers.stacked] if layers.stacked is not None else list(layers.per_layer)
    n = 0
    for d in dicts:
        for name in QUANTIZED_LAYER_WEIGHTS:
            if name in d and not is_quantized(d[name][...]):
                q, s = quantize_array(d[name][...], mode)
                d[name] = nnx.Param(q)  # the float weight goes as its quantized one replaces it
                d[name + SCALE] = nnx.Param(s)
                n += 1
    if embedding:
        for name, axis in (("embed", -1), ("lm_head", -2)):
            w = getattr(model, name, None)
            if w is not None and not is_quantized(w[...]):
                q, s = quantize_array(w[...], mode, axis)
                setattr(model, name, nnx.data(nnx.Param(q)))
                setattr(model, name + SCALE, nnx.data(nnx.Param(s)))
                n += 1
    return n


def scale_of(model, name: str):
    """The scales of the model's `name` ("embed", "lm_head") when it is quantized, else None."""
    s = getattr(model, name + SCALE, None)
    return None if s is None else s[...]
