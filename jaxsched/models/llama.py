"""The Llama-family decoder as a Flax NNX module: Llama (incl. Llama 3 rope scaling), Mistral,
Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm, free head_dim), GQA, tied or untied embeddings.

The forward pass is one lax.scan over layers, so the program compiles the attention of one layer
instead of L, which is what keeps warm-up of every bucket short. Layer weights are either stacked
along a leading L axis (the scan slices them) or held per layer and reached through lax.switch on
the layer index (on a CPU: XLA:CPU copies a sliced weight before every dot; pallas_kernels.tuning.
layer_weights has the figures). q/k/v and gate/up are fused into one matmul each (fewer, larger
dots run faster on every backend).

forward: (kv pool, batch) -> (logits f32[S, V] at batch.logits_indices, new kv pool)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsched.config import ModelConfig
from pallas_kernels import paged_attention, tuning, write_kv
from pallas_kernels.kv_cache import k_transposed

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def rms_norm(x, weight, eps: float):
    """HF's LlamaRMSNorm: normalise in float32, scale in the weight's dtype."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight * x32.astype(weight.dtype)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig):
    """Inverse frequencies f32[H/2], with the configured scaling applied."""
    H = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    sc = dict(cfg.rope_scaling or ())
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / sc["factor"]
    if kind == "llama3":
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return jnp.where(medium, smoothed, scaled)
    raise ValueError(f"rope scaling type {kind!r} is not supported; supported: default, linear, llama3")


def apply_rope(x, cos, sin):
    """HF's rotate-half convention. x [T, heads, H]; cos, sin [T, H/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


_WEIGHT_NAMES = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o_proj", "o_bias", "post_norm",
                 "gate_up", "gate_up_bias", "down", "down_bias")
LAYER_WEIGHTS = ("stacked", "per_layer")


class LayerWeights(nnx.Module):
    """One decoder layer's weights, or with lead=(L,) all L layers' stacked along axis 0. Linear
    weights are [in, out]; q/k/v and gate/up are fused."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, lead: tuple[int, ...] = ()):
        D, F = cfg.hidden_size, cfg.intermediate_size
        N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        init = nnx.initializers.normal(0.02)

        def w(*shape):
            return nnx.Param(init(rngs.params(), (*lead, *shape), jnp.float32).astype(dtype))

        def const(fill, *shape):
            return nnx.Param(jnp.full((*lead, *shape), fill, dtype))

        self.input_norm = const(1, D)
        self.qkv = w(D, (N + 2 * K) * H)
        self.qkv_bias = const(0, (N + 2 * K) * H) if cfg.qkv_bias else None
        self.q_norm = const(1, H) if cfg.qk_norm else None
        self.k_norm = const(1, H) if cfg.qk_norm else None
        self.o_proj = w(N * H, D)
        self.o_bias = const(0, D) if cfg.o_bias else None
        self.post_norm = const(1, D)
        self.gate_up = w(D, 2 * F)
        self.gate_up_bias = const(0, 2 * F) if cfg.mlp_bias else None
        self.down = w(F, D)
        self.down_bias = const(0, D) if cfg.mlp_bias else None

    def arrays(self) -> dict:
        return {n: getattr(self, n)[...] for n in _WEIGHT_NAMES if getattr(self, n) is not None}


