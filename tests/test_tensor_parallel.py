"""Tensor parallelism on simulated CPU devices: transformers' greedy tokens at tensor_parallel_size
2 and 4, for head counts that divide and that do not; every device holding its share; the head
layout rules; and the errors for what cannot run. (The demo model at 4 devices: test_demo_model.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import build_model, needs_torch

from jaxsched.config import EngineArgs, ModelConfig
from jaxsched.parallel.mesh import head_layout

HERE = Path(__file__).parent


def run_sharded(case: str, arg: dict, devices: int = 8, timeout: float = 900) -> dict:
    """tests/sharded.py in a subprocess with `devices` simulated CPU devices."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    res = subprocess.run([sys.executable, str(HERE / "sharded.py"), case, json.dumps(arg)], capture_output=True,
                         text=True, timeout=timeout, env=env, check=False)
    assert res.returncode == 0, res.stderr[-4000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _cfg(N: int, K: int, F: int = 128) -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", vocab_size=300, hidden_size=64, intermediate_size=F, num_layers=1,
                       num_heads=N, num_kv_heads=K, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
                       max_position_embeddings=256, tie_word_embeddings=False)


# -- the layout rules (no devices needed) --------------------------------------------------------
def test_head_layout_is_the_identity_when_heads_divide():
    for shards in (1, 2, 4):
        lay = head_layout(_cfg(8, 4), shards)
        assert lay.identity and lay.apply(_cfg(8, 4)) == _cfg(8, 4)


def test_demo_shaped_heads_pad_kv_heads_and_query_heads():
    # SmolLM2-135M: 9 query heads over 3 KV heads. Each shard must hold whole KV groups.
    two = head_layout(_cfg(9, 3), 2)
    assert two.kv_src == (0, 1, 2, None) and len(two.q_src) == 12
    assert two.q_src[:9] == tuple(range(9)) and two.q_src[9:] == (None,) * 3  # the pad KV head's group
    four = head_layout(_cfg(9, 3), 4)
    assert len(four.kv_src) == 4 and len(four.q_src) == 12  # one KV head per device, not three copies


def test_fewer_kv_heads_than_shards_replicates_them():
    lay = head_layout(_cfg(4, 1), 2)  # one KV head, four query heads over two devices
    assert lay.kv_src == (0, 0) and lay.q_src == (0, 1, 2, 3)  # each copy serves half the group
    lay = head_layout(_cfg(2, 2), 4)  # G = 1: the copies' query heads are the original one plus a pad
    assert lay.kv_src == (0, 0, 1, 1) and lay.q_src == (0, None, 1, None)


def test_intermediate_size_is_padded_to_a_multiple_of_the_shards():
    assert head_layout(_cfg(4, 4, F=130), 4).ffn == 132
    assert head_layout(_cfg(4, 4, F=130), 2).ffn == 130


def test_more_devices_than_present_is_refused_with_the_way_out(llama_dir):
    import jax

    from jaxsched import LLM

    n = len(jax.devices())
    with pytest.raises(ValueError, match=rf"tensor_parallel_size={n + 1} needs {n + 1} devices.*xla_force_host_platform"):
        LLM(llama_dir, tensor_parallel_size=n + 1)


