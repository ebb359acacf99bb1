"""Loading weights: a Hugging Face folder (config.json + *.safetensors), a GGUF file (dequantized
with the `gguf` package), or random init from a config (tests).

Every source is reduced to `get(name) -> np.ndarray` under Hugging Face's tensor names, and one
function, `build_model`, hands that to the model class of the architecture (registry.py), which
maps the names to its own fused layout (its hf_weights). Nothing here knows an architecture: a GGUF
file's tensor names and layout quirks are its model class's too (gguf_name, from_gguf).
"""

from __future__ import annotations

import dataclasses
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
from jax.sharding import NamedSharding

from jaxsched.models.layers import Put, shards_of
from jaxsched.models.model_config import ModelConfig
from jaxsched.models.registry import ARCHITECTURES, architecture_of_gguf, model_class, model_config_from_hf
from jaxsched.parallel.mesh import HeadLayout, param_spec, place

logger = logging.getLogger(__name__)


def build_model(cfg: ModelConfig, dtype: str, get: Callable[[str], np.ndarray] | None,
                attention_backend: str = "xla", seed: int = 0, layer_weights: str | None = None, mesh=None,
                heads: HeadLayout | None = None):
    """Construct the NNX model of cfg.architecture (the checkpoint's config). With `get`, weights
    come from HF-named tensors (the model class maps them to its own layout); without, random.
    layer_weights: "stacked", "per_layer" or "unrolled" (layers.py); None picks the platform's choice.
    mesh: the engine's mesh (parallel.make_mesh) when it runs on several devices, with `heads` the
    layout of its heads over them (parallel.head_layout): each weight is then placed straight into
    its shards, never whole on one device."""
    cls = model_class(cfg.architecture)
    if heads is not None:
        get = None if get is None else heads.wrap(get, cfg, cfg.head_dim)
        cfg = heads.apply(cfg)
    kw = {"attention_backend": attention_backend, "layer_weights": layer_weights, "mesh": mesh}
    if get is None:
        if mesh is not None:  # the engine always loads a checkpoint; random weights are for one device
            raise ValueError("random weights (no checkpoint) are built on one device; pass a checkpoint to shard")
        return cls(cfg, dtype, rngs=nnx.Rngs(seed), **kw)
    abstract = nnx.eval_shape(lambda: cls(cfg, dtype, rngs=nnx.Rngs(0), **kw))
    graphdef, state = nnx.split(abstract)
    pure = cls.hf_weights(cfg, get, placer(dtype, mesh, cfg.vocab_size), abstract.layers.layout, shards_of(mesh))
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def placer(dtype: str, mesh, vocab_size: int) -> Put:
    """put(weight name, host array) for build_model: the array in `dtype` on the default device, or
    with a mesh placed straight into its shards (parallel.param_spec, parallel.place)."""
    jdt = jnp.dtype(dtype)
    if mesh is None:
        return lambda name, x: jnp.asarray(x, jdt)
    vocab_split = vocab_size % mesh.shape["model"] == 0

    def put(name: str, x: np.ndarray):
        x = np.asarray(x).astype(jdt)  # bfloat16 through ml_dtypes
        return place(x, NamedSharding(mesh, param_spec(name, x.ndim, vocab_split)))

    return put


# -- Hugging Face folders -------------------------------------------------------------------------
def load_hf_config(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{folder!r} has no config.json: pass a Hugging Face model folder or a .gguf file")
    with open(path) as f:
        return json.load(f)


_FP8 = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}  # safetensors' dtype names -> ml_dtypes'


def _read_fp8(path: str, name: str) -> np.ndarray:
    """An fp8 tensor of a .safetensors file as float32, read by the format's layout (an 8-byte
    little-endian header length, the JSON header with each tensor's dtype, shape and byte offsets
    after it, then the data)."""
    import ml_dtypes

    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(n))[name]
        start, end = entry["data_offsets"]
        f.seek(8 + n + start)
        raw = np.frombuffer(f.read(end - start), dtype=getattr(ml_dtypes, _FP8[entry["dtype"]]))
    return raw.reshape(entry["shape"]).astype(np.float32)


