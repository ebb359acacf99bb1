"""`jaxsched bench latency`: one batch of requests, timed step by step, several times over: the
prefill phase (the steps until every request has its first token) and the decode steps after it.

  jaxsched bench latency --batch-size 8 --input-len 128 --output-len 64 --num-iters 5
  jaxsched bench latency MODEL --batch-size 32 --max-num-seqs 32 --json

Each iteration draws new random prompts and empties the prefix cache first, so that no prefill is
found in the cache. With overlapped scheduling (the engine's default, except on a CPU where no core
is reserved for the host and the model keeps every core busy) a step's tokens are read by the next
step() call, so the prefill phase counts one step more than the prefill itself takes;
--no-async-scheduling times the steps on their own, --async-scheduling overlaps them.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

import numpy as np

from jaxsched.bench.driver import seats_of
from jaxsched.bench.engine_args import add_engine_arguments, build_engine, describe_engine
from jaxsched.bench.results import add_output_arguments, emit, summarize
from jaxsched.core.request import SamplingParams

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    g = p.add_argument_group("batch")
    g.add_argument("--batch-size", type=int, default=8, help="requests in the batch (at most --max-num-seqs)")
    g.add_argument("--input-len", type=int, default=32, help="prompt tokens of each request")
    g.add_argument("--output-len", type=int, default=128, help="output tokens of each request")
    g.add_argument("--num-iters", type=int, default=10, help="timed iterations")
    g.add_argument("--num-iters-warmup", type=int, default=1, help="untimed iterations first")
    add_output_arguments(p)


def one_batch(engine: Any, ns: argparse.Namespace, rng: np.random.Generator) -> dict[str, Any]:
    """Run one batch to completion: its latency, prefill phase and the time of every step."""
    engine.client.call_utility("reset_prefix_cache")
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=ns.output_len)
    made = [engine.make_request(engine.next_request_id(), {"prompt_token_ids": rng.integers(0, vocab, ns.input_len)
                                                           .tolist()}, params) for _ in range(ns.batch_size)]
    pending = {r.request_id for r in made}
    started: set[str] = set()
    steps: list[tuple[float, bool]] = []  # (seconds, in the prefill phase)
    t0 = time.perf_counter()
    for r in made:
        engine.add_request_obj(r)
    prefill_s = 0.0
    while pending:
        prefill = len(started) < len(made)
        s0 = time.perf_counter()
        for o in engine.step():
            if o.outputs[0].token_ids:
                started.add(o.request_id)
            if o.finished:
                pending.discard(o.request_id)
        s1 = time.perf_counter()
        steps.append((s1 - s0, prefill))
        if prefill and len(started) == len(made):
            prefill_s = s1 - t0
    return {"latency": time.perf_counter() - t0, "prefill": prefill_s, "steps": steps}


def benchmark(engine: Any, ns: argparse.Namespace) -> dict[str, Any]:
    if not 1 <= ns.batch_size <= seats_of(engine):
        raise ValueError(f"--batch-size must be in [1, --max-num-seqs = {seats_of(engine)}], got {ns.batch_size}")
    rng = np.random.default_rng(ns.seed)
    for _ in range(ns.num_iters_warmup):
        one_batch(engine, ns, rng)
    iters = [one_batch(engine, ns, rng) for _ in range(max(ns.num_iters, 1))]
    lat = np.array([it["latency"] for it in iters])
    prefill = [it["prefill"] for it in iters]
    prefill_steps = [sum(p for _, p in it["steps"]) for it in iters]
    decode = [s for it in iters for s, p in it["steps"] if not p]
    res: dict[str, Any] = {
        "command": "latency", "engine": describe_engine(engine), "batch_size": ns.batch_size,
        "input_len": ns.input_len, "output_len": ns.output_len, "num_iters": len(iters),
        # vLLM's latency benchmark fields: seconds per batch, and its percentiles
        "avg_latency": round(float(lat.mean()), 4), "latencies": [round(float(x), 4) for x in lat],
        "percentiles": {str(q): round(float(np.percentile(lat, q)), 4) for q in (10, 25, 50, 75, 90, 99)},
        "prefill_steps": round(float(np.mean(prefill_steps)), 2), "decode_steps": round(len(decode) / len(iters), 2),
    }
    res.update(summarize(prefill, "prefill"))
    res.update(summarize(decode, "decode_step"))
    res["prefill_tokens_per_s"] = round(ns.batch_size * ns.input_len / max(float(np.mean(prefill)), 1e-9), 1)
    if decode:
        res["decode_tokens_per_s"] = round(ns.batch_size / float(np.mean(decode)), 1)
    last = iters[-1]["steps"]
    res["last_iter_step_ms"] = [round(s * 1e3, 3) for s, _ in last]
    res["last_iter_prefill_steps"] = sum(p for _, p in last)
    return res


def main(ns: argparse.Namespace) -> int:
    if ns.plot:
        from jaxsched.bench.plots import require_matplotlib

        require_matplotlib()
    engine, _ = build_engine(ns)
    res = benchmark(engine, ns)
    print(f"batch {ns.batch_size} x ({ns.input_len} in, {ns.output_len} out), {res['num_iters']} iterations: "
          f"{res['avg_latency'] * 1e3:.1f} ms per batch (p50 {res['percentiles']['50'] * 1e3:.1f}, "
          f"p99 {res['percentiles']['99'] * 1e3:.1f})")
    print(f"prefill    {res['mean_prefill_ms']:.2f} ms over {res['prefill_steps']} steps "
          f"({res['prefill_tokens_per_s']} prompt tokens/s)")
    if res["mean_decode_step_ms"] is not None:
        print(f"decode     {res['mean_decode_step_ms']:.2f} ms per step (p50 {res['median_decode_step_ms']:.2f}, "
              f"p99 {res['p99_decode_step_ms']:.2f}) = {res['decode_tokens_per_s']} tokens/s")
    if ns.plot:
        from jaxsched.bench import plots

        for path in plots.latency(res, ns.plot):
            print(f"plot       {path}")
    emit(res, ns)
    return 0
