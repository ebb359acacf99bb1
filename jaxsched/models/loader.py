"""Loading weights: a Hugging Face folder (config.json + *.safetensors), a GGUF file (dequantized
with the `gguf` package), or random init from a config (tests).

Every source is reduced to `get(name) -> np.ndarray` under Hugging Face's tensor names, and one
function, `build_model`, turns that into our fused layout (layers stacked or per layer). A new
source only needs a name map; the layout lives in one place.
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsched.config import ModelConfig
from jaxsched.models.registry import model_class, model_config_from_hf

logger = logging.getLogger(__name__)

_JNP = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def build_model(cfg: ModelConfig, dtype: str, get: Callable[[str], np.ndarray] | None,
                attention_backend: str = "xla", seed: int = 0, layer_weights: str | None = None):
    """Construct the NNX model. With `get`, weights come from HF-named tensors; without, random.
    layer_weights: "stacked" or "per_layer" (llama.py); None picks the platform's choice."""
    cls = model_class(cfg.architecture)
    kw = {"attention_backend": attention_backend, "layer_weights": layer_weights}
    if get is None:
        return cls(cfg, dtype, rngs=nnx.Rngs(seed), **kw)
    abstract = nnx.eval_shape(lambda: cls(cfg, dtype, rngs=nnx.Rngs(0), **kw))
    graphdef, state = nnx.split(abstract)
    pure = _hf_to_pure(cfg, get, _JNP[dtype], abstract.layers.layout)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def _hf_to_pure(cfg: ModelConfig, get: Callable[[str], np.ndarray], dtype, layout: str) -> dict[str, Any]:
    """HF tensors -> our pure state dict: linear weights [in, out], q/k/v and gate/up fused, layers
    stacked on axis 0 ("stacked") or one dict per layer ("per_layer")."""
    L = cfg.num_layers

    def stack(fn: Callable[[int], np.ndarray]) -> jnp.ndarray:
        first = fn(0)
        out = np.empty((L, *first.shape), np.float32)  # filled in place: one host copy at a time
        out[0] = first
        for i in range(1, L):
            out[i] = fn(i)
        return jnp.asarray(out, dtype)

    def lw(i: int, name: str) -> np.ndarray:
        return get(f"model.layers.{i}.{name}")

    # our name -> that weight of layer i
    per_name: dict[str, Callable[[int], np.ndarray]] = {
        "input_norm": lambda i: lw(i, "input_layernorm.weight"),
        "post_norm": lambda i: lw(i, "post_attention_layernorm.weight"),
        "qkv": lambda i: np.concatenate([lw(i, f"self_attn.{p}_proj.weight").T for p in "qkv"], axis=1),
        "o_proj": lambda i: lw(i, "self_attn.o_proj.weight").T,
        "gate_up": lambda i: np.concatenate([lw(i, "mlp.gate_proj.weight").T, lw(i, "mlp.up_proj.weight").T],
                                            axis=1),
        "down": lambda i: lw(i, "mlp.down_proj.weight").T,
    }
    if cfg.qkv_bias:
        per_name["qkv_bias"] = lambda i: np.concatenate([lw(i, f"self_attn.{p}_proj.bias") for p in "qkv"])
    if cfg.o_bias:
        per_name["o_bias"] = lambda i: lw(i, "self_attn.o_proj.bias")
    if cfg.qk_norm:
        per_name["q_norm"] = lambda i: lw(i, "self_attn.q_norm.weight")
        per_name["k_norm"] = lambda i: lw(i, "self_attn.k_norm.weight")
    if cfg.mlp_bias:
        per_name["gate_up_bias"] = lambda i: np.concatenate([lw(i, "mlp.gate_proj.bias"), lw(i, "mlp.up_proj.bias")])
        per_name["down_bias"] = lambda i: lw(i, "mlp.down_proj.bias")
    if layout == "stacked":
        layers: dict[str, Any] = {"stacked": {n: stack(fn) for n, fn in per_name.items()}}
    else:
        layers = {"per_layer": {i: {n: jnp.asarray(fn(i), dtype) for n, fn in per_name.items()} for i in range(L)}}
    pure: dict[str, Any] = {
        "embed": jnp.asarray(get("model.embed_tokens.weight"), dtype),
        "norm": jnp.asarray(get("model.norm.weight"), dtype),
        "layers": layers,
    }
    if not cfg.tie_word_embeddings:
        pure["lm_head"] = jnp.asarray(get("lm_head.weight").T, dtype)
    return pure