@pytest.mark.parametrize(("field", "value"), [("tensor_parallel_size", 0), ("data_parallel_size", -1)])
def test_sizes_must_be_positive(field, value):
    with pytest.raises(ValueError, match=field):
        EngineArgs(**{field: value})


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"distributed_coordinator": "10.0.0.1"}, "HOST:PORT"),
    ({"distributed_coordinator": "10.0.0.1:1234"}, "needs num_processes and process_id"),
    ({"num_processes": 2, "process_id": 0}, "need distributed_coordinator"),
    ({"distributed_coordinator": "h:1", "num_processes": 2, "process_id": 2}, r"process_id \(2\) must be < num_processes"),
    ({"distributed_coordinator": "auto", "data_parallel_size": 2}, "data_parallel_size > 1 runs on one host"),
])
def test_multi_host_flags_are_checked_up_front(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(**kwargs)


def test_sizing_is_per_device():
    from jaxsched.runner.model_runner import weights_bytes
    from jaxsched.sizing import kv_bytes_per_block, num_blocks_for_memory

    cfg = _cfg(8, 4, F=256)
    assert kv_bytes_per_block(cfg, 16, "float32", 2) * 2 == kv_bytes_per_block(cfg, 16, "float32")
    one, two = weights_bytes(cfg, "float32"), weights_bytes(cfg, "float32", 2)
    norms = 4 * (2 * cfg.hidden_size + cfg.hidden_size)  # two per layer and the final one: replicated
    assert two == (one - norms) // 2 + norms
    memory = (2**30, 2**30)
    blocks = [num_blocks_for_memory(cfg, 16, "float32", "float32", 0.5, memory, w, 64, 4, 10**9, shards)
              for w, shards in ((one, 1), (two, 2))]
    assert blocks[1] > 1.9 * blocks[0]  # half the KV heads per device: about twice the blocks


# -- on 8 simulated devices -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp_models(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp")
    return {
        # SmolLM2's head shape (9 query, 3 KV heads): padded at 2 and 4
        "demo_shaped": build_model(str(root / "demo_shaped"), "llama", tokenizer_dir, hidden_size=144,
                                   num_attention_heads=9, num_key_value_heads=3, head_dim=16),
        # 2 KV heads (replicated at 4), q/k/v biases (fused per shard), a vocabulary of 300 split in 4
        "qwen2": build_model(str(root / "qwen2"), "qwen2", tokenizer_dir, bias_std=0.02),
    }


def transformers_greedy(folder: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy tokens of each prompt: the single-device reference, without building
    a single-device engine (a warm-up's compilations) in the subprocess for it."""
    from test_parity import hf_greedy, hf_model

    ref = hf_model(folder)
    return [hf_greedy(ref, ids, n) for ids in prompts]


@needs_torch
@pytest.mark.slow
def test_greedy_tokens_are_transformers_at_2_and_4_devices(tp_models, model_dirs):
    # one subprocess for every engine: jax starts once
    # q/k norms; tied head, Gemma's norm. The models above run the CPU's default backend ("auto":
    # numba); each of these runs another CPU backend per shard under shard_map; the MoE model splits
    # its experts over the devices (expert parallelism); Gemma 3's sliding and global layers on numba,
    # Gemma 2's soft-capped scores on xla
    others = {"qwen3": "xla", "gemma": "reference", "qwen3_moe": "numba", "gemma3": "numba", "gemma2": "xla"}
    other_paths = {kind: model_dirs[kind] for kind in others}
    res = run_sharded("parity", {"models": tp_models, "tps": [2, 4], "variant_models": other_paths, "variants": [
        ("qwen2", 2, "xla", {"preemption_mode": "swap"}, "/swap"),
        # the Gemmas' pages are a layer group's (3 groups of 1 layer, 2 of 1): three and two times the pages
        *[(kind, 2, backend, {"num_gpu_blocks_override": 24} if kind in ("gemma2", "gemma3") else {}, "")
          for kind, backend in others.items()]]})
    prompts = res["prompt_token_ids"]
    want = {name: transformers_greedy(path, prompts, res["max_tokens"])
            for name, path in {**tp_models, **other_paths}.items()}
    for name in tp_models:
        assert len({t for toks in want[name] for t in toks}) > 8, "degenerate outputs would prove nothing"
        for tp in (2, 4):
            got = res[f"{name}@{tp}"]
            assert got["tokens"] == want[name], f"{name} at tensor_parallel_size={tp}"
            assert got["backend"] == "numba", got["backend"]
            assert got["preemptions"] > 0, "the pool is meant to be small enough to preempt"
            assert got["compiled_after_warmup"] is None, got["compiled_after_warmup"]
            shards = got["shards"]
            assert shards["problems"] == [], shards["problems"]
            names = {p.rsplit("/", 1)[-1] for p in shards["split"]}
            want_split = {"embed", "lm_head", "qkv", "o_proj", "gate_up", "down", "k_pool", "v_pool"}
            assert want_split | ({"qkv_bias"} if name == "qwen2" else set()) <= names
            assert not names & {"input_norm", "post_norm", "norm"}
    assert res["demo_shaped@2"]["heads"] == [12, 4] and res["demo_shaped@4"]["heads"] == [12, 4]
    assert res["qwen2@4"]["heads"] == [4, 4]  # 2 KV heads replicated to one per device
    # the pool's bytes on a device are its share of the KV heads (heads[1] after padding), the
    # same block count at every size (the override)
    for key, got in res.items():
        if "@" in key:
            share = got["heads"][1] // int(key.split("@")[1].split("/")[0])
            assert got["pool_bytes_device0"] == got["kv_bytes_per_device"] \
                == got["pool_elements_per_kv_head"] * share * got["pool_itemsize"], key
    for kind, backend in others.items():
        got = res[f"{kind}@2"]
        assert got["backend"] == backend, (kind, got["backend"])
        assert got["tokens"] == want[kind], kind
        assert got["shards"]["problems"] == [] and got["compiled_after_warmup"] is None
    experts = {p.rsplit("/", 1)[-1] for p in res["qwen3_moe@2"]["shards"]["split"]}
    assert {"experts_gate_up", "experts_down"} <= experts, experts
    # swapping copies every shard of a victim's blocks out to the host and back
    swap = res["qwen2@2/swap"]
    assert swap["swap_outs"] > 0 and swap["tokens"] == want["qwen2"]
    assert swap["compiled_after_warmup"] is None


@pytest.mark.slow
def test_quantized_weights_give_the_same_tokens_at_1_and_2_devices(tp_models, model_dirs, tmp_path):
    # int8 with the embedding: at 1 device the numba kernel's int8 panels, at 2 XLA's dequantizing
    # dots over weights and scales split with their output columns (the vocabulary too); fp8 on xla;
    # the MoE model's int8 experts split over the devices
    # a block-quantized GGUF in int8 groups of 32 inputs, whose scales split with the weights' inputs
    # (o_proj, down) or columns
    from tiny_gguf import write_llama_gguf

    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    gguf_path = write_llama_gguf(str(tmp_path / "blocks.gguf"), model_dirs["llama"], quant={
        **{f"blk.{i}.{n}.weight": "Q4_1" for i in range(2) for n in names}, "token_embd.weight": "Q8_0",
        "output.weight": "Q8_0"})
    quant = {"quantization": "int8", "quantize_embedding": True}
    fp8 = {"quantization": "fp8"}
    res = run_sharded("parity", {"models": tp_models, "tps": [1, 2], "engine": quant,
                                 "variant_models": {"qwen3_moe": model_dirs["qwen3_moe"], "gguf": gguf_path},
                                 "variants": [
        *[("qwen2", tp, "xla", fp8, "/fp8") for tp in (1, 2)],
        *[("qwen3_moe", tp, "auto", {}, "") for tp in (1, 2)],
        *[("gguf", tp, "auto", {}, "") for tp in (1, 2)]]}, devices=2)
    for key in ("demo_shaped", "qwen2", "qwen2@{}/fp8", "qwen3_moe", "gguf"):
        key = key if "{}" in key else key + "@{}"
        one, two = res[key.format(1)], res[key.format(2)]
        assert len({t for toks in one["tokens"] for t in toks}) > 8, "degenerate outputs would prove nothing"
        assert two["tokens"] == one["tokens"], key
        assert two["compiled_after_warmup"] is None and two["shards"]["problems"] == []
    names = {p.rsplit("/", 1)[-1] for p in res["qwen2@2"]["shards"]["split"]}
    assert {"qkv", "qkv_scale", "gate_up_scale", "embed", "embed_scale", "lm_head_scale"} <= names, names
    names = {p.rsplit("/", 1)[-1] for p in res["gguf@2"]["shards"]["split"]}
    assert {"o_proj_scale", "o_proj_min", "down_min", "qkv_min", "embed_min", "lm_head_min"} <= names, names


def test_a_backend_that_cannot_shard_is_refused_and_auto_skips_it(monkeypatch):
    import dataclasses

    from pallas_kernels import backends

    monkeypatch.setitem(backends.BACKENDS, "numba", dataclasses.replace(
        backends.BACKENDS["numba"], why_not_sharded="its kernel reads the whole pool"))
    with pytest.raises(ValueError, match="'numba' cannot run with tensor_parallel_size > 1: its kernel reads"):
        backends.choose("numba", "cpu", 64, None, "float32", "float32", shards=2)
    chosen, skipped = backends.choose("auto", "cpu", 64, None, "float32", "float32", shards=2)
    assert chosen.name == "xla" and any("numba" in why for why in skipped)
    assert backends.choose("numba", "cpu", 64, None, "float32", "float32", shards=1)[0].name == "numba"


# -- the demo model (SmolLM2-135M: 9 query heads, 3 KV heads) on simulated devices -----------------
README_CURL_BODY = {"model": "demo", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "max_tokens": 32, "temperature": 0}
DEMO_FLAGS = ["--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]


def test_readme_curl_body_is_the_readmes():
    body = (HERE.parent / "README.md").read_text().split("curl -s http://127.0.0.1:8000/v1/chat/completions", 1)[1]
    assert json.loads(body.split("-d '", 1)[1].split("'", 1)[0]) == README_CURL_BODY


@pytest.mark.slow
def test_serve_with_tensor_parallel_size_2_answers_the_readme_curl(tmp_path):
    import httpx
    from conftest import USER_CACHE
    from servers import free_port, wait_healthy

    from jaxsched.models.demo import demo_model_path

    demo = str(demo_model_path(cache=USER_CACHE))
    port = free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "serving.cli", "serve", demo, "--port", str(port),
                                 "--served-model-name", "demo", "--tensor-parallel-size", "2", *DEMO_FLAGS],
                                stdout=f, stderr=subprocess.STDOUT, env=env, cwd=HERE.parent)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log)
        r = httpx.post(url + "/v1/chat/completions", json=README_CURL_BODY, timeout=120)
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"], r.json()
        metrics = httpx.get(url + "/metrics", timeout=30).text
        info = next(line for line in metrics.splitlines() if line.startswith("jaxsched:cache_config_info{"))
        assert 'tensor_parallel_size="2"' in info and 'num_kv_heads_per_device="2"' in info, info
    finally:
        proc.terminate()
        proc.wait(30)
    text = log.read_text()
    assert "tensor parallel over 2 devices" in text and "KV heads 3 -> 4 (1 zero heads added)" in text, text[-3000:]
