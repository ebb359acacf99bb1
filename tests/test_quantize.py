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
from tiny import needs_torch

from jaxsched import LLM, SamplingParams
from jaxsched.config import EngineArgs
from jaxsched.models.quantize import GROUP, dequantize, quantize_array, quantize_grouped

ENGINE = {"max_model_len": 64, "max_num_seqs": 4, "max_num_batched_tokens": 32, "block_size": 16}
PROMPTS = ["the capital of france is", "one two three four", "hello world, how are", "a b c d e f"]
# the HF tensors quantize_model quantizes (each [out, in]: per row), the MoE router left out
SEED_320 = 1  # the tied tiny model with a vocabulary of 320: a seed whose greedy outputs are not degenerate
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
    # tied, a vocabulary of 320 (panels of 32): the 8-bit table moves into the packed lm_head
    ("llama3", "int8", "auto", True),
])
def test_quantized_engine_is_its_dequantized_twin(model_dirs, tokenizer_dir, tmp_path, kind, mode, backend, embedding):
    import tiny

    src = model_dirs[kind] if kind != "llama3" else tiny.build_model(str(tmp_path / kind), kind, tokenizer_dir,
                                                                      seed=SEED_320, vocab_size=320)
    twin = dequantized_twin(src, str(tmp_path / "twin"), mode, embedding)
    q = LLM(src, quantization=mode, quantize_embedding=embedding, attention_backend=backend, **ENGINE)
    got = greedy(q)
    runner = q.llm_engine.core.runner
    assert ("embed" in runner.state) == (kind != "llama3")
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
    # the CPU's packed matmuls give a tied lm_head its own copy, but not a float one beside 8-bit weights
    llm = LLM(llama_dir, quantization="int8", **ENGINE)
    assert llm.llm_engine.core.runner.packed_matmuls
    assert llm.llm_engine.memory_report().weights == weights_bytes(cfg, "float32", 1, "int8", False)


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


