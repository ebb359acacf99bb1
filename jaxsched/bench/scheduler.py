"""`jaxsched bench scheduler`: the scheduler alone, no model. R requests (prompt 128 tokens,
max_tokens 128, priorities 0 to 3) go through schedule -> pack -> update with fabricated sampled
tokens until all finish (or --max-steps); per-step host time, p50 / p99 / mean, and the share of
schedule / pack / update in it; the pack's own time and the bytes of the host arrays a step sends
to the device (which must not grow with --max-model-len: block_table.py).

  jaxsched bench scheduler                              # R = 256, 1024, 2048, 4096
  jaxsched bench scheduler --sizes 2048 16384 --max-steps 300 --policy priority --json
  jaxsched bench scheduler --sizes 128 --max-num-seqs 128 --max-model-len 131072
  jaxsched bench scheduler --sizes 128 --max-num-seqs 128 --sliding-window 64   # Gemma 3's layer groups
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import numpy as np

from jaxsched.bench.results import add_output_arguments, emit
from jaxsched.config import SchedulerConfig
from jaxsched.core.block_manager import BlockManager, cdiv
from jaxsched.core.buckets import seq_buckets, token_buckets
from jaxsched.core.kv_groups import FULL_ATTENTION, group_layers
from jaxsched.core.request import Request, SamplingParams
from jaxsched.core.scheduler import Scheduler
from jaxsched.runner.batch import BatchPacker


def add_arguments(p: argparse.ArgumentParser, output: bool = True) -> None:
    p.add_argument("--sizes", "--R", dest="sizes", type=int, nargs="+", default=[256, 1024, 2048, 4096],
                   metavar="R", help="request counts, one run each (default: 256 1024 2048 4096)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=0,
                   help="the width of the block tables (M = this / block size); 0: prompt + max tokens + a block")
    p.add_argument("--num-blocks", type=int, default=0, help="0: enough for max_num_seqs full sequences")
    p.add_argument("--policy", default="fcfs", choices=["fcfs", "priority"])
    p.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap", "auto"])
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--max-steps", type=int, default=1_000_000)
    p.add_argument("--sliding-window", type=int, default=0,
                   help="tokens; > 0: the KV layer groups of a Gemma 3-shaped model (26 layers, every sixth "
                        "global, the others reading this window; core/kv_groups.py)")
    if output:
        add_output_arguments(p)


def run(R: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run with R requests: its per-step figures."""
    max_len = args.prompt_len + args.max_tokens
    cfg = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len or max_len + args.block_size, enable_chunked_prefill=True,
                          token_buckets=token_buckets(args.max_num_batched_tokens),
                          seq_buckets=seq_buckets(args.max_num_seqs), preemption_mode=args.preemption_mode)
    M = cdiv(cfg.max_model_len, args.block_size)
    groups = group_layers([None if (i + 1) % 6 == 0 else args.sliding_window for i in range(26)]) \
        if args.sliding_window else FULL_ATTENTION
    num_blocks = args.num_blocks or args.max_num_seqs * cdiv(max_len + args.block_size, args.block_size) \
        * groups.num_groups + 1
    bm = BlockManager(num_blocks, args.block_size, enable_prefix_caching=args.prefix_caching, groups=groups)
    sched = Scheduler(cfg, bm, policy=args.policy)
    packer = BatchPacker(cfg.max_num_batched_tokens, cfg.max_num_seqs, M, args.block_size, groups=groups)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for i in range(R):
        prompt = rng.integers(3, 30000, args.prompt_len).tolist()
        sched.add_request(Request(str(i), prompt, params, priority=int(i % 4), eos_token_ids=(2,)))
    times, parts, packs, sent = [], np.zeros(3), [], []
    sampled = np.full(cfg.max_num_seqs, 7, np.int64).tolist()
    gc.collect()
    gc.freeze()  # what is alive now stays: the step's garbage is what a server would collect
    steps = 0
    while sched.has_unfinished_requests() and steps < args.max_steps:
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        batch = packer.pack(out) if out.scheduled else None
        t2 = time.perf_counter()
        if batch is not None:
            packs.append(t2 - t1)
            sent.append(host_bytes(batch))
        sched.update(out, sampled[: out.num_seqs])
        t3 = time.perf_counter()
        times.append(t3 - t0)
        parts += (t1 - t0, t2 - t1, t3 - t2)
        steps += 1
    gc.unfreeze()
    us = np.asarray(times) * 1e6
    return {
        "R": R, "steps": steps, "step_us_p50": round(float(np.percentile(us, 50)), 1),
        "step_us_p99": round(float(np.percentile(us, 99)), 1), "step_us_mean": round(float(us.mean()), 1),
        "step_us_max": round(float(us.max()), 1),
        "schedule_share": round(parts[0] / parts.sum(), 3), "pack_share": round(parts[1] / parts.sum(), 3),
        "update_share": round(parts[2] / parts.sum(), 3), "finished": not sched.has_unfinished_requests(),
        "preemptions": sched.num_preemptions, "max_model_len": cfg.max_model_len,
        "pack_us_p50": round(float(np.percentile(packs, 50)) * 1e6, 1),
        "pack_us_mean": round(float(np.mean(packs)) * 1e6, 1),
        "host_bytes_mean": round(float(np.mean(sent))), "host_bytes_max": int(max(sent)),
    }


def host_bytes(batch) -> int:
    """Bytes of the host arrays a packed step hands the device: the two flat buffers, the tables a
    row uses, and block table writes past the buffer's capacity (in the overflow program's chunks)."""
    from jaxsched.runner.block_table import OVERFLOW_CHUNK

    n = batch.flat_i32.nbytes + batch.flat_f32.nbytes
    if batch.has_penalties:
        n += batch.penalty_ids.nbytes + batch.penalty_counts.nbytes
    if batch.has_mask:
        n += batch.token_mask.nbytes
    if batch.has_bias:
        n += batch.bias_ids.nbytes + batch.bias_values.nbytes
    if batch.table_overflow is not None:
        n += 8 * OVERFLOW_CHUNK * -(-batch.table_overflow[0].size // OVERFLOW_CHUNK)
    return n


def main(ns: argparse.Namespace) -> int:
    if ns.plot:
        from jaxsched.bench.plots import require_matplotlib

        require_matplotlib()
    results = []
    for R in ns.sizes:
        r = run(R, ns)
        results.append(r)
        print(f"R = {R:>6}: {r['steps']} steps, per step p50 {r['step_us_p50'] / 1e3:.3f} ms, p99 "
              f"{r['step_us_p99'] / 1e3:.3f} ms (schedule {r['schedule_share'] * 100:.0f} %, pack "
              f"{r['pack_share'] * 100:.0f} %, update {r['update_share'] * 100:.0f} %); pack p50 "
              f"{r['pack_us_p50']:.0f} us, {r['host_bytes_mean'] / 1024:.1f} KiB sent a step (max "
              f"{r['host_bytes_max'] / 1024:.1f})", flush=True)
    settings = {k: getattr(ns, k) for k in ("prompt_len", "max_tokens", "max_num_seqs", "max_num_batched_tokens",
                                            "block_size", "max_model_len", "num_blocks", "policy", "preemption_mode",
                                            "prefix_caching", "max_steps")}
    res = {"command": "scheduler", "settings": settings, "results": results}
    if ns.plot:
        from jaxsched.bench import plots

        for path in plots.scheduler(res, ns.plot):
            print(f"plot       {path}")
    emit(res, ns)
    return 0
