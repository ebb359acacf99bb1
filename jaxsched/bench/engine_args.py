"""The engine an offline bench command measures: the model and every engine flag of `jaxsched
serve` (jaxsched/engine_flags.py, one flag per EngineArgs field), with the offline benchmark's defaults where
they differ, so that figures stay comparable with scripts/bench_offline.py's."""

from __future__ import annotations

import argparse
import time
from typing import Any

from jaxsched.engine_flags import add_engine_flags, engine_args_from

# scripts/bench_offline.py's engine settings (docs/PERFORMANCE.md's figures were measured with them)
BENCH_DEFAULTS = {"dtype": "float32", "max_model_len": 1024, "max_num_batched_tokens": 2048}


def add_engine_arguments(p: argparse.ArgumentParser, **defaults: Any) -> None:
    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                   help="HF folder or .gguf file (default: the demo model); --model works too")
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    g = p.add_argument_group("engine (as jaxsched serve; --seed also seeds the workload)")
    add_engine_flags(g)
    for a in g._group_actions:  # the benchmark's own defaults, and help that says them
        if a.dest in {**BENCH_DEFAULTS, **defaults}:
            a.default = {**BENCH_DEFAULTS, **defaults}[a.dest]
            a.help = f"default: {a.default}"


def build_engine(ns: argparse.Namespace) -> tuple[Any, float]:
    """(the engine `ns` describes, seconds to build and warm it up)."""
    from jaxsched.engine.llm_engine import create_engine

    ns.model = ns.model or ns.model_pos
    t0 = time.perf_counter()
    engine = create_engine(engine_args_from(ns))
    return engine, time.perf_counter() - t0


def describe_engine(engine: Any) -> dict[str, Any]:
    """The engine's part of a JSON result."""
    e = engine
    cc, sc = engine.cache_config, engine.scheduler_config
    return {"model": e.config.model_path, "max_num_seqs": sc.max_num_seqs,
            "max_num_batched_tokens": sc.max_num_batched_tokens, "max_model_len": sc.max_model_len,
            "kv_blocks": cc.num_blocks - 1, "block_size": cc.block_size, "kv_cache_dtype": cc.dtype,
            "attention_backend": e.config.attention_backend, "data_parallel_size": engine.client.num_cores,
            "scheduling_policy": getattr(e.config.scheduling_policy, "name", "custom"),
            "warmup_s": round(engine.info.warmup_seconds, 2)}
