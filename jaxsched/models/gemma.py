"""The Gemma family: Gemma (GemmaForCausalLM), Gemma 2 and Gemma 3's text model (Gemma2ForCausalLM,
Gemma3ForCausalLM). All are the pre-norm decoder of Llama with Gemma's own RMSNorm, which scales by
(1 + w) in float32, embeddings scaled by sqrt(D), a GeGLU MLP (gelu, tanh approximation), embeddings
tied to the lm_head by default and a free head_dim (256 in the released models). Optional q/k/v/o
biases (attention_bias). GGUF files of Gemma 2 and 3 load (llama.cpp's "gemma2", "gemma3"); of the
first Gemma, not.

Gemma 2 adds: norms after attention and around the MLP (ModelConfig.sandwich_norms), sliding-window
attention in every other layer (layer_types), the attention scale from query_pre_attn_scalar, and
tanh soft-capping of the attention scores and of the final logits. Gemma 3 has five sliding layers
for each global one, a rope base of their own for the sliding layers (rope_local_base_freq; the
global layers' rope may be scaled), q/k norms, and no soft-capping.

q/k/v and gate/up are fused into one matmul each, as in llama.py.

forward: (kv pool, batch) -> (logits f32[S, V] at batch.logits_indices, new kv pool)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsched.models.hf_config import decoder_config, rope_from_hf
from jaxsched.models.layers import (
    DecoderLayers,
    Put,
    decoder_layer_spec,
    hf_decoder_weights,
    linear,
    logits_weight,
    paged_attend,
    param,
    qkv_projection,
    rope_cos_sin,
    shards_of,
    split_gate_up,
    token_rows,
    vocab_logits,
)
from jaxsched.models.llama import GGUF_LAYER_NAMES, GGUF_TOP_NAMES
from jaxsched.models.model_config import ModelConfig


def _hidden_act(hf: dict[str, Any], key: str) -> None:
    act = hf.get(key) or "gelu_pytorch_tanh"
    # transformers reads the "gelu" of the original releases as the tanh approximation too
    if act not in ("gelu", "gelu_pytorch_tanh"):
        raise ValueError(f"Gemma {key} {act!r} is not supported; supported: gelu_pytorch_tanh")


def _causal(hf: dict[str, Any]) -> None:
    if hf.get("use_bidirectional_attention"):
        raise ValueError("Gemma with use_bidirectional_attention is an encoder, not a causal LM this engine runs")


def gemma_config(hf: dict[str, Any], architecture: str) -> ModelConfig:
    """GemmaConfig's own defaults where config.json leaves a key out."""
    _causal(hf)
    _hidden_act(hf, "hidden_act")
    # transformers' Gemma has no MLP biases whatever the config says (the forward has none either)
    return decoder_config(hf, architecture, mlp_bias=False, head_dim=int(hf.get("head_dim") or 256),
                          tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
                          max_position_embeddings=int(hf.get("max_position_embeddings", 8192)))


def _sliding_fields(hf: dict[str, Any], pattern: int) -> dict[str, Any]:
    """The window and the layers that use it: layer_types, or (older configs) every `pattern`-th
    layer global and the rest sliding, as transformers fills layer_types in."""
    L = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(L)]
    if len(types) != L or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must list 'sliding_attention' or 'full_attention' for each of the {L} layers, "
                         f"got {types!r}")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    window = int(hf.get("sliding_window") or 4096)
    if not sliding:
        return {"sliding_window": None, "sliding_layers": None}
    return {"sliding_window": window, "sliding_layers": None if len(sliding) == L else sliding}


def _softcap(hf: dict[str, Any], key: str, default: float | None) -> float | None:
    value = hf.get(key, default)
    return float(value) if value else None


def _sandwich_config(hf: dict[str, Any], architecture: str, **fields: Any) -> ModelConfig:
    """What Gemma 2 and Gemma 3 read alike."""
    _causal(hf)
    _hidden_act(hf, "hidden_activation")
    return decoder_config(hf, architecture, mlp_bias=False, head_dim=int(hf.get("head_dim") or 256),
                          tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)), sandwich_norms=True,
                          query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or 256), **fields)


def gemma2_config(hf: dict[str, Any], architecture: str) -> ModelConfig:
    """Gemma2Config's defaults: every other layer sliding (the first one), soft-capping at 50 and 30."""
    return _sandwich_config(hf, architecture, max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
                            attn_softcap=_softcap(hf, "attn_logit_softcapping", 50.0),
                            final_softcap=_softcap(hf, "final_logit_softcapping", 30.0), **_sliding_fields(hf, 2))


# Gemma3TextConfig's defaults for the keys a released config.json may leave out (the 4B model's
# text_config names only what differs from them)
_GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
                         "bos_token_id": 2, "eos_token_id": 1, "sliding_window": 4096}


def gemma3_config(hf: dict[str, Any], architecture: str) -> ModelConfig:
    """Gemma3TextConfig's defaults: five sliding layers for each global one, rope bases 10,000
    (sliding) and 1,000,000 (global), the global one's scaling as rope_scaling says. transformers 5
    writes the two ropes as rope_parameters keyed by layer type; older configs as rope_theta,
    rope_local_base_freq and rope_scaling."""
    hf = {**_GEMMA3_TEXT_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        theta, scaling = rope_from_hf({"rope_parameters": params.get("full_attention") or {"rope_theta": 1e6}})
        local = dict(params.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"Gemma 3's sliding layers with rope_type {local['rope_type']!r} are not supported: "
                             "their rope must be 'default'")
        local_theta = float(local.get("rope_theta", 10000.0))
    else:
        theta, scaling = rope_from_hf({"rope_theta": 1e6, **hf})
        local_theta = float(hf.get("rope_local_base_freq", 10000.0))
    return _sandwich_config(hf, architecture, rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta,
                            qk_norm=True, max_position_embeddings=int(hf.get("max_position_embeddings", 131072)),
                            attn_softcap=_softcap(hf, "attn_logit_softcapping", None),
                            final_softcap=_softcap(hf, "final_logit_softcapping", None),
                            **_sliding_fields(hf, int(hf.get("sliding_window_pattern") or 6)))


def gemma3_multimodal_config(hf: dict[str, Any], architecture: str) -> ModelConfig:
    """Gemma3ForConditionalGeneration (Gemma 3 4B to 27B): its text model alone, from text_config
    (images are not taken; the vision tower's weights are not read). The top level's eos_token_id
    (the end-of-turn token among them) wins over the text model's."""
    text = dict(hf.get("text_config") or {})
    if hf.get("eos_token_id") is not None:
        text["eos_token_id"] = hf["eos_token_id"]
    return gemma3_config(text, architecture)


def multimodal_tensor_names(name: str) -> tuple[str, ...]:
    """Where a Gemma3ForConditionalGeneration checkpoint holds the text model's tensor `name`: under
    language_model.model. (the released checkpoints) or model.language_model. (transformers 5)."""
    if name.startswith("model."):
        rest = name.removeprefix("model.")
        return f"language_model.model.{rest}", f"model.language_model.{rest}"
    return f"language_model.{name}", name


def gemma_gguf_meta(arch: str, meta: Callable[[str], Any], hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's and 3's config.json keys from a GGUF file's metadata (`meta(key)` reads
    "{arch}.{key}", None if absent); hf: the keys every file has. What llama.cpp fixes rather than
    writes is left to the config adapters' defaults (the sliding pattern, Gemma 3's local rope base
    10,000), except the attention scale: 1 / sqrt(head_dim), but 1 / sqrt(hidden / heads) in the 27B
    models (46 layers in Gemma 2, 62 in Gemma 3), which llama.cpp tells apart by their layer count."""
    out: dict[str, Any] = {}
    if (window := meta("attention.sliding_window")) is not None:
        out["sliding_window"] = int(window)
    pattern = meta("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # one flag a layer, as newer llama.cpp writes it
        out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif pattern:
        out["sliding_window_pattern"] = int(pattern)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if (value := meta(key)) is not None:
            out[key] = float(value)
    if (base := meta("rope.freq_base_swa")) is not None:
        out["rope_local_base_freq"] = float(base)
    big = hf["num_hidden_layers"] == {"gemma2": 46, "gemma3": 62}[arch]
    out["query_pre_attn_scalar"] = hf["hidden_size"] // hf["num_attention_heads"] if big else hf["head_dim"]
    return out


# llama.cpp's names of the norms Gemma 2 and 3 add (the others are llama.py's)
_GGUF_LAYER_NAMES = {**GGUF_LAYER_NAMES, "post_attention_layernorm.weight": "post_attention_norm.weight",
                     "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                     "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}


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

    def __call__(self, kv, batch, hidden: bool = False):
        """kv: (k_cache, v_cache) as AttentionBackend.pool_shapes gives them for this model's attention
        backend; batch: a BatchDescriptor of jax arrays."""
        cfg = self.cfg
        N, K, H, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        eps = cfg.rms_norm_eps
        shards = shards_of(self.mesh)

        def before(p, h):  # -> q [T, N, H], k, v [T, K, H]
            q, k, v = qkv_projection(p, gemma_rms_norm(h, p["input_norm"], eps), N, K, H, shards)
            if "q_norm" in p:  # Gemma 3
                q = gemma_rms_norm(q, p["q_norm"], eps)
                k = gemma_rms_norm(k, p["k_norm"], eps)
            return q, k, v

        def mlp(p, x):
            g, u = split_gate_up(linear(p, x, "gate_up"), shards)
            return linear(p, jax.nn.gelu(g, approximate=True) * u, "down")

        def after(p, h, o):  # o [T, N * H] -> the layer's output hidden state [T, D]
            a = linear(p, o, "o_proj", "o_bias")
            if not cfg.sandwich_norms:  # Gemma: post_norm is the MLP's input norm
                h = h + a
                return h + mlp(p, gemma_rms_norm(h, p["post_norm"], eps))
            h = h + gemma_rms_norm(a, p["post_norm"], eps)
            return h + gemma_rms_norm(mlp(p, gemma_rms_norm(h, p["pre_ff_norm"], eps)), p["post_ff_norm"], eps)

        # HF multiplies by sqrt(D) as a float32 scalar cast to the embeddings' dtype
        dt = self.norm[...].dtype  # the model's dtype (a quantized table's is not)
        h = token_rows(self, batch.token_ids, dt) * \
            jnp.asarray(D**0.5, jnp.float32).astype(dt)  # [T, D]
        cos, sin = rope_cos_sin(cfg, batch.positions)
        local_rope = None
        if cfg.rope_local_theta is not None:  # Gemma 3's sliding layers: their own base, unscaled
            local_rope = rope_cos_sin(dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None),
                                      batch.positions)
        attend = paged_attend(batch, self.attention_backend, cfg, cos, sin, kv[1].shape[3], self.mesh, local_rope)
        h, kv = self.layers(h, kv, before, after, attend, batch.logits_indices)  # h [S, D]
        # The lm_head runs only where a token is sampled: S rows, not T. hidden: the rows' last
        # hidden states instead, for head() to take in chunks (prompt logprobs: model_runner.py)
        return (h if hidden else self.head(h)), kv

    def head(self, h):
        """Logits f32[R, V] of last hidden states h [R, D]: the final norm and the lm_head (the tied
        head is the unscaled embedding), soft-capped for Gemma 2."""
        cfg = self.cfg
        hs = gemma_rms_norm(h, self.norm[...], cfg.rms_norm_eps)
        w, scale = logits_weight(self)
        logits = vocab_logits(hs, w, self.mesh, scale)
        if cfg.final_softcap is not None:  # Gemma 2
            logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
        return logits

    @classmethod
    def hf_weights(cls, cfg: ModelConfig, get: Callable[[str], np.ndarray], put: Put, layout: str,
                   shards: int = 1) -> dict[str, Any]:
        """HF-named tensors (`get`) -> this model's pure state dict with layers in `layout`, each
        tensor placed by `put` (layers.Put), fused columns grouped for `shards` devices. Norm weights
        stay as HF holds them (w of 1 + w)."""
        return hf_decoder_weights(cfg, get, put, layout, shards)

    @staticmethod
    def gguf_name(name: str) -> tuple[str, None]:
        """llama.cpp's name of the HF-named tensor `name` (Gemma 2 and 3; no experts)."""
        if not name.startswith("model.layers."):
            return GGUF_TOP_NAMES[name], None
        _, _, i, rest = name.split(".", 3)
        return f"blk.{i}.{_GGUF_LAYER_NAMES[rest]}", None

    @staticmethod
    def from_gguf(hf: dict[str, Any], name: str, w: np.ndarray) -> np.ndarray:
        """llama.cpp's converter stores Gemma's norm weights as 1 + w (its RMSNorm multiplies by the
        weight alone): back to w."""
        return w - 1.0 if name.endswith("norm.weight") else w
