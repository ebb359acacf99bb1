"""kv_cache_dtype: a bfloat16 KV pool under a float32 model (the XLA backend)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from test_engine_scheduling import BASE, token_prompts

from jaxsched import LLM, SamplingParams


def test_bfloat16_pool_tracks_float32(llama_dir):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    f32 = LLM(llama_dir, **BASE)
    bf16 = LLM(llama_dir, **BASE, kv_cache_dtype="bfloat16")
    # the XLA backend keeps bfloat16 bits in a uint16 array (pallas_kernels/kv_cache.py)
    assert bf16.llm_engine.core.runner.kv[0].dtype == jnp.uint16
    prompts = token_prompts(f32, 8)
    a = [o.outputs[0].token_ids for o in f32.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in bf16.generate(prompts, params, use_tqdm=False)]
    # Rounding K/V to bfloat16 may flip a near-tie, after which a sequence diverges; the first
    # token of every sequence and most tokens overall must agree.
    assert [x[0] for x in a] == [x[0] for x in b]
    same = sum(x == y for s, t in zip(a, b) for x, y in zip(s, t))
    assert same >= 0.75 * sum(len(s) for s in a), (a, b)


@pytest.mark.parametrize(("backend", "kv", "storage"), [("numba", "fp8", jnp.uint8), ("xla", "fp8_e4m3", jnp.uint8),
                                                     ("xla", "fp8_e5m2", jnp.float8_e5m2)])
def test_fp8_pool_tracks_float32(llama_dir, backend, kv, storage):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    f32 = LLM(llama_dir, **BASE, attention_backend=backend)
    fp8 = LLM(llama_dir, **BASE, attention_backend=backend, kv_cache_dtype=kv)
    assert all(x.dtype == storage for x in fp8.llm_engine.core.runner.kv)
    assert fp8.llm_engine.kv_bytes_per_device() * 4 == f32.llm_engine.kv_bytes_per_device()  # same block count
    prompts = token_prompts(f32, 8)
    a = [o.outputs[0].token_ids for o in f32.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in fp8.generate(prompts, params, use_tqdm=False)]
    # three (e4m3) or two (e5m2) mantissa bits: more near-ties flip than with bfloat16
    same = sum(x == y for s, t in zip(a, b) for x, y in zip(s, t))
    assert same >= 0.5 * sum(len(s) for s in a), (a, b)


def test_fp8_holds_twice_the_blocks_of_bfloat16_in_the_same_memory(llama_dir):
    from jaxsched.models.loader import load_model_source
    from jaxsched.sizing import num_blocks_for_memory

    cfg = load_model_source(llama_dir)[0]
    blocks = {kv: num_blocks_for_memory(cfg, 16, "float32", kv, 0.9, (2**28, 2**28), 2**20, 64, 4, 10**9)
              for kv in ("bfloat16", "fp8")}
    assert blocks["fp8"] >= 1.9 * blocks["bfloat16"], blocks


def test_pallas_needs_matching_kv_dtype_unless_fp8(llama_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(llama_dir, **BASE, kv_cache_dtype="bfloat16", attention_backend="pallas")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(llama_dir, **BASE, kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="'fp8_e5m2' is not read by the numba kernels.*kv_cache_dtype='fp8'"):
        LLM(llama_dir, **BASE, kv_cache_dtype="fp8_e5m2", attention_backend="numba")
