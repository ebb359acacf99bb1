"""Gemma (GemmaForCausalLM, the first Gemma): the pre-norm decoder of Llama with its own RMSNorm,
which scales by (1 + w) in float32, embeddings scaled by sqrt(D), a GeGLU MLP (gelu, tanh
approximation), embeddings tied to the lm_head by default and a free head_dim (256 in the released
models). Optional q/k/v/o biases (attention_bias). GGUF files of it do not load (no gguf entry in
the registry).

q/k/v and gate/up are fused into one matmul each, as in llama.py.

forward: (kv pool, batch) -> (logits f32[S, V] at batch.logits_indices, new kv pool)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsched.models.hf_config import decoder_config
from jaxsched.models.layers import (
    DecoderLayers,
    Put,
    decoder_layer_spec,
    embed_tokens,
    hf_decoder_weights,
    linear,
    paged_attend,
    param,
    qkv_projection,
    rope_cos_sin,
    shards_of,
    split_gate_up,
    vocab_logits,
)
from jaxsched.models.model_config import ModelConfig


def gemma_config(hf: dict[str, Any], architecture: str) -> ModelConfig:
    """GemmaConfig's own defaults where config.json leaves a key out."""
    if hf.get("use_bidirectional_attention"):
        raise ValueError("Gemma with use_bidirectional_attention is an encoder, not a causal LM this engine runs")
    act = hf.get("hidden_act") or "gelu_pytorch_tanh"
    # transformers reads the "gelu" of the original releases as the tanh approximation too
    if act not in ("gelu", "gelu_pytorch_tanh"):
        raise ValueError(f"Gemma hidden_act {act!r} is not supported; supported: gelu_pytorch_tanh")
    # transformers' Gemma has no MLP biases whatever the config says (the forward has none either)
    return decoder_config(hf, architecture, mlp_bias=False, head_dim=int(hf.get("head_dim") or 256),
                          tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
                          max_position_embeddings=int(hf.get("max_position_embeddings", 8192)))


def gemma_rms_norm(x, weight, eps: float):
    """HF's GemmaRMSNorm: normalise and scale by (1 + weight), both in float32; the weight starts at
    zero."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


class GemmaForCausalLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype: str = "float32", *, rngs: nnx.Rngs,
                 attention_backend: str = "xla", layer_weights: str | None = None, mesh=None):
        """layer_weights: "stacked", "per_layer" or "unrolled" (layers.py); None picks the platform record's layer_weights for
        the platform. mesh: the engine's ("data", "model") mesh when it runs on several devices
        (parallel.py); cfg then has the head counts of the run layout (parallel.HeadLayout)."""
        self.cfg = cfg
        self.attention_backend = attention_backend
        self.mesh = mesh
        jdt = jnp.dtype(dtype)
        V, D = cfg.vocab_size, cfg.hidden_size
        self.embed = param(rngs, (V, D), jdt)
        self.layers = DecoderLayers(decoder_layer_spec(cfg, norm_fill=0.0), cfg.num_layers, jdt, rngs, layer_weights)
        self.norm = param(rngs, (D,), jdt, 0.0)
        self.lm_head = None if cfg.tie_word_embeddings else param(rngs, (D, V), jdt)

    def __call__(self, kv, batch):
        """kv: (k_cache, v_cache) as AttentionBackend.pool_shapes gives them for this model's attention
        backend; batch: a BatchDescriptor of jax arrays."""
        cfg = self.cfg
        N, K, H, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        eps = cfg.rms_norm_eps
        embed = self.embed[...]
        shards = shards_of(self.mesh)

        def before(p, h):  # -> q [T, N, H], k, v [T, K, H]
            return qkv_projection(p, gemma_rms_norm(h, p["input_norm"], eps), N, K, H, shards)

        def after(p, h, o):  # o [T, N * H] -> the layer's output hidden state [T, D]
            h = h + linear(p, o, "o_proj", "o_bias")
            g, u = split_gate_up(linear(p, gemma_rms_norm(h, p["post_norm"], eps), "gate_up"), shards)
            return h + linear(p, jax.nn.gelu(g, approximate=True) * u, "down")

        # HF multiplies by sqrt(D) as a float32 scalar cast to the embeddings' dtype
        h = embed_tokens(embed, batch.token_ids, self.mesh) * jnp.asarray(D**0.5, jnp.float32).astype(embed.dtype)  # [T, D]
        cos, sin = rope_cos_sin(cfg, batch.positions)
        # (N, K, H, P): a backend's per-step values are computed once, outside the layer loop
        attend = paged_attend(batch, self.attention_backend, cos, sin, H**-0.5, self.mesh,
                              (cfg.num_heads, cfg.num_kv_heads, H, kv[1].shape[3]), cfg.sliding_window)
        h, kv = self.layers(h, kv, before, after, attend, batch.logits_indices)  # h [S, D]
        # The lm_head runs only where a token is sampled: S rows, not T. The tied head is the
        # unscaled embedding.
        hs = gemma_rms_norm(h, self.norm[...], eps)
        w = embed.T if self.lm_head is None else self.lm_head[...]
        return vocab_logits(hs, w, self.mesh), kv

    @classmethod
    def hf_weights(cls, cfg: ModelConfig, get: Callable[[str], np.ndarray], put: Put, layout: str,
                   shards: int = 1) -> dict[str, Any]:
        """HF-named tensors (`get`) -> this model's pure state dict with layers in `layout`, each
        tensor placed by `put` (layers.Put), fused columns grouped for `shards` devices. Norm weights
        stay as HF holds them (w of 1 + w)."""
        return hf_decoder_weights(cfg, get, put, layout, shards)
