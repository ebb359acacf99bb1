"""Tiny test fixtures built from public libraries: a BPE tokenizer trained with `tokenizers`, and
random Llama / Mistral / Qwen2 / Qwen3 checkpoints built with transformers' config classes."""

from __future__ import annotations

import os

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


def build_tokenizer(folder: str):
    """Train a byte-level BPE (vocab ~300) and save it as a fast tokenizer with a chat template."""
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
    else:
        raise ValueError(kind)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def build_model(folder: str, kind: str, tokenizer_folder: str, seed: int = 0, **overrides) -> str:
    """Save a random transformers model (safetensors) plus the tiny tokenizer into `folder`."""
    import torch
    import transformers as tf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_folder)
    cfg = hf_config(kind, vocab_size=len(tok), **overrides)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Random init gives near-uniform logits; sharpen them so greedy tokens are decided by clear
    # margins rather than 1e-7 ties that float reordering could flip.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder
