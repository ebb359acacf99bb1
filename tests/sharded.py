"""Runs engines on several simulated CPU devices, in a subprocess of a test (the device count is
fixed when jax initialises, so the rest of the suite must not share this process). Prints one JSON
line, "RESULT {...}", for the test to check.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharded.py parity '{"models": {...}}'
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPTS = [
    "the capital of france is",
    "hello world , how are you today ? " * 3,  # longer than a step's token budget: chunked prefill
    "one two three four five six",
    "dogs and cats like to play in the sun .",
    "language models predict the next token",
    "jax runs on gpus and cpus . " * 3,
]
# a small pool, so that the batch preempts; small steps, so that prefills are chunked and decodes
# share steps with them
ENGINE = {"max_model_len": 256, "max_num_seqs": 4, "max_num_batched_tokens": 32, "block_size": 16,
          "num_gpu_blocks_override": 8, "enable_prefix_caching": False, "preemption_mode": "recompute"}


def shard_report(engine) -> dict:
    """Per array of the model and the pool: how it is split over the engine's devices. A split
    array must hold 1/N of its elements on each of the N devices; the others a whole copy."""
    import jax
    import numpy as np

    devices = set(engine.core.devices)
    N = len(devices)
    split, whole, problems = [], [], []

    def check(name: str, x) -> None:
        shards = x.addressable_shards
        if {s.device for s in shards} != devices:
            problems.append(f"{name} is on {sorted(str(s.device) for s in shards)}")
        sizes = {int(np.prod(s.data.shape)) for s in shards}
        if "model" in tuple(x.sharding.spec):
            split.append(name)
            if sizes != {x.size // N}:
                problems.append(f"{name} {x.shape}: shards of {sorted(sizes)} elements, want {x.size // N}")
        else:
            whole.append(name)
            if sizes != {x.size}:
                problems.append(f"{name} {x.shape}: replicated shards of {sorted(sizes)} elements")

    from flax import nnx

    state = nnx.to_pure_dict(engine.core.runner.state)
    for path, x in jax.tree_util.tree_leaves_with_path(state):
        check("/".join(str(getattr(k, "key", k)) for k in path), x)
    for name, x in zip(("k_pool", "v_pool"), engine.core.runner.kv):
        check(name, x)
    return {"split": split, "whole": whole, "problems": problems}


def parity(spec: dict) -> dict:
    """Greedy tokens of spec["prompts"] (PROMPTS by default; and the prompts' token ids) for each
    model at each tensor_parallel_size with the platform's attention backend ("auto"), and for each
    variant of spec["variants"] (model, tensor_parallel_size, backend, engine overrides, key suffix;
    the model from spec["models"] or spec["variant_models"]), with the preemption and swap counts,
    the backend, the shard report of every sharded engine and whether anything compiled after
    warm-up."""
    from compiles import no_compilation

    from jaxsched import LLM, SamplingParams
    from jaxsched.core.kv_groups import kv_groups

    greedy = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 16), ignore_eos=True)
    prompts = spec.get("prompts", PROMPTS)
    out: dict = {}
    runs = [(name, path, tp, "auto", {}, "") for name, path in spec["models"].items() for tp in spec["tps"]]
    # (model, tensor_parallel_size, backend, engine overrides, key suffix)
    paths = {**spec["models"], **spec.get("variant_models", {})}
    runs += [(name, paths[name], tp, backend, extra, suffix) for name, tp, backend, extra, suffix in spec.get("variants", [])]
    for name, path, tp, backend, extra, suffix in runs:
        llm = LLM(path, tensor_parallel_size=tp, attention_backend=backend,
                  **{**ENGINE, **spec.get("engine", {}), **extra})
        eng = llm.llm_engine
        compiled_after_warmup = None
        try:
            with no_compilation():
                outs = llm.generate(prompts, greedy, use_tqdm=False)
        except AssertionError as e:
            compiled_after_warmup = str(e)
            outs = llm.generate(prompts, greedy, use_tqdm=False)
        out[f"{name}@{tp}{suffix}"] = {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "preemptions": eng.stats().num_preemptions,
            "swap_outs": eng.stats().num_swap_outs,
            "heads": [eng.config.model.num_heads, eng.config.model.num_kv_heads],
            "backend": eng.config.attention_backend,
            "compiled_after_warmup": compiled_after_warmup,
            "shards": shard_report(eng) if tp > 1 else None,
            "kv_bytes_per_device": eng.kv_bytes_per_device(),
            # what the pool's arrays hold on the first device, and the sizes that should give it
            "pool_bytes_device0": sum(x.addressable_shards[0].data.nbytes for x in eng.core.runner.kv),
            # a page holds one layer group's layers (core/kv_groups.py): all of them without windows
            "pool_elements_per_kv_head": 2 * eng.config.cache.num_blocks * eng.config.cache.block_size
            * kv_groups(eng.config.model).size * eng.config.model.head_dim,
            "pool_itemsize": int(eng.core.runner.kv[0].dtype.itemsize),
        }
        out["prompt_token_ids"] = [o.prompt_token_ids for o in outs]
        del llm, eng
    out["max_tokens"] = greedy.max_tokens
    return out


if __name__ == "__main__":
    case, arg = sys.argv[1], json.loads(sys.argv[2])
    print("RESULT " + json.dumps({"parity": parity}[case](arg)), flush=True)