class DecoderLayers(nnx.Module):
    """All L decoder layers' weights in one of two layouts (tuning.layer_weights says which a platform
    gets, and why): "stacked", one LayerWeights with a leading L axis, or "per_layer", L of them."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, layout: str):
        if layout not in LAYER_WEIGHTS:
            raise ValueError(f"layer_weights must be one of {LAYER_WEIGHTS}, got {layout!r}")
        self.layout = layout
        L = cfg.num_layers
        self.stacked = LayerWeights(cfg, dtype, rngs, (L,)) if layout == "stacked" else None
        self.per_layer = nnx.List([LayerWeights(cfg, dtype, rngs) for _ in range(L)]) if layout == "per_layer" else None


class LlamaForCausalLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype: str = "float32", *, rngs: nnx.Rngs,
                 attention_backend: str = "xla", layer_weights: str | None = None):
        """layer_weights: "stacked" or "per_layer"; None picks tuning.layer_weights for the platform."""
        self.cfg = cfg
        self.attention_backend = attention_backend
        jdt = _DTYPES[dtype]
        init = nnx.initializers.normal(0.02)
        V, D = cfg.vocab_size, cfg.hidden_size
        self.embed = nnx.Param(init(rngs.params(), (V, D), jnp.float32).astype(jdt))
        layout = layer_weights or tuning.layer_weights(jax.devices()[0].platform)
        self.layers = DecoderLayers(cfg, jdt, rngs, layout)
        self.norm = nnx.Param(jnp.ones((D,), jdt))
        self.lm_head = None if cfg.tie_word_embeddings else nnx.Param(
            init(rngs.params(), (D, V), jnp.float32).astype(jdt))

    def __call__(self, kv, batch):
        """kv: (k_cache, v_cache) as kv_cache.pool_shapes gives them for this model's attention
        backend (f[L, NB, K, P, H], K pages [H, P] for "xla"); batch: a BatchDescriptor of jax arrays."""
        cfg = self.cfg
        N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        embed = self.embed[...]
        T = batch.token_ids.shape[0]

        h = embed[batch.token_ids]  # [T, D]
        angles = batch.positions.astype(jnp.float32)[:, None] * rope_inv_freq(cfg)[None, :]
        cos, sin = jnp.cos(angles), jnp.sin(angles)  # [T, H/2]
        scale = H**-0.5

        # A layer is: before(weights) -> attention over the pool (no weights) -> after(weights).
        def before(p, h):  # -> q [T, N, H], k, v [T, K, H]
            x = rms_norm(h, p["input_norm"], eps)
            qkv = x @ p["qkv"]
            if "qkv_bias" in p:
                qkv = qkv + p["qkv_bias"]
            q = qkv[:, : N * H].reshape(T, N, H)
            k = qkv[:, N * H : (N + K) * H].reshape(T, K, H)
            v = qkv[:, (N + K) * H :].reshape(T, K, H)
            if "q_norm" in p:
                q = rms_norm(q, p["q_norm"], eps)
                k = rms_norm(k, p["k_norm"], eps)
            return q, k, v

        def after(p, h, o):  # o [T, N * H] -> the layer's output hidden state [T, D]
            o = o @ p["o_proj"]
            if "o_bias" in p:
                o = o + p["o_bias"]
            h = h + o
            x = rms_norm(h, p["post_norm"], eps)
            gu = x @ p["gate_up"]
            if "gate_up_bias" in p:
                gu = gu + p["gate_up_bias"]
            g, u = jnp.split(gu, 2, axis=-1)
            d = (jax.nn.silu(g) * u) @ p["down"]
            if "down_bias" in p:
                d = d + p["down_bias"]
            return h + d

        def attend(q, k, v, k_cache, v_cache, li):
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            k_cache, v_cache = write_kv(k_cache, v_cache, li, k, v, batch.slot_mapping,
                                        k_transposed=k_transposed(self.attention_backend))
            o = paged_attention(q, k_cache, v_cache, li, batch.block_tables, batch.seq_lens,
                                batch.query_start_loc, batch.num_seqs, sm_scale=scale,
                                backend=self.attention_backend)
            return o.reshape(T, N * H), k_cache, v_cache

        k_cache, v_cache = kv
        if self.layers.stacked is not None:
            def layer(carry, p):  # p: this layer's slice of the stacked weights
                h, k_cache, v_cache, li = carry
                o, k_cache, v_cache = attend(*before(p, h), k_cache, v_cache, li)
                return (after(p, h, o), k_cache, v_cache, li + 1), None

            (h, k_cache, v_cache, _), _ = jax.lax.scan(
                layer, (h, k_cache, v_cache, jnp.int32(0)), self.layers.stacked.arrays())
        else:
            # One switch per layer, between two attentions: branch i runs the end of layer i and the
            # start of layer i + 1 with their own arrays (the other layers' pass through untouched);
            # layer 0's start runs before the scan.
            # The halves are jitted so that they trace and lower once for all L branches (each branch
            # calls the same function); XLA still compiles L copies (tuning.layer_weights: the cost).
            ws = [lw.arrays() for lw in self.layers.per_layer]
            L = len(ws)
            before_once, after_once = jax.jit(before), jax.jit(after)

            def between(i, ws, h, o):
                h = after_once(ws[i], h, o)
                if i + 1 < L:
                    return (h, *before_once(ws[i + 1], h))
                return h, jnp.zeros((T, N, H), h.dtype), jnp.zeros((T, K, H), h.dtype), jnp.zeros((T, K, H), h.dtype)

            branches = [functools.partial(between, i) for i in range(L)]

            def layer(carry, _):
                h, q, k, v, k_cache, v_cache, li = carry
                o, k_cache, v_cache = attend(q, k, v, k_cache, v_cache, li)
                h, q, k, v = jax.lax.switch(li, branches, ws, h, o)
                return (h, q, k, v, k_cache, v_cache, li + 1), None

            (h, *_, k_cache, v_cache, _), _ = jax.lax.scan(
                layer, (h, *before_once(ws[0], h), k_cache, v_cache, jnp.int32(0)), None, length=L)
        # The lm_head runs only where a token is sampled: S rows, not T.
        hs = rms_norm(h[batch.logits_indices], self.norm[...], eps)
        w = embed.T if self.lm_head is None else self.lm_head[...]
        logits = jnp.dot(hs, w, preferred_element_type=jnp.float32)
        return logits, (k_cache, v_cache)
