"""Architecture registry: a Hugging Face `architectures` name -> how its config.json reads and which
model class runs it. Adding an architecture is one model file in this folder and one line here.

A model class is constructed as cls(cfg, dtype, *, rngs, attention_backend="xla", layer_weights=None),
holds its layers as `.layers` (layers.DecoderLayers), is called as model(kv, batch) -> (logits
f32[S, V], kv), and loads through the classmethod cls.hf_weights(cfg, get, put, layout, shards) -> its
pure state dict from HF-named tensors, each placed on the devices by put(name, array) (layers.Put).
Those that load from GGUF files also give gguf_name(name) (llama.cpp's tensor name, and for an
expert's slice of a stacked tensor its index) and from_gguf(hf, name, w) (the tensor as HF holds it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxsched.models.gemma import (
    GemmaForCausalLM,
    gemma2_config,
    gemma3_config,
    gemma3_multimodal_config,
    gemma_config,
    gemma_gguf_meta,
    multimodal_tensor_names,
)
from jaxsched.models.llama import (
    LlamaForCausalLM,
    llama_config,
    mixtral_config,
    qwen2_config,
    qwen2_moe_config,
    qwen3_config,
    qwen3_moe_config,
)
from jaxsched.models.model_config import ModelConfig


@dataclass(frozen=True)
class Architecture:
    config: Callable[[dict[str, Any], str], ModelConfig]  # (config.json dict, architecture name) -> ModelConfig
    model: type
    gguf: str | None = None  # llama.cpp's general.architecture of its GGUF files; None: GGUF does not load
    moe: bool = False  # its layers are mixtures of experts (a GGUF file of llama.cpp's "llama" with experts)
    # config.json keys that llama.cpp fixes for this architecture rather than writing them in a GGUF
    # file's metadata (Qwen3-MoE's routing weights renormalised, Qwen2-MoE's not)
    gguf_defaults: tuple[tuple[str, Any], ...] = ()
    # (llama.cpp's architecture, meta(key) of "{arch}.{key}", the keys read so far) -> config.json keys
    # of the architecture's own GGUF metadata (Gemma's windows and soft-capping)
    gguf_meta: Callable[[str, Callable[[str], Any], dict[str, Any]], dict[str, Any]] | None = None
    # a tensor's name as the model class asks for it -> the names a checkpoint may hold it under
    # (a multimodal checkpoint's text model); None: the name itself
    checkpoint_names: Callable[[str], tuple[str, ...]] | None = None


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(llama_config, LlamaForCausalLM, gguf="llama"),
    "MistralForCausalLM": Architecture(llama_config, LlamaForCausalLM, gguf="mistral"),
    "Qwen2ForCausalLM": Architecture(qwen2_config, LlamaForCausalLM, gguf="qwen2"),
    "Qwen3ForCausalLM": Architecture(qwen3_config, LlamaForCausalLM, gguf="qwen3"),
    "Qwen2MoeForCausalLM": Architecture(qwen2_moe_config, LlamaForCausalLM, gguf="qwen2moe", moe=True,
                                        gguf_defaults=(("norm_topk_prob", False),)),
    "Qwen3MoeForCausalLM": Architecture(qwen3_moe_config, LlamaForCausalLM, gguf="qwen3moe", moe=True,
                                        gguf_defaults=(("norm_topk_prob", True),)),
    "MixtralForCausalLM": Architecture(mixtral_config, LlamaForCausalLM, gguf="llama", moe=True),
    "GemmaForCausalLM": Architecture(gemma_config, GemmaForCausalLM),
    "Gemma2ForCausalLM": Architecture(gemma2_config, GemmaForCausalLM, gguf="gemma2", gguf_meta=gemma_gguf_meta),
    "Gemma3ForCausalLM": Architecture(gemma3_config, GemmaForCausalLM, gguf="gemma3", gguf_meta=gemma_gguf_meta),
    # Gemma 3 4B to 27B: the text model of the image-text checkpoint
    "Gemma3ForConditionalGeneration": Architecture(gemma3_multimodal_config, GemmaForCausalLM,
                                                   checkpoint_names=multimodal_tensor_names),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def model_class(architecture: str) -> type:
    return ARCHITECTURES[architecture].model


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Read a config.json dict. Raises ValueError for an architecture this engine does not run."""
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"unknown architecture {archs or hf.get('model_type')!r} in config.json; supported "
            f"architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return ARCHITECTURES[arch].config(hf, arch)


def architecture_of_gguf(gguf_arch: str | None, experts: int = 0) -> str:
    """The HF architecture name of a GGUF file's general.architecture (with `experts` > 0: its
    mixture-of-experts member, as llama.cpp writes Mixtral as "llama")."""
    found = [name for name, a in ARCHITECTURES.items()
             if a.gguf is not None and a.gguf == gguf_arch and a.moe == (experts > 0)]
    if not found:
        supported = ", ".join(dict.fromkeys(a.gguf for a in ARCHITECTURES.values() if a.gguf))
        raise ValueError(f"unknown GGUF architecture {gguf_arch!r}; supported: {supported}")
    return found[0]