@pytest.mark.parametrize("M", [1, 7, 13, 300])
def test_numba_grouped_int8_kernel_is_the_float_matmul_of_the_dequantized_weight(M):
    """The grouped panels (a scale and a minimum per 32 inputs of each column) in all three calls,
    against numpy's matmul of the weight quantize_grouped gives back."""
    from pallas_kernels import numba_matmul as nm

    rng = np.random.default_rng(M)
    K, N = 96, 6 * nm.NR
    w = rng.standard_normal((K, N)).astype(np.float32) + rng.standard_normal(N).astype(np.float32)  # off-centre
    q, s, lo = quantize_grouped(jnp.asarray(w))
    wd = np.asarray(dequantize(q, s, jnp.float32, minimum=lo))
    x = rng.standard_normal((M, K)).astype(np.float32)
    ref = x @ wd
    wp, sp, mp = (jnp.asarray(nm.pack(np.asarray(a))) for a in (q, s, lo))  # int8, float16, float16
    y = jax.jit(lambda x: nm.matmul(x, wp, sp, mp))(x)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-4)
    parts = jax.jit(lambda x: nm.matmul_split(x, wp, (2 * nm.NR, 2 * nm.NR, 2 * nm.NR), sp, mp))(x)
    np.testing.assert_allclose(np.concatenate(parts, axis=1), ref, rtol=1e-5, atol=1e-4)
    g = jax.jit(lambda x: nm.matmul_silu_mul(x, wp, sp, mp))(x)
    np.testing.assert_allclose(g, jax.nn.silu(ref[:, : N // 2]) * ref[:, N // 2:], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="grouped int8 weight"):
        nm.matmul(jnp.asarray(x), wp, sp, mp[:, :1])


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_grouped_quantization_gives_a_gguf_files_blocks_back(kind):
    """Weights dequantized from GGUF blocks (the gguf package's own quantizer and dequantizer) come
    back from quantize_grouped within float32's rounding, and their scales are the blocks' own d."""
    import gguf

    rng = np.random.default_rng(0)
    N, K = 48, 4 * GROUP
    w = (rng.standard_normal((N, K)) * 0.05 + rng.standard_normal((N, 1)) * 0.02).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    file_w = gguf.dequantize(gguf.quantize(w, qtype), qtype).reshape(N, K).T  # [in, out], as the model holds it
    q, s, lo = quantize_grouped(jnp.asarray(file_w))
    assert q.dtype == jnp.int8 and s.shape == lo.shape == (K // GROUP, N) and s.dtype == jnp.float16
    back = np.asarray(dequantize(q, s, jnp.float32, minimum=lo))
    groups = np.abs(file_w).reshape(K // GROUP, GROUP, N).max(axis=1)
    assert (np.abs(back - file_w).reshape(K // GROUP, GROUP, N).max(axis=1) <= 2e-6 * groups).all()
    # the rounding a 255-step grid would leave is far larger: the test can tell exact from close
    assert np.abs(back - file_w).max() < 1e-3 * np.asarray(s, np.float32).min()


def test_grouped_quantization_of_other_values_takes_255_steps():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((2 * GROUP, 40)).astype(np.float32)
    q, s, lo = quantize_grouped(jnp.asarray(w))
    g = w.reshape(2, GROUP, 40)
    step = (g.max(axis=1) - g.min(axis=1)) / 255
    np.testing.assert_allclose(np.asarray(s, np.float32), step, rtol=1e-3)
    err = np.abs(np.asarray(dequantize(q, s, jnp.float32, minimum=lo)) - w).reshape(2, GROUP, 40).max(axis=1)
    assert (err <= 0.51 * step + 1e-3 * np.abs(g).max(axis=1)).all()


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


def compressed_tensors_fp8(src: str, dst: str, strategy: str) -> tuple[str, str]:
    """(an FP8 checkpoint of `src` in compressed-tensors' "float-quantized" format, as llm-compressor
    writes FP8_DYNAMIC (strategy "channel") or FP8 (strategy "tensor"): each quantized linear's
    `weight` as F8_E4M3 [out, in] and `weight_scale` float32 [out, 1] or [1]; its float32 twin
    holding weight * scale), from the format's published spec (the compressed-tensors package
    itself needs torch and a calibration pass to write one)."""
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    twin = shutil.copytree(src, dst + "-twin")
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out, deq = {}, {}
    for name, w in tensors.items():
        if not QUANTIZED.search(name):
            out[name] = deq[name] = w
            continue
        amax = np.abs(w).max(axis=1, keepdims=True) if strategy == "channel" else np.abs(w).max().reshape(1)
        scale = (amax / np.float32(448.0)).astype(np.float32)
        q = (w / (scale if strategy == "channel" else scale[0])).astype(ml_dtypes.float8_e4m3fn)
        out[name], out[name + "_scale"] = q, scale
        deq[name] = (q.astype(np.float32) * (scale if strategy == "channel" else scale[0])).astype(np.float32)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    save_file(deq, os.path.join(twin, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
        "ignore": ["lm_head"]}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst, twin


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_a_compressed_tensors_fp8_checkpoint_stays_fp8_and_matches_its_float32_twin(llama_dir, tmp_path, strategy):
    from flax import nnx

    path, twin = compressed_tensors_fp8(llama_dir, str(tmp_path / "fp8"), strategy)
    fp8 = LLM(path, attention_backend="xla", **ENGINE)
    assert fp8.llm_engine.config.quantization == "fp8"  # kept in 8 bits without being asked
    state = nnx.to_pure_dict(fp8.llm_engine.core.runner.state)
    assert state["layers"]["per_layer"][0]["qkv"].dtype == jnp.float8_e4m3fn
    got = greedy(fp8)
    # against the twin quantized at load: per channel the same fp8 values and scales come back
    # (to a float32 ulp of the scale); a per-tensor scale is requantized per channel, within fp8's
    # rounding, and the greedy tokens hold on this model
    assert got == greedy(LLM(twin, attention_backend="xla", quantization="fp8", **ENGINE))
    if strategy == "channel":
        w = np.asarray(state["layers"]["per_layer"][0]["o_proj"], np.float32) * \
            np.asarray(state["layers"]["per_layer"][0]["o_proj_scale"])
        from safetensors.numpy import load_file

        want = load_file(os.path.join(twin, "model.safetensors"))["model.layers.0.self_attn.o_proj.weight"].T
        np.testing.assert_allclose(w, want, rtol=1e-6, atol=1e-9)  # the stored weights, to float32 rounding
    # and the float32 twin itself (no quantization at run time): the first step's top-5 tokens and
    # their logprobs, to 1e-4 (the dot in float32 over fp8 values, scaled after, against one over
    # their products: rounding apart; a later greedy token can flip at a near-tie)
    if strategy == "channel":
        top = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
        a, b = (llm.generate(PROMPTS, top, use_tqdm=False) for llm in (fp8, LLM(twin, attention_backend="xla",
                                                                                 **ENGINE)))
        for x, y in zip(a, b):
            lx, ly = x.outputs[0].logprobs[0], y.outputs[0].logprobs[0]
            assert list(lx) == list(ly)
            np.testing.assert_allclose([v.logprob for v in lx.values()], [v.logprob for v in ly.values()], atol=1e-4)


@needs_torch
def test_an_fp8_checkpoint_written_by_compressed_tensors_loads(llama_dir, tmp_path):
    """The compressed-tensors package (llm-compressor's writer) quantizes transformers' model of the
    tiny checkpoint to FP8 per channel and saves it; jaxsched reads it, keeps it fp8, and its first
    step's top-5 logprobs are those of a float32 folder holding the file's weight * scale."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.numpy import save_file
    from transformers import AutoModelForCausalLM

    from jaxsched.models.loader import safetensors_getter

    dst = str(tmp_path / "ct-fp8")
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    args = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"]))
    for m in model.modules():  # the weights' scales, as llm-compressor's min-max observer sets them
        if hasattr(m, "weight_scale"):
            w = m.weight.data
            scale, _ = calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), args)
            m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(llama_dir, name)):
            shutil.copy(os.path.join(llama_dir, name), dst)
    twin = shutil.copytree(llama_dir, tmp_path / "ct-twin")
    get = safetensors_getter(dst, scaled=True)
    from safetensors import safe_open

    with safe_open(os.path.join(dst, "model.safetensors"), "np") as f:
        names = [k for k in f.keys() if not k.endswith("_scale")]  # noqa: SIM118
    save_file({k: get(k) for k in names}, os.path.join(twin, "model.safetensors"), metadata={"format": "pt"})

    fp8 = LLM(dst, attention_backend="xla", **ENGINE)
    assert fp8.llm_engine.config.quantization == "fp8"
    assert fp8.llm_engine.core.runner.state["layers"]["per_layer"][0]["gate_up"][...].dtype == jnp.float8_e4m3fn
    top = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    a, b = (llm.generate(PROMPTS, top, use_tqdm=False) for llm in (fp8, LLM(str(twin), attention_backend="xla",
                                                                             **ENGINE)))
    for x, y in zip(a, b):
        lx, ly = x.outputs[0].logprobs[0], y.outputs[0].logprobs[0]
        assert list(lx) == list(ly)
        np.testing.assert_allclose([v.logprob for v in lx.values()], [v.logprob for v in ly.values()], atol=1e-4)


@pytest.mark.parametrize(("qc", "match"), [
    ({"quant_method": "gptq", "bits": 4}, r"quant_method='gptq'.*reads compressed-tensors 'float-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group"}}}}, r"format='pack-quantized'.*--quantization int8"),
])
def test_a_prequantized_checkpoint_of_another_kind_is_refused_with_the_way_out(llama_dir, tmp_path, qc, match):
    dst = shutil.copytree(llama_dir, tmp_path / "q")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"pre-quantized checkpoint.*" + match):
        LLM(str(dst), **ENGINE)


@pytest.mark.parametrize(("kind", "backend", "embedding"), [
    ("llama", "xla", False), ("llama", "auto", False), ("llama", "xla", True), ("llama", "auto", True),
    # a tied lm_head: the table's groups, transposed; on the CPU's packed path (a vocabulary of 320,
    # a multiple of the panels' width) the table moves into the packed head and is read from there
    ("llama3", "xla", True), ("llama3", "auto", True),
])
def test_a_block_quantized_gguf_stays_in_its_blocks_with_int8(model_dirs, tokenizer_dir, tmp_path, kind, backend,
                                                              embedding):
    """A GGUF's block-quantized tensors (Q8_0, Q4_1, Q5_0 here; the tiny llama's lm_head is its own
    tensor), dequantized as they are read, are
    held in int8 with a scale and minimum per 32 inputs (their blocks) with --quantization int8,
    and give the float32 engine's greedy tokens and logprobs: XLA's dequantizing dot, and the
    numba kernel's grouped panels with the embedding and its untied lm_head quantized too."""
    from tiny_gguf import write_llama_gguf

    kinds = {"attn_q": "Q4_1", "attn_k": "Q8_0", "attn_v": "Q5_0", "attn_output": "Q4_1", "ffn_gate": "Q8_0",
             "ffn_up": "Q4_1", "ffn_down": "Q5_0"}
    quant = {f"blk.{i}.{n}.weight": k for i in range(2) for n, k in kinds.items()}
    import tiny

    folder = model_dirs[kind] if kind == "llama" else tiny.build_model(str(tmp_path / kind), kind, tokenizer_dir,
                                                                        seed=SEED_320, vocab_size=320)
    path = write_llama_gguf(str(tmp_path / "blocks.gguf"), folder, quant={**quant, "token_embd.weight": "Q8_0",
                                                                                  "output.weight": "Q4_1"})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)

    def run(llm):
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        return [o.token_ids for o in outs], [[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)] for o in outs]

    plain_tokens, plain_lp = run(LLM(path, attention_backend=backend, **ENGINE))
    q = LLM(path, attention_backend=backend, quantization="int8", quantize_embedding=embedding, **ENGINE)
    state = q.llm_engine.core.runner.state
    layers = state["layers"]["per_layer"]
    assert all(layers[i]["qkv"][...].dtype == jnp.int8 and "qkv_min" in layers[i] for i in range(len(layers)))
    packed_head = kind == "llama3" and backend == "auto"
    assert ("embed" in state) != packed_head and ("embed_min" in state) == (embedding and not packed_head)
    assert ("lm_head" in state) == (kind == "llama" or packed_head)
    assert ("lm_head_min" in state) == (embedding and "lm_head" in state)
    tokens, lp = run(q)
    assert len({t for toks in plain_tokens for t in toks}) > 4, "degenerate outputs would prove nothing"
    assert tokens == plain_tokens
    np.testing.assert_allclose(np.asarray(lp), np.asarray(plain_lp), atol=2e-5)
