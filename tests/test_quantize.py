"""Weight-only quantization at load (jaxsched/models/quantize.py, `--quantization`): a quantized
engine gives the greedy tokens of a float32 engine on its dequantized twin (a checkpoint whose
weights are q * scale, computed here in numpy by the same rule), on the numba kernel's int8 path and
on XLA's; weights hold the bytes it says; the numba int8 kernel equals a float matmul of the
dequantized weight; bad flags and pre-quantized checkpoints are refused with the way out."""

from __future__ import annotations

import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsched import LLM, SamplingParams
from jaxsched.config import EngineArgs
from jaxsched.models.quantize import quantize_array

ENGINE = {"max_model_len": 64, "max_num_seqs": 4, "max_num_batched_tokens": 32, "block_size": 16}
PROMPTS = ["the capital of france is", "one two three four", "hello world, how are", "a b c d e f"]
# the HF tensors quantize_model quantizes (each [out, in]: per row), the MoE router left out
QUANTIZED = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")


def dequantized_twin(src: str, dst: str, mode: str, embedding: bool = False) -> str:
    """A copy of checkpoint `src` whose quantized tensors are replaced by q * scale (numpy, float32)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    top, qtype = {"int8": (127.0, None), "fp8": (448.0, jnp.float8_e4m3fn)}[mode]
    for name, w in tensors.items():
        if QUANTIZED.search(name) or (embedding and name in ("model.embed_tokens.weight", "lm_head.weight")):
            w = w.astype(np.float32)
            amax = np.abs(w).max(axis=1, keepdims=True)
            scale = np.where(amax > 0, amax / np.float32(top), np.float32(1)).astype(np.float32)
            x = w / scale
            q = np.clip(np.round(x), -top, top) if qtype is None else x.astype(qtype).astype(np.float32)
            tensors[name] = (q * scale).astype(np.float32)
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize(("kind", "mode", "backend", "embedding"), [
    ("llama", "int8", "auto", True),  # the numba kernel's int8 panels, the embedding and its untied copy
    ("llama", "int8", "xla", False),  # XLA's dequantizing dot
    ("qwen2", "fp8", "xla", True),  # e4m3, with biases
    ("qwen3_moe", "int8", "auto", False),  # the experts, dequantized before the grouped matmul
])
def test_quantized_engine_is_its_dequantized_twin(model_dirs, tmp_path, kind, mode, backend, embedding):
    twin = dequantized_twin(model_dirs[kind], str(tmp_path / "twin"), mode, embedding)
    q = LLM(model_dirs[kind], quantization=mode, quantize_embedding=embedding, attention_backend=backend, **ENGINE)
    got = greedy(q)
    runner = q.llm_engine.core.runner
    dtypes = {str(x.dtype) for x in jax.tree.leaves(runner._state_leaves)}
    assert ("int8" if mode == "int8" else "float8_e4m3fn") in dtypes
    del q
    want = greedy(LLM(twin, attention_backend=backend, **ENGINE))
    assert len({t for toks in want for t in toks}) > 6, "degenerate outputs would prove nothing"
    assert got == want


def test_weights_hold_the_bytes_sizing_counts(llama_dir):
    from jaxsched.runner.model_runner import weights_bytes

    full = LLM(llama_dir, attention_backend="xla", **ENGINE)
    cfg = full.llm_engine.config.model
    f32 = full.llm_engine.memory_report().weights
    del full
    for embedding in (False, True):
        llm = LLM(llama_dir, attention_backend="xla", quantization="int8", quantize_embedding=embedding, **ENGINE)
        got = llm.llm_engine.memory_report().weights
        assert got == weights_bytes(cfg, "float32", 1, "int8", embedding)
        assert got < (0.35 if embedding else 0.6) * f32, (embedding, got / f32)
        del llm


@pytest.mark.parametrize("M", [1, 7, 13, 64, 300])
def test_numba_int8_kernel_is_the_float_matmul_of_the_dequantized_weight(M):
    from pallas_kernels import numba_matmul as nm

    rng = np.random.default_rng(M)
    K, N = 96, 6 * nm.NR
    w = rng.standard_normal((K, N)).astype(np.float32)
    q, s = quantize_array(jnp.asarray(w), "int8")
    wd = np.asarray(q, np.float32) * np.asarray(s)
    x = rng.standard_normal((M, K)).astype(np.float32)
    ref = x @ wd
    wp = jnp.asarray(nm.pack(np.asarray(q)))
    y = jax.jit(lambda x, w, s: nm.matmul(x, w, s))(x, wp, s)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-4)
    parts = jax.jit(lambda x, w, s: nm.matmul_split(x, w, (2 * nm.NR, 2 * nm.NR, 2 * nm.NR), s))(x, wp, s)
    np.testing.assert_allclose(np.concatenate(parts, axis=1), ref, rtol=1e-5, atol=1e-4)
    g = jax.jit(lambda x, w, s: nm.matmul_silu_mul(x, w, s))(x, wp, s)
    np.testing.assert_allclose(g, jax.nn.silu(ref[:, : N // 2]) * ref[:, N // 2:], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="int8 packed weight takes its column scales"):
        nm.matmul(jnp.asarray(x), wp)


def test_quantize_array_bounds_the_error():
    w = jnp.asarray(np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)).at[:, 3].set(0.0)
    for mode, rel in (("int8", 0.5 / 127), ("fp8", 2.0**-4)):
        q, s = quantize_array(w, mode)
        assert q.shape == w.shape and s.shape == (32,) and s[3] == 1.0  # a zero column keeps scale 1
        err = np.abs(np.asarray(q, np.float32) * np.asarray(s) - np.asarray(w))
        assert (err <= rel * np.abs(np.asarray(w)).max(axis=0) + 1e-7).all(), mode


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"quantization": "int4"}, r"quantization must be one of \('int8', 'fp8'\)"),
    ({"quantize_embedding": True}, "quantize_embedding needs quantization"),
])
def test_bad_quantization_flags_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(**kwargs)


def test_a_prequantized_checkpoint_is_refused_with_the_way_out(llama_dir, tmp_path):
    dst = shutil.copytree(llama_dir, tmp_path / "fp8")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized"}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"pre-quantized checkpoint.*'compressed-tensors'.*--quantization int8"):
        LLM(str(dst), **ENGINE)