def safetensors_getter(folder: str, names: Callable[[str], tuple[str, ...]] | None = None,
                       scaled: bool = False) -> Callable[[str], np.ndarray]:
    """get(HF name) over a folder's *.safetensors; names: where else a checkpoint may hold a tensor
    (Architecture.checkpoint_names), tried when the name itself is not there. scaled (a
    pre-quantized checkpoint: prequantized): a "X.weight" stored with a "X.weight_scale" beside it
    is read as weight * scale in float32 (the scale [out, 1] per channel, or one per tensor)."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"{folder!r} has no *.safetensors weights (only safetensors checkpoints load)")
    where: dict[str, str] = {}
    for fn in files:
        with safe_open(fn, framework="flax") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open is not iterable
                where[k] = fn

    def read(name: str) -> np.ndarray:
        with safe_open(where[name], framework="flax") as f:
            if f.get_slice(name).get_dtype() in _FP8:  # safetensors 0.8 looks for np.float8_*, which numpy lacks
                return _read_fp8(where[name], name)
            # framework="flax" reads bfloat16 too; numpy has no bfloat16
            return np.asarray(f.get_tensor(name).astype(jnp.float32))

    def get(name: str) -> np.ndarray:
        if name not in where and names is not None:
            name = next((n for n in names(name) if n in where), name)
        if name not in where:
            raise ValueError(f"tensor {name!r} is missing from the checkpoint in {folder!r}")
        w = read(name)
        if scaled and name + "_scale" in where:
            scale = read(name + "_scale")
            w = w * (scale.reshape(-1, 1) if scale.size == w.shape[0] else scale.reshape(()))
        return w

    return get


# -- GGUF files -----------------------------------------------------------------------------------
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

    def meta(key: str, default: Any = None) -> Any:
        return _gguf_field(reader, f"{arch}.{key}", default)

    experts = int(meta("expert_count", 0) or 0)
    architecture = architecture_of_gguf(arch, experts)

    n_heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = meta("vocab_size") or len(_gguf_field(reader, "tokenizer.ggml.tokens", []))
    hf: dict[str, Any] = {
        "architectures": [architecture],
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
    if experts:  # the keys the MoE config adapters read (llama.py)
        hf.update(num_experts=experts, num_local_experts=experts, num_experts_per_tok=int(meta("expert_used_count")),
                  moe_intermediate_size=int(meta("expert_feed_forward_length", hf["intermediate_size"])),
                  shared_expert_intermediate_size=int(meta("expert_shared_feed_forward_length", 0) or 0))
        if (norm := meta("expert_weights_norm")) is not None:
            hf["norm_topk_prob"] = bool(norm)
    record = ARCHITECTURES[architecture]
    hf = {**dict(record.gguf_defaults), **hf}
    if record.gguf_meta is not None:
        hf.update(record.gguf_meta(arch, meta, hf))
    scaling_type = meta("rope.scaling.type")
    if scaling_type == "linear":
        hf["rope_scaling"] = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported")
    return hf


def gguf_getter(reader, hf: dict[str, Any]) -> Callable[[str], np.ndarray]:
    """get(HF name) for a GGUF file: its model class names the tensor in llama.cpp's terms and turns
    it back into HF's layout."""
    import gguf

    tensors = {t.name: t for t in reader.tensors}
    cls = model_class(hf["architectures"][0])

    def get(name: str) -> np.ndarray:
        gname, expert = cls.gguf_name(name)
        if gname not in tensors:
            raise ValueError(f"tensor {gname!r} ({name}) is missing from the GGUF file")
        t = tensors[gname]
        # one expert of a stacked [E, ...] tensor: only its slice is dequantized
        data = t.data if expert is None else t.data[expert]
        try:
            w = gguf.dequantize(data, t.tensor_type)
        except NotImplementedError:
            raise ValueError(f"tensor {gname!r} of the GGUF file is quantized as {t.tensor_type.name}, which the gguf "
                             "package cannot dequantize; use a file of another kind (F16, BF16, Q8_0, Q4_0/1, "
                             "Q5_0/1, the K-quants Q2_K to Q6_K, the IQ kinds)") from None
        return cls.from_gguf(hf, name, np.asarray(w, np.float32))

    return get


# -- entry point ----------------------------------------------------------------------------------
def gguf_blocks(reader) -> bool:
    """Whether a GGUF file's layer weights (its 2-D "blk." tensors) are block-quantized: any of
    another kind than F32, F16 or BF16."""
    floats = {"F32", "F16", "BF16", "F64"}
    return any(t.name.startswith("blk.") and len(t.shape) >= 2 and t.tensor_type.name not in floats
               for t in reader.tensors)


def prequantized(hf: dict[str, Any], path: str) -> str | None:
    """What a checkpoint's config says about quantized weights: None (none), "fp8" for what this
    engine reads (compressed-tensors' "float-quantized" format, vLLM's name for FP8 checkpoints
    made by llm-compressor: 8-bit float weights, float32 `weight_scale` per output channel or per
    tensor, read by its published layout), else ValueError: read as floats, any other kind's 4- or
    8-bit tensors (GPTQ, AWQ, bitsandbytes, block-scaled fp8, ...) would be wrong numbers without a
    word. Activation scales (`input_scale`) are not used: the weights are dequantized inside the
    matmul and the activations stay in the model's dtype."""
    qc = hf.get("quantization_config") or (hf.get("text_config") or {}).get("quantization_config")
    if not qc:
        return None
    qc = qc if isinstance(qc, dict) else {}
    method = qc.get("quant_method", "unknown")
    groups = list((qc.get("config_groups") or {}).values())
    weights = [g.get("weights") or {} for g in groups if isinstance(g, dict)]
    if method == "compressed-tensors" and qc.get("format") == "float-quantized" and weights and all(
            w.get("num_bits") == 8 and w.get("type") == "float" and w.get("strategy") in ("channel", "tensor")
            and w.get("symmetric", True) for w in weights):
        return "fp8"
    raise ValueError(
        f"{path!r} is a pre-quantized checkpoint (quantization_config.quant_method={method!r}, format="
        f"{qc.get('format')!r}) of a kind jaxsched does not read; it reads compressed-tensors 'float-quantized' "
        "(fp8 weights with a scale per channel or per tensor). Load the model's unquantized (bfloat16 / float32) "
        "checkpoint and quantize it at load with --quantization int8 or --quantization fp8")


def load_model_source(path: str) -> tuple[ModelConfig, Callable[[str], np.ndarray], str]:
    """(ModelConfig, tensor getter, kind) for a HF folder or a .gguf file."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        reader = gguf_reader(path)
        hf = gguf_config(reader)
        cfg = dataclasses.replace(model_config_from_hf(hf), gguf_blocks=gguf_blocks(reader))
        return cfg, gguf_getter(reader, hf), "gguf"
    if os.path.isdir(path):
        hf = load_hf_config(path)
        quantized = prequantized(hf, path)
        cfg = dataclasses.replace(model_config_from_hf(hf), quantized_checkpoint=quantized)
        return cfg, safetensors_getter(path, ARCHITECTURES[cfg.architecture].checkpoint_names,
                                       scaled=quantized is not None), "hf"
    raise ValueError(f"model {path!r} is neither a Hugging Face model folder nor a .gguf file")
