"""ModelConfig: a decoder's architecture, as every model file, the mesh layout and the engine read it.
Plain Python: importable without jax."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's architecture, read from a Hugging Face config.json (or GGUF metadata)."""

    architecture: str  # HF name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] | None  # HF's rope_scaling dict as sorted items (hashable)
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2; Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rope
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mistral's (and Qwen2's, when use_sliding_window): every layer reads its last sliding_window
    # positions only; None where the context never exceeds it (config.resolve drops it)
    sliding_window: int | None = None
    # the layers that use sliding_window, where only some do (Gemma 2: every other, Gemma 3: five in
    # six); None: all of them. The others attend to the whole context.
    sliding_layers: tuple[int, ...] | None = None
    # Gemma 3: the sliding layers' own rope base (their rope unscaled); None: one rope for every layer
    rope_local_theta: float | None = None
    # attention scale query_pre_attn_scalar ** -0.5 (Gemma 2, 3); None: head_dim ** -0.5
    query_pre_attn_scalar: float | None = None
    # Gemma 2's soft-capping, cap * tanh(x / cap): of the attention scores and of the final logits
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # Gemma 2, 3: the attention output normed before the residual (post_attention_layernorm) and the
    # MLP between norms of its own (pre_ / post_feedforward_layernorm)
    sandwich_norms: bool = False
    dtype: str = "float32"  # the checkpoint's dtype
    # "fp8": a pre-quantized checkpoint whose linear weights are stored in fp8 with scales
    # (loader.prequantized); the engine keeps them in 8 bits unless told otherwise (config.resolve)
    quantized_checkpoint: str | None = None
    # a GGUF file whose linear weights are block-quantized (Q4_1, Q8_0, K-quants, ...): int8 keeps
    # them in groups of 32 inputs, as the blocks were (models/quantize.py, quantize_grouped)
    gguf_blocks: bool = False
    # mixture of experts (models/moe.py): E experts of intermediate size moe_intermediate_size in every
    # layer's MLP, k of them per token; 0 experts: a dense MLP of intermediate_size
    num_experts: int = 0  # E
    num_experts_per_tok: int = 0  # k
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the k routing weights renormalised to sum 1
    # Qwen2-MoE: a dense MLP of this width beside the experts, every token through it, scaled by a
    # sigmoid gate of its own; 0: none
    shared_expert_intermediate_size: int = 0

    @property
    def layer_params(self) -> int:
        """Weights every token goes through in the decoder layers (the q, k, v, o projections and the
        MLP's three matrices, of its k experts and the router in an MoE layer; norms and biases left
        out): a token costs twice that in FLOPs, plus the lm_head's vocab_size * hidden_size for each
        token sampled."""
        D, N, K, H = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        mlp = 3 * D * self.intermediate_size
        if self.num_experts:
            mlp = (self.num_experts_per_tok * 3 * D * self.moe_intermediate_size + D * self.num_experts
                   + 3 * D * self.shared_expert_intermediate_size)
        return self.num_layers * (D * (N + 2 * K) * H + N * H * D + mlp)

    @property
    def active_intermediate_size(self) -> int:
        """The MLP width a token goes through: its k experts' in an MoE layer."""
        if self.num_experts:
            return self.num_experts_per_tok * self.moe_intermediate_size + self.shared_expert_intermediate_size
        return self.intermediate_size

    @property
    def mlp_weights(self) -> int:
        """One layer's MLP weights, all experts and the router counted (memory, not work)."""
        if self.num_experts:
            return (self.num_experts * self.moe_intermediate_size + self.shared_expert_intermediate_size) \
                * 3 * self.hidden_size + self.hidden_size * self.num_experts
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def token_flops(self) -> int:
        """FLOPs of one token through the weights, the lm_head included (attention over the context
        left out): what recomputing a token, or sampling one, costs in matmuls."""
        return 2 * (self.layer_params + self.vocab_size * self.hidden_size)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window layer `layer` reads, or None for the whole context."""
        if self.sliding_layers is not None and layer not in self.sliding_layers:
            return None
        return self.sliding_window

    @property
    def sm_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})"
            )
