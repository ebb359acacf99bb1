"""Reading a Hugging Face config.json (as a dict) into a ModelConfig: the keys every decoder spells
the same way. An architecture's config adapter (in its model file) calls `decoder_config` and sets
or overrides what its family reads differently."""

from __future__ import annotations

from typing import Any

from jaxsched.models.model_config import ModelConfig


def rope_from_hf(hf: dict[str, Any]) -> tuple[float, tuple | None]:
    """rope_theta and scaling from either transformers 5's rope_parameters or the older keys."""
    params = dict(hf.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = params or dict(hf.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    return theta, tuple(sorted(scaling.items()))


def decoder_config(hf: dict[str, Any], architecture: str, **fields: Any) -> ModelConfig:
    """ModelConfig of `architecture` from config.json keys; `fields` (ModelConfig fields) set or
    override what the keys give."""
    n_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    theta, scaling = rope_from_hf(hf)
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    window = hf.get("sliding_window")
    attention_bias = bool(hf.get("attention_bias", False))
    read = {
        "architecture": architecture,
        "vocab_size": int(hf["vocab_size"]),
        "hidden_size": hidden,
        "intermediate_size": int(hf["intermediate_size"]),
        "num_layers": int(hf["num_hidden_layers"]),
        "num_heads": n_heads,
        "num_kv_heads": int(hf.get("num_key_value_heads") or n_heads),
        "head_dim": int(hf.get("head_dim") or hidden // n_heads),
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": int(hf.get("max_position_embeddings", 2048)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qkv_bias": attention_bias,
        "o_bias": attention_bias,
        "mlp_bias": bool(hf.get("mlp_bias", False)),
        "bos_token_id": hf.get("bos_token_id"),
        "eos_token_ids": eos_ids,
        "sliding_window": int(window) if window else None,
        "dtype": str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
    }
    return ModelConfig(**{**read, **fields})
