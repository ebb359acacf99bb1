"""Architecture registry: a Hugging Face config.json (as a dict) -> ModelConfig + model class."""

from __future__ import annotations

from typing import Any

from jaxsched.config import ModelConfig
from jaxsched.models.llama import LlamaForCausalLM

# HF `architectures` name -> (model class, q/k/v bias, q/k norm). All share the Llama decoder.
_ARCHS: dict[str, tuple[type, bool, bool]] = {
    "LlamaForCausalLM": (LlamaForCausalLM, False, False),
    "MistralForCausalLM": (LlamaForCausalLM, False, False),
    "Qwen2ForCausalLM": (LlamaForCausalLM, True, False),
    "Qwen3ForCausalLM": (LlamaForCausalLM, False, True),
}
SUPPORTED_ARCHITECTURES = tuple(_ARCHS)


def model_class(architecture: str) -> type:
    return _ARCHS[architecture][0]


def _rope(hf: dict[str, Any]) -> tuple[float, tuple | None]:
    """rope_theta and scaling from either transformers 5's rope_parameters or the older keys."""
    params = dict(hf.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = params or dict(hf.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    return theta, tuple(sorted(scaling.items()))


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Read a config.json dict. Raises ValueError for an architecture this engine does not run."""
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in _ARCHS), None)
    if arch is None:
        raise ValueError(
            f"unknown architecture {archs or hf.get('model_type')!r} in config.json; supported "
            f"architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    _, qkv_bias, qk_norm = _ARCHS[arch]
    attention_bias = bool(hf.get("attention_bias", False))
    n_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    theta, scaling = _rope(hf)
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    window = hf.get("sliding_window")
    if arch.startswith("Qwen") and not hf.get("use_sliding_window", False):
        window = None  # Qwen configs carry a window size they do not use
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return ModelConfig(
        architecture=arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=n_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=int(hf.get("head_dim") or hidden // n_heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias or attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=qk_norm,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        sliding_window=int(window) if window else None,
        dtype=str(dtype),
    )
