"""The Llama family: Llama (incl. Llama 3 rope scaling), Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k
RMSNorm, free head_dim), GQA, tied or untied embeddings, and their mixture-of-experts members,
Qwen2-MoE (with a gated shared expert), Qwen3-MoE and Mixtral (models/moe.py: every layer's MLP a
set of experts). One model class; the
members differ only in how their config.json reads (the adapters below, one registry entry each), in
their experts' tensor names and in GGUF names.

q/k/v and gate/up are fused into one matmul each (fewer, larger dots run faster on every backend).

forward: (kv pool, batch) -> (logits f32[S, V] at batch.logits_indices, new kv pool)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsched import platforms
from jaxsched.models.hf_config import decoder_config
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
    rms_norm,
    rope_cos_sin,
    shards_of,
    silu_gate_up,
    token_rows,
    vocab_logits,
)
from jaxsched.models.model_config import ModelConfig
from jaxsched.models.moe import moe_mlp


# -- config adapters (config.json dict -> ModelConfig), one per registry entry ----------------------
def llama_config(hf: dict[str, Any], architecture: str) -> ModelConfig:
    """Llama and Mistral."""
    return decoder_config(hf, architecture)


def _qwen_window(hf: dict[str, Any]) -> int | None:
    """Qwen configs carry a window size they use only with use_sliding_window, and then in the
    layers from max_window_layers on (transformers' rule): all of them, or none."""
    window = hf.get("sliding_window")
    if not window or not hf.get("use_sliding_window", False):
        return None
    L, first = int(hf["num_hidden_layers"]), int(hf.get("max_window_layers", 0) or 0)
    if first >= L:
        return None
    if first > 0:
        raise ValueError(f"a sliding window in layers {first} to {L - 1} only (max_window_layers) is not supported: "
                         "every layer or none must use it")
    return int(window)


def qwen2_config(hf: dict[str, Any], architecture: str) -> ModelConfig:
    """Qwen2: q/k/v biases always."""
    return decoder_config(hf, architecture, qkv_bias=True, sliding_window=_qwen_window(hf))


def qwen3_config(hf: dict[str, Any], architecture: str) -> ModelConfig:
    """Qwen3: RMSNorm over head_dim on q and k before rope."""
    return decoder_config(hf, architecture, qk_norm=True, sliding_window=_qwen_window(hf))


def _moe_fields(hf: dict[str, Any], experts: int, size: int, normalize: bool) -> dict[str, Any]:
    k = int(hf["num_experts_per_tok"])
    if not 0 < k <= experts:
        raise ValueError(f"num_experts_per_tok ({k}) must be in [1, {experts}] (the number of experts)")
    return {"num_experts": experts, "num_experts_per_tok": k, "moe_intermediate_size": size,
            "norm_topk_prob": normalize}


def _qwen_moe_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """Qwen2-MoE's and Qwen3-MoE's expert keys; a layout mixing dense and MoE layers is refused."""
    L = int(hf["num_hidden_layers"])
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense = set(hf.get("mlp_only_layers") or ()) | {i for i in range(L) if (i + 1) % step}
    if dense:
        raise ValueError(f"{family} with dense MLP layers ({sorted(dense)}: mlp_only_layers / decoder_sparse_step) "
                         "is not supported: every layer must be an MoE layer, as in the released models")
    # transformers 5 writes num_experts as num_local_experts
    return _moe_fields(hf, int(hf.get("num_experts") or hf["num_local_experts"]), int(hf["moe_intermediate_size"]),
                       bool(hf.get("norm_topk_prob", False)))


def qwen3_moe_config(hf: dict[str, Any], architecture: str) -> ModelConfig:
    """Qwen3-MoE: Qwen3's attention, every layer's MLP a mixture of experts."""
    return decoder_config(hf, architecture, qk_norm=True, sliding_window=_qwen_window(hf),
                          **_qwen_moe_fields(hf, "Qwen3-MoE"))


def qwen2_moe_config(hf: dict[str, Any], architecture: str) -> ModelConfig:
    """Qwen2-MoE: Qwen2's attention (q/k/v biases), experts plus a gated shared expert every layer."""
    return decoder_config(hf, architecture, qkv_bias=True, sliding_window=_qwen_window(hf),
                          shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
                          **_qwen_moe_fields(hf, "Qwen2-MoE"))


def mixtral_config(hf: dict[str, Any], architecture: str) -> ModelConfig:
    """Mixtral: Mistral's attention, every layer's MLP num_local_experts experts of intermediate_size,
    the top-k weights renormalised (its softmax over the top-k logits)."""
    # a GGUF file's metadata (loader.gguf_config) may name the experts' size apart
    size = int(hf.get("moe_intermediate_size") or hf["intermediate_size"])
    return decoder_config(hf, architecture, **_moe_fields(hf, int(hf["num_local_experts"]), size, True))


# an MoE architecture's layer weights under model.layers.{i}.: the router, each expert's gate, up, down
MOE_NAMES = {
    "Qwen2MoeForCausalLM": ("mlp.gate", "mlp.experts.{j}.gate_proj", "mlp.experts.{j}.up_proj",
                            "mlp.experts.{j}.down_proj"),
    "Qwen3MoeForCausalLM": ("mlp.gate", "mlp.experts.{j}.gate_proj", "mlp.experts.{j}.up_proj",
                            "mlp.experts.{j}.down_proj"),
    "MixtralForCausalLM": ("block_sparse_moe.gate", "block_sparse_moe.experts.{j}.w1",
                           "block_sparse_moe.experts.{j}.w3", "block_sparse_moe.experts.{j}.w2"),
}


# -- GGUF (llama.cpp's names) ---------------------------------------------------------------------
# HF name suffix (per layer) -> GGUF name suffix (gemma.py adds its own norms' names)
GGUF_LAYER_NAMES = {
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
    "mlp.gate.weight": "ffn_gate_inp.weight",  # an MoE layer's router (Qwen3-MoE, Mixtral)
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",  # Qwen2-MoE's shared expert
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
}
# an MoE layer's experts (MOE_NAMES): each expert's projections are slices of stacked tensors
_GGUF_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_GGUF_EXPERT_NAMES = {"gate_proj": "ffn_gate_exps.weight", "w1": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight",
                      "w3": "ffn_up_exps.weight", "down_proj": "ffn_down_exps.weight", "w2": "ffn_down_exps.weight"}
GGUF_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}
# llama.cpp's converter permutes the rows of q/k of these for its rope layout (not Qwen's)
_GGUF_ROPE_PERMUTED = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM")


class LlamaForCausalLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype: str = "float32", *, rngs: nnx.Rngs,
                 attention_backend: str = "xla", layer_weights: str | None = None, mesh=None):
        """layer_weights: "stacked", "per_layer" or "unrolled" (layers.py); None picks the platform record's layer_weights for
        the platform. mesh: the engine's ("data", "model") mesh when it runs on several devices
        (parallel.py); cfg then has the head counts of the run layout (parallel.HeadLayout)."""
        self.cfg = cfg
        self.attention_backend = attention_backend
        self.mesh = mesh
        # an MoE layer's grouped matmul (models/moe.py), as the platform record says
        self.grouped_matmul = platforms.of((jax.devices()[0] if mesh is None else mesh.devices.flat[0]).platform
                                           ).grouped_matmul
        jdt = jnp.dtype(dtype)
        V, D = cfg.vocab_size, cfg.hidden_size
        self.embed = param(rngs, (V, D), jdt)
        self.layers = DecoderLayers(decoder_layer_spec(cfg), cfg.num_layers, jdt, rngs, layer_weights)
        self.norm = param(rngs, (D,), jdt, 1.0)
        self.lm_head = None if cfg.tie_word_embeddings else param(rngs, (D, V), jdt)

    def __call__(self, kv, batch, hidden: bool = False):
        """kv: (k_cache, v_cache) as AttentionBackend.pool_shapes gives them for this model's attention
        backend (f[L, NB, K, P, H], K pages [H, P] for "xla"); batch: a BatchDescriptor of jax arrays."""
        cfg = self.cfg
        N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        shards = shards_of(self.mesh)

        def before(p, h):  # -> q [T, N, H], k, v [T, K, H]
            q, k, v = qkv_projection(p, rms_norm(h, p["input_norm"], eps), N, K, H, shards)
            if "q_norm" in p:
                q = rms_norm(q, p["q_norm"], eps)
                k = rms_norm(k, p["k_norm"], eps)
            return q, k, v

        def after(p, h, o):  # o [T, N * H] -> the layer's output hidden state [T, D]
            h = h + linear(p, o, "o_proj", "o_bias")
            return h + self.mlp(p, rms_norm(h, p["post_norm"], eps))

        cos, sin = rope_cos_sin(cfg, batch.positions)
        attend = paged_attend(batch, self.attention_backend, cfg, cos, sin, kv[1].shape[3], self.mesh)
        h = token_rows(self, batch.token_ids, self.norm[...].dtype)
        h, kv = self.layers(h, kv, before, after, attend, batch.logits_indices)  # h [S, D]
        # The lm_head runs only where a token is sampled: S rows, not T. hidden: the rows' last
        # hidden states instead, for head() to take in chunks (prompt logprobs: model_runner.py)
        return (h if hidden else self.head(h)), kv

    def head(self, h):
        """Logits f32[R, V] of last hidden states h [R, D]: the final norm and the lm_head."""
        hs = rms_norm(h, self.norm[...], self.cfg.rms_norm_eps)
        w, scale = logits_weight(self)
        return vocab_logits(hs, w, self.mesh, scale)

    def mlp(self, p: dict, x):
        """The layer's MLP on x [T, D] (normed): silu(gate) * up, then down; or its mixture of experts."""
        cfg = self.cfg
        if cfg.num_experts:
            return moe_mlp(p, x, cfg.num_experts_per_tok, cfg.norm_topk_prob, self.grouped_matmul, self.mesh)
        return linear(p, silu_gate_up(p, x, shards_of(self.mesh)), "down", "down_bias")

    @classmethod
    def hf_weights(cls, cfg: ModelConfig, get: Callable[[str], np.ndarray], put: Put, layout: str,
                   shards: int = 1) -> dict[str, Any]:
        """HF-named tensors (`get`) -> this model's pure state dict with layers in `layout`, each
        tensor placed by `put` (layers.Put), fused columns grouped for `shards` devices."""
        return hf_decoder_weights(cfg, get, put, layout, shards, MOE_NAMES.get(cfg.architecture))

    @staticmethod
    def gguf_name(name: str) -> tuple[str, int | None]:
        """llama.cpp's name of the HF-named tensor `name`, and for an expert's projection its index in
        llama.cpp's stacked [E, ...] tensor (else None)."""
        if not name.startswith("model.layers."):
            return GGUF_TOP_NAMES[name], None
        _, _, i, rest = name.split(".", 3)
        if m := _GGUF_EXPERT.fullmatch(rest):
            return f"blk.{i}.{_GGUF_EXPERT_NAMES[m.group(2)]}", int(m.group(1))
        return f"blk.{i}.{GGUF_LAYER_NAMES[rest]}", None

    @staticmethod
    def from_gguf(hf: dict[str, Any], name: str, w: np.ndarray) -> np.ndarray:
        """Tensor `name` as read from a GGUF file (float32) -> as HF holds it: q/k rows un-permuted.
        hf: the file's metadata as a config.json dict (loader.gguf_config)."""
        if name.endswith("shared_expert_gate.weight"):  # llama.cpp holds it as [D], HF as [1, D]
            return w.reshape(1, -1)
        if hf["architectures"][0] not in _GGUF_ROPE_PERMUTED or not name.endswith(("q_proj.weight", "q_proj.bias",
                                                                           "k_proj.weight", "k_proj.bias")):
            return w
        heads = hf["num_attention_heads"] if ".q_proj." in name else hf["num_key_value_heads"]
        # the converter did reshape(heads, 2, d).swapaxes(1, 2); this is its inverse
        return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
