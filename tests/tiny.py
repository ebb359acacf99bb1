"""Tiny test fixtures built from public libraries: a BPE tokenizer trained with `tokenizers`, and
random Llama / Mistral / Qwen2 / Qwen3 / Gemma (1, 2, 3) / MoE checkpoints: transformers' config classes for config.json, the
weights drawn in numpy under Hugging Face's tensor names and saved with safetensors. Nothing here
needs torch; tests that compare with transformers' PyTorch models carry `needs_torch`."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

# torch (the `parity` extra) is only the ground truth of parity tests. Found without importing it:
# importing torch costs seconds that tests which never touch it should not pay.
HAVE_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(
    not HAVE_TORCH, reason="needs torch (pip install -e '.[parity]'): compares with transformers' PyTorch models")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "the capital of france is paris . what is a cat ? dogs and cats like to play in the sun . "
    "one two three four five six seven eight nine ten . hello world , how are you today ? "
    "language models predict the next token from the previous tokens . jax runs on gpus and cpus . "
    "é ü ñ 你好 世界 emoji 🙂 numbers 12345 67890 punctuation ! ? ; : ' \" ( ) [ ] { } - _ = + * / "
)


def build_tokenizer(folder: str, added_tokens: tuple[str, ...] = ()):
    """Train a byte-level BPE (vocab ~300) and save it as a fast tokenizer with a chat template;
    `added_tokens` (such as a reasoning model's "<think>") are tokens of their own, not special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_WORDS] * 50, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.add_tokens(list(added_tokens))
    os.makedirs(folder, exist_ok=True)
    fast.save_pretrained(folder)
    return fast


def build_sentencepiece_tokenizer(folder: str):
    """A Llama-2-style fast tokenizer (vocab ~400): BPE over "▁"-joined words with the 256 byte
    tokens <0x00>..<0xFF> as fallback, and SentencePiece's decoder (▁ to space, bytes fused, the
    first space stripped); saved like build_tokenizer's."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    special = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special + [f"<0x{b:02X}>" for b in range(256)],
                                  show_progress=False)
    tok.train_from_iterator([_WORDS.replace(" ", "▁")] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(folder, exist_ok=True)
    fast.save_pretrained(folder)
    return fast


def hf_config(kind: str, vocab_size: int, **overrides):
    """A tiny transformers config of one architecture family, float32."""
    import transformers as tf

    common = {"vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
                  "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False}
    if kind == "llama":
        cfg = tf.LlamaConfig(**{**common, "num_key_value_heads": 4}, rope_theta=10000.0)
    elif kind == "llama3":  # Llama 3 rope scaling, tied embeddings
        cfg = tf.LlamaConfig(**{**common, "tie_word_embeddings": True}, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}, rope_theta=500000.0)
    elif kind == "mistral":  # GQA 4:1
        cfg = tf.MistralConfig(**{**common, "num_key_value_heads": 1}, sliding_window=None)
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**common)
    elif kind == "qwen3":  # q/k norm, head_dim != hidden / heads
        cfg = tf.Qwen3Config(**common, head_dim=32)
    elif kind == "qwen3_moe":  # every layer 8 experts, 2 a token, renormalised
        cfg = tf.Qwen3MoeConfig(**common, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    elif kind == "qwen2_moe":  # q/k/v biases, 8 experts, 2 a token, not renormalised, a gated shared expert
        cfg = tf.Qwen2MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=1,
                                mlp_only_layers=[])
    elif kind == "mixtral":  # 4 experts of intermediate_size, 2 a token
        cfg = tf.MixtralConfig(**{**common, "intermediate_size": 48}, num_local_experts=4, num_experts_per_tok=2,
                               sliding_window=None)
    elif kind == "gemma":  # tied embeddings (Gemma's default), head_dim != hidden / heads
        # larger weights put the GeGLU's inputs where gelu's tanh approximation and the exact gelu
        # differ by more than the parity tests' 1e-4 (at 0.02 they would not tell them apart)
        cfg = tf.GemmaConfig(**{**common, "tie_word_embeddings": True}, head_dim=32, initializer_range=0.05)
    elif kind == "gemma2":  # a sliding layer then a global one, windows of 8 tokens, soft-capping low
        # enough to count at these weights, query_pre_attn_scalar apart from head_dim
        cfg = tf.Gemma2Config(**{**common, "tie_word_embeddings": True}, head_dim=32, initializer_range=0.05,
                              sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                              final_logit_softcapping=3.0)
    elif kind == "gemma3":  # sliding, sliding, global: windows of 8 tokens, rope 10k local, 1M x 8 global
        cfg = tf.Gemma3TextConfig(**{**common, "tie_word_embeddings": True, "num_hidden_layers": 3}, head_dim=32,
                                  initializer_range=0.05, sliding_window=8, query_pre_attn_scalar=24,
                                  layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                   "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                      "rope_theta": 1000000.0}})
    else:
        raise ValueError(kind)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


# Transformers draws 2-D weights from N(0, initializer_range) (0.02), which gives near-uniform logits;
# they are scaled by this so greedy tokens are decided by clear margins rather than 1e-7 ties that
# float reordering could flip.
SHARPEN = 4.0
GEMMA_NORM_STD = 0.3


def random_weights(cfg, seed: int = 0, bias_std: float = 0.0) -> dict[str, np.ndarray]:
    """Float32 weights of `cfg`'s architecture under Hugging Face's tensor names: 2-D weights from
    N(0, initializer_range * SHARPEN) with the padding token's embedding row zero, norms ones, biases
    zero as transformers initialises them (or N(0, bias_std) when a test needs them to count).
    Gemma's norms scale by (1 + w) and start at w = 0; here w is drawn from N(0, GEMMA_NORM_STD) so
    that the (1 + w) and the per-channel scales count."""
    rng = np.random.default_rng(seed)
    arch = cfg.model_type
    if arch not in ARCHITECTURES:
        raise ValueError(f"no weight layout for model_type {arch!r}")
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    N = cfg.num_attention_heads
    K = cfg.num_key_value_heads or N
    H = getattr(cfg, "head_dim", None) or D // N
    gemma = arch in ("gemma", "gemma2", "gemma3_text")
    attention_bias = bool(getattr(cfg, "attention_bias", False)) and (arch in ("llama", "qwen3") or gemma)
    qkv_bias = arch in ("qwen2", "qwen2_moe") or attention_bias  # Qwen2: q/k/v biases always, o never
    mlp_bias = bool(getattr(cfg, "mlp_bias", False)) and arch == "llama"

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * (cfg.initializer_range * SHARPEN)).astype(np.float32)

    def bias(n: int) -> np.ndarray:
        return (rng.standard_normal(n) * bias_std).astype(np.float32)

    def norm_weight(n: int) -> np.ndarray:
        if gemma:
            return (rng.standard_normal(n) * GEMMA_NORM_STD).astype(np.float32)
        return np.ones(n, np.float32)

    w = {"model.embed_tokens.weight": matrix(V, D)}
    if cfg.pad_token_id is not None:  # nn.Embedding(padding_idx=pad) starts that row at zero
        w["model.embed_tokens.weight"][cfg.pad_token_id] = 0.0
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight(D)
        w[p + "post_attention_layernorm.weight"] = norm_weight(D)
        if arch in ("gemma2", "gemma3_text"):  # the MLP between norms of its own
            w[p + "pre_feedforward_layernorm.weight"] = norm_weight(D)
            w[p + "post_feedforward_layernorm.weight"] = norm_weight(D)
        for name, rows, cols, has_bias in (("q_proj", N * H, D, qkv_bias), ("k_proj", K * H, D, qkv_bias),
                                           ("v_proj", K * H, D, qkv_bias), ("o_proj", D, N * H, attention_bias)):
            w[p + f"self_attn.{name}.weight"] = matrix(rows, cols)
            if has_bias:
                w[p + f"self_attn.{name}.bias"] = bias(rows)
        if arch in ("qwen3", "qwen3_moe", "gemma3_text"):
            w[p + "self_attn.q_norm.weight"] = norm_weight(H)
            w[p + "self_attn.k_norm.weight"] = norm_weight(H)
        if arch in MOE_NAMES:
            router, gate, up, down = MOE_NAMES[arch]
            E = getattr(cfg, "num_experts", None) or cfg.num_local_experts
            Fe = cfg.moe_intermediate_size if arch != "mixtral" else F
            # routers with clear margins: top-k picks no expert by a float rounding's difference
            w[p + router + ".weight"] = matrix(E, D) * ROUTER_SHARPEN
            for j in range(E):
                for name, rows, cols in ((gate, Fe, D), (up, Fe, D), (down, D, Fe)):
                    w[p + name.format(j=j) + ".weight"] = matrix(rows, cols)
            if Fs := getattr(cfg, "shared_expert_intermediate_size", 0):
                for name, rows, cols in (("gate_proj", Fs, D), ("up_proj", Fs, D), ("down_proj", D, Fs)):
                    w[p + f"mlp.shared_expert.{name}.weight"] = matrix(rows, cols)
                w[p + "mlp.shared_expert_gate.weight"] = matrix(1, D) * ROUTER_SHARPEN
            continue
        for name, rows, cols in (("gate_proj", F, D), ("up_proj", F, D), ("down_proj", D, F)):
            w[p + f"mlp.{name}.weight"] = matrix(rows, cols)
            if mlp_bias:
                w[p + f"mlp.{name}.bias"] = bias(rows)
    w["model.norm.weight"] = norm_weight(D)
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = matrix(V, D)
    return w


# model_type -> the HF architecture name its checkpoints are saved as
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "qwen2_moe": "Qwen2MoeForCausalLM", "gemma2": "Gemma2ForCausalLM",
                  "gemma3_text": "Gemma3ForCausalLM",
                  "mixtral": "MixtralForCausalLM"}
# an MoE model_type's layer tensors as checkpoints name them (the router, each expert's gate, up, down)
MOE_NAMES = {"qwen2_moe": ("mlp.gate", "mlp.experts.{j}.gate_proj", "mlp.experts.{j}.up_proj",
                           "mlp.experts.{j}.down_proj"),
             "qwen3_moe": ("mlp.gate", "mlp.experts.{j}.gate_proj", "mlp.experts.{j}.up_proj",
                           "mlp.experts.{j}.down_proj"),
             "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts.{j}.w1", "block_sparse_moe.experts.{j}.w3",
                         "block_sparse_moe.experts.{j}.w2")}
ROUTER_SHARPEN = 10.0


def build_model(folder: str, kind: str, tokenizer_folder: str, seed: int = 0, *, bias_std: float = 0.0,
                **overrides) -> str:
    """Save a random checkpoint of `kind` as a Hugging Face folder (config.json, generation_config.json,
    model.safetensors) plus the tiny tokenizer into `folder`, without torch. `overrides` are config
    attributes (num_hidden_layers=1, attention_bias=True, vocab_size=320 for a table larger than the
    tokenizer, ...); `bias_std` > 0 gives the biases values."""
    import transformers as tf
    from safetensors.numpy import save_file
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_folder)
    cfg = hf_config(kind, vocab_size=overrides.pop("vocab_size", len(tok)), **overrides)
    cfg.architectures = [ARCHITECTURES[cfg.model_type]]
    cfg.dtype = "float32"
    os.makedirs(folder, exist_ok=True)
    cfg.save_pretrained(folder)
    with open(os.path.join(folder, "config.json")) as f:
        written = json.load(f)
    assert written["architectures"] == cfg.architectures and written["dtype"] == "float32", written
    tf.GenerationConfig.from_model_config(cfg).save_pretrained(folder)
    save_file(random_weights(cfg, seed, bias_std), os.path.join(folder, "model.safetensors"),
              metadata={"format": "pt"})
    tok.save_pretrained(folder)
    return folder