# -- Hugging Face folders -------------------------------------------------------------------------
def load_hf_config(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{folder!r} has no config.json: pass a Hugging Face model folder or a .gguf file")
    with open(path) as f:
        return json.load(f)


def safetensors_getter(folder: str) -> Callable[[str], np.ndarray]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"{folder!r} has no *.safetensors weights (only safetensors checkpoints load)")
    where: dict[str, str] = {}
    for fn in files:
        with safe_open(fn, framework="flax") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open is not iterable
                where[k] = fn

    def get(name: str) -> np.ndarray:
        if name not in where:
            raise ValueError(f"tensor {name!r} is missing from the checkpoint in {folder!r}")
        # framework="flax" reads bfloat16 too; numpy has no bfloat16
        with safe_open(where[name], framework="flax") as f:
            return np.asarray(f.get_tensor(name).astype(jnp.float32))

    return get


# -- GGUF files -----------------------------------------------------------------------------------
_GGUF_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "qwen3": "Qwen3ForCausalLM"}
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


def gguf_reader(path: str):
    """A gguf.GGUFReader of `path`. Parsing a file's metadata takes seconds (one Python object per
    token of the vocabulary), so the weights and the tokenizer of one file share one reader (until
    forget_gguf_readers(), which the engine calls once both are loaded)."""
    st = os.stat(path)
    return _gguf_reader(os.path.abspath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _gguf_reader(path: str, size: int, mtime_ns: int):  # the file's size and mtime: a replaced file is re-read
    import gguf

    return gguf.GGUFReader(path)


def forget_gguf_readers() -> None:
    """Drop the shared reader (and its memory map of the file)."""
    _gguf_reader.cache_clear()


def _gguf_field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader) -> dict[str, Any]:
    """The GGUF metadata as a Hugging Face config.json dict."""
    arch = _gguf_field(reader, "general.architecture")
    if arch not in _GGUF_ARCH:
        raise ValueError(f"unknown GGUF architecture {arch!r}; supported: {', '.join(_GGUF_ARCH)}")

    def meta(key: str, default: Any = None) -> Any:
        return _gguf_field(reader, f"{arch}.{key}", default)

    n_heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = meta("vocab_size") or len(_gguf_field(reader, "tokenizer.ggml.tokens", []))
    hf: dict[str, Any] = {
        "architectures": [_GGUF_ARCH[arch]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", n_heads)),
        "head_dim": int(meta("attention.key_length", hidden // n_heads)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _gguf_field(reader, "tokenizer.ggml.eos_token_id"),
        "dtype": "float32",
    }
    scaling_type = meta("rope.scaling.type")
    if scaling_type == "linear":
        hf["rope_scaling"] = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported")
    return hf


def gguf_getter(reader, hf: dict[str, Any]) -> Callable[[str], np.ndarray]:
    import gguf

    tensors = {t.name: t for t in reader.tensors}
    # llama.cpp's converter permutes the rows of q/k for its rope layout; undo it (Llama family only).
    permute = hf["architectures"][0] in ("LlamaForCausalLM", "MistralForCausalLM")
    n_heads, n_kv = hf["num_attention_heads"], hf["num_key_value_heads"]

    def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
        # the converter did reshape(heads, 2, d).swapaxes(1, 2); this is its inverse
        return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    def get(name: str) -> np.ndarray:
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{_GGUF_LAYER_NAMES[rest]}"
        else:
            gname = _GGUF_TOP_NAMES[name]
        if gname not in tensors:
            raise ValueError(f"tensor {gname!r} ({name}) is missing from the GGUF file")
        t = tensors[gname]
        w = np.asarray(gguf.dequantize(t.data, t.tensor_type), np.float32)
        if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute(w, n_heads)
        elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute(w, n_kv)
        return w

    return get


# -- entry point ----------------------------------------------------------------------------------
def load_model_source(path: str) -> tuple[ModelConfig, Callable[[str], np.ndarray], str]:
    """(ModelConfig, tensor getter, kind) for a HF folder or a .gguf file."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        reader = gguf_reader(path)
        hf = gguf_config(reader)
        return model_config_from_hf(hf), gguf_getter(reader, hf), "gguf"
    if os.path.isdir(path):
        hf = load_hf_config(path)
        cfg = model_config_from_hf(hf)
        return cfg, safetensors_getter(path), "hf"
    raise ValueError(f"model {path!r} is neither a Hugging Face model folder nor a .gguf file")
