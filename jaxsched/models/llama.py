"""The Llama family: Llama (incl. Llama 3 rope scaling), Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k
RMSNorm, free head_dim), GQA, tied or untied embeddings. One model class; the members differ only in
how their config.json reads (the adapters below, one registry entry each) and in GGUF names.

q/k/v and gate/up are fused into one matmul each (fewer, larger dots run faster on every backend).

forward: (kv pool, batch) -> (logits f32[S, V] at batch.logits_indices, new kv pool)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
    rms_norm,
    rope_cos_sin,
    shards_of,
    silu_gate_up,
    vocab_logits,
)
from jaxsched.models.model_config import ModelConfig


# -- config adapters (config.json dict -> ModelConfig), one per registry entry ----------------------
def llama_config(hf: dict[str, Any], architecture: str) -> ModelConfig:
    """Llama and Mistral."""
    return decoder_config(hf, architecture)


def _qwen_window(hf: dict[str, Any]) -> int | None:
    # Qwen configs carry a window size they do not use
    window = hf.get("sliding_window")
    return int(window) if window and hf.get("use_sliding_window", False) else None


def qwen2_config(hf: dict[str, Any], architecture: str) -> ModelConfig:
    """Qwen2: q/k/v biases always."""
    return decoder_config(hf, architecture, qkv_bias=True, sliding_window=_qwen_window(hf))


def qwen3_config(hf: dict[str, Any], architecture: str) -> ModelConfig:
    """Qwen3: RMSNorm over head_dim on q and k before rope."""
    return decoder_config(hf, architecture, qk_norm=True, sliding_window=_qwen_window(hf))


# -- GGUF (llama.cpp's names) ---------------------------------------------------------------------
# HF name suffix (per layer) -> GGUF name suffix
_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GGUF_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}
# llama.cpp's converter permutes the rows of q/k of these for its rope layout (not Qwen's)
_GGUF_ROPE_PERMUTED = ("LlamaForCausalLM", "MistralForCausalLM")


class LlamaForCausalLM(nnx.Module):
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
        self.layers = DecoderLayers(decoder_layer_spec(cfg), cfg.num_layers, jdt, rngs, layer_weights)
        self.norm = param(rngs, (D,), jdt, 1.0)
        self.lm_head = None if cfg.tie_word_embeddings else param(rngs, (D, V), jdt)

    def __call__(self, kv, batch):
        """kv: (k_cache, v_cache) as AttentionBackend.pool_shapes gives them for this model's attention
        backend (f[L, NB, K, P, H], K pages [H, P] for "xla"); batch: a BatchDescriptor of jax arrays."""
        cfg = self.cfg
        N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        embed = self.embed[...]
        shards = shards_of(self.mesh)

        def before(p, h):  # -> q [T, N, H], k, v [T, K, H]
            q, k, v = qkv_projection(p, rms_norm(h, p["input_norm"], eps), N, K, H, shards)
            if "q_norm" in p:
                q = rms_norm(q, p["q_norm"], eps)
                k = rms_norm(k, p["k_norm"], eps)
            return q, k, v

        def after(p, h, o):  # o [T, N * H] -> the layer's output hidden state [T, D]
            h = h + linear(p, o, "o_proj", "o_bias")
            return h + linear(p, silu_gate_up(p, rms_norm(h, p["post_norm"], eps), shards), "down", "down_bias")

        cos, sin = rope_cos_sin(cfg, batch.positions)
        # (N, K, H, P): a backend's per-step values are computed once, outside the layer loop
        attend = paged_attend(batch, self.attention_backend, cos, sin, H**-0.5, self.mesh,
                              (cfg.num_heads, cfg.num_kv_heads, H, kv[1].shape[3]))
        h, kv = self.layers(embed_tokens(embed, batch.token_ids, self.mesh), kv, before, after, attend,
                            batch.logits_indices)  # h [S, D]
        # The lm_head runs only where a token is sampled: S rows, not T.
        hs = rms_norm(h, self.norm[...], eps)
        w = embed.T if self.lm_head is None else self.lm_head[...]
        return vocab_logits(hs, w, self.mesh), kv

    @classmethod
    def hf_weights(cls, cfg: ModelConfig, get: Callable[[str], np.ndarray], put: Put, layout: str,
                   shards: int = 1) -> dict[str, Any]:
        """HF-named tensors (`get`) -> this model's pure state dict with layers in `layout`, each
        tensor placed by `put` (layers.Put), fused columns grouped for `shards` devices."""
        return hf_decoder_weights(cfg, get, put, layout, shards)

    @staticmethod
    def gguf_name(name: str) -> str:
        """llama.cpp's name of the HF-named tensor `name`."""
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            return f"blk.{i}.{_GGUF_LAYER_NAMES[rest]}"
        return _GGUF_TOP_NAMES[name]

    @staticmethod
    def from_gguf(hf: dict[str, Any], name: str, w: np.ndarray) -> np.ndarray:
        """Tensor `name` as read from a GGUF file (float32) -> as HF holds it: q/k rows un-permuted.
        hf: the file's metadata as a config.json dict (loader.gguf_config)."""
        if hf["architectures"][0] not in _GGUF_ROPE_PERMUTED or not name.endswith(("q_proj.weight", "q_proj.bias",
                                                                           "k_proj.weight", "k_proj.bias")):
            return w
        heads = hf["num_attention_heads"] if ".q_proj." in name else hf["num_key_value_heads"]
        # the converter did reshape(heads, 2, d).swapaxes(1, 2); this is its inverse
        return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
