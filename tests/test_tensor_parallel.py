"""Tensor parallelism on simulated CPU devices: the same greedy tokens at tensor_parallel_size 1, 2
and 4, for head counts that divide and that do not; every device holding its share; the head
layout rules; and the errors for what cannot run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import build_model

from jaxsched.config import EngineArgs, ModelConfig
from jaxsched.parallel import head_layout

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


@pytest.mark.slow
def test_greedy_tokens_are_the_same_at_1_2_and_4_devices(tp_models):
    res = run_sharded("parity", {"models": tp_models, "tps": [1, 2, 4]})
    for name in tp_models:
        one = res[f"{name}@1"]
        assert one["preemptions"] > 0, "the pool is meant to be small enough to preempt"
        assert len({t for toks in one["tokens"] for t in toks}) > 8, "degenerate outputs would prove nothing"
        for tp in (2, 4):
            got = res[f"{name}@{tp}"]
            assert got["tokens"] == one["tokens"], f"{name} at tensor_parallel_size={tp}"
            assert got["preemptions"] > 0
            assert got["compiled_after_warmup"] is None, got["compiled_after_warmup"]
            shards = got["shards"]
            assert shards["problems"] == [], shards["problems"]
            names = {p.rsplit("/", 1)[-1] for p in shards["split"]}
            assert {"embed", "lm_head", "qkv", "qkv_bias", "o_proj", "gate_up", "down", "k_pool", "v_pool"} <= names
            assert not names & {"input_norm", "post_norm", "norm"}
    assert res["demo_shaped@2"]["heads"] == [12, 4] and res["demo_shaped@4"]["heads"] == [12, 4]
    assert res["qwen2@4"]["heads"] == [4, 4]  # 2 KV heads replicated to one per device
    # the pool's bytes per device fall with the shards (same block count: the override)
    assert res["qwen2@2"]["kv_bytes_per_device"] * 2 == res["qwen2@1"]["kv_bytes_per_device"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_each_cpu_attention_backend_runs_per_shard(tp_models, backend):
    res = run_sharded("parity", {"models": {"qwen2": tp_models["qwen2"]}, "tps": [1, 2], "backend": backend,
                                 "max_tokens": 8}, devices=2)
    assert res["qwen2@2"]["tokens"] == res["qwen2@1"]["tokens"]
