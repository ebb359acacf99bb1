"""Offline throughput benchmark: N requests of random prompt token ids, greedy, ignore_eos.

Prompt lengths are uniform in [16, 512] and output lengths uniform in [16, 256] (both inclusive),
as in the issue. Prints output tokens/s, total tokens/s, warm-up time, peak memory, host and device
time per step (and the share the device idles), and the model FLOP/s achieved as a fraction of a
float32 matmul peak measured on this machine in the same run.

  python scripts/bench_offline.py                    # the demo model, float32, N=128
  python scripts/bench_offline.py --overlap both     # overlapped scheduling off, then on, same engine
  python scripts/bench_offline.py --num-requests 32 --model /path/to/hf-folder --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import time

import numpy as np


def matmul_peak_gflops(dtype: str = "float32", n: int = 2048, repeats: int = 10) -> float:
    """Best-of-3 GFLOP/s of an n x n x n matmul: the ceiling any model step can reach here."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), dtype)
    b = jnp.ones((n, n), dtype)
    f = jax.jit(lambda a, b: a @ b)
    f(a, b).block_until_ready()
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeats):
            r = f(a, b)
        r.block_until_ready()
        best = max(best, 2 * n**3 * repeats / (time.perf_counter() - t0) / 1e9)
    return best


def model_flops(cfg, prompt_lens: np.ndarray, output_lens: np.ndarray) -> dict[str, float]:
    """Useful FLOPs of the workload: every token fed through the weights once (prompt + output - 1),
    causal attention over each token's context, and the lm_head once per sampled token."""
    D, F, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    N, K, H, V = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size
    weights = L * (D * (N + 2 * K) * H + N * H * D + 3 * D * F)
    fed = prompt_lens + output_lens - 1
    matmul = 2.0 * weights * fed.sum()
    # token at position i attends to i + 1 keys: QK^T and PV, 2 FLOPs per MAC, N heads of H dims
    ctx_sum = (fed * (fed + 1) / 2).sum()
    attention = 4.0 * N * H * L * ctx_sum
    lm_head = 2.0 * D * V * output_lens.sum()
    return {"matmul": matmul, "attention": attention, "lm_head": lm_head,
            "total": matmul + attention + lm_head}


def make_llm(args):
    """The engine under test: the benchmark's settings plus any --engine-arg NAME=VALUE."""
    from jaxsched import LLM

    extra = {}
    for kv in args.engine_arg:
        k, v = kv.split("=", 1)
        try:
            extra[k] = json.loads(v)
        except json.JSONDecodeError:
            extra[k] = v
    return LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len, **extra)


def workload(args, vocab_size: int):
    """(prompts, sampling params, prompt lengths, output lengths) of the benchmark for `args`."""
    from jaxsched import SamplingParams

    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    prompt_lens = rng.integers(args.min_prompt, args.max_prompt + 1, n)
    output_lens = rng.integers(args.min_output, args.max_output + 1, n)
    prompts = [{"prompt_token_ids": rng.integers(0, vocab_size, p).tolist()} for p in prompt_lens]
    # --penalized: that share of the requests uses a repetition penalty, whose tables are built on
    # the host from the tokens so far (with overlap, a step with such rows waits for the one before)
    penalized = np.arange(n) < round(getattr(args, "penalized", 0.0) * n)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=int(o),
                             repetition_penalty=1.1 if pen else 1.0) for o, pen in zip(output_lens, penalized)]
    return prompts, params, prompt_lens, output_lens


_DELTA = ("num_steps", "step_seconds", "device_seconds", "num_preemptions", "num_scheduled_tokens", "num_padded_tokens")


def set_overlap(engine, on: bool) -> None:
    """Overlapped scheduling on or off for the next steps (every replica of a data-parallel engine)."""
    for e in getattr(engine, "replicas", [engine]):
        e.async_scheduling = on


def measure(llm, prompts, params) -> tuple[list, float, dict]:
    """(outputs, seconds, the engine counters of this run alone) of one generate() call, prefix
    cache emptied first so that a repeated workload is computed again."""
    engine = llm.llm_engine
    for e in getattr(engine, "replicas", [engine]):
        e.block_manager.reset_prefix_cache()
    before = engine.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    after = engine.stats()
    return outs, elapsed, {k: getattr(after, k) - getattr(before, k) for k in _DELTA}


def parser(description: str) -> argparse.ArgumentParser:
    """The benchmark's engine and workload options (shared with bench_steps.py)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or .gguf; default: the demo model")
    ap.add_argument("--num-requests", "-n", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-arg", action="append", default=[], metavar="NAME=VALUE",
                    help="extra engine argument (value parsed as JSON when possible)")
    return ap


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--json", action="store_true", help="also print one JSON line of all figures")
    ap.add_argument("--penalized", type=float, default=0.0, metavar="SHARE",
                    help="share of the requests with a repetition penalty (0 to 1)")
    ap.add_argument("--overlap", choices=("on", "off", "both"), default="on",
                    help="overlapped scheduling; 'both' runs the workload without, then with it, on one engine")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)

    t0 = time.perf_counter()
    llm = make_llm(args)
    init_s = time.perf_counter() - t0
    engine = llm.llm_engine
    n = args.num_requests
    prompts, params, prompt_lens, output_lens = workload(args, engine.model_config.vocab_size)

    runs = {}
    for mode in (["off", "on"] if args.overlap == "both" else [args.overlap]):
        set_overlap(engine, mode == "on")
        if getattr(engine, "cost_model", None) is not None:
            engine.cost_errors = []
        runs[mode] = measure(llm, prompts, params)
    mode = "on" if "on" in runs else "off"
    outs, elapsed, d = runs[mode]
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == int(output_lens.sum()), "every request must produce exactly max_tokens tokens"
    n_total = n_out + int(prompt_lens.sum())
    flops = model_flops(engine.model_config, prompt_lens, output_lens)
    peak = matmul_peak_gflops(args.dtype)
    achieved = flops["total"] / elapsed / 1e9
    steps = max(d["num_steps"], 1)
    res = {
        "requests": n,
        "overlap": mode,
        "elapsed_s": round(elapsed, 2),
        "output_tokens_per_s": round(n_out / elapsed, 1),
        "total_tokens_per_s": round(n_total / elapsed, 1),
        "warmup_s": round(engine.runner.warmup_seconds, 1),
        "init_s": round(init_s, 1),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "model_tflop": round(flops["total"] / 1e12, 2),
        "model_tflop_matmul_attention_lmhead": [round(flops[k] / 1e12, 2) for k in ("matmul", "attention", "lm_head")],
        "achieved_gflops": round(achieved, 1),
        "matmul_peak_gflops": round(peak, 1),
        "fraction_of_peak": round(achieved / peak, 3),
        "preemptions": d["num_preemptions"],
        "padding_share": round(d["num_padded_tokens"] / max(d["num_scheduled_tokens"] + d["num_padded_tokens"], 1), 3),
        # per step: the wall time, and the part of it the host waited for the device; without
        # overlap the device idles for the rest (the host's work), with overlap the host works
        # while the device runs
        "steps": d["num_steps"],
        "wall_ms_per_step": round(d["step_seconds"] / steps * 1e3, 3),
        "host_ms_per_step": round((d["step_seconds"] - d["device_seconds"]) / steps * 1e3, 3),
        "device_wait_ms_per_step": round(d["device_seconds"] / steps * 1e3, 3),
        "kv_blocks": engine.cache_config.num_blocks - 1,
        "block_size": engine.cache_config.block_size,
        "attention_backend": engine.config.attention_backend,
        "kv_cache_dtype": engine.cache_config.dtype,
    }
    if getattr(engine, "cost_errors", None):
        # the step-cost model's one-step-ahead predictions against the measured step times
        pred, meas = np.array(engine.cost_errors).T
        rel = np.abs(pred - meas) / meas
        res["cost_model_error"] = {"steps": int(rel.size), "mean": round(float(rel.mean()), 3),
                                   **{f"p{q}": round(float(np.percentile(rel, q)), 3) for q in (50, 90, 99)},
                                   "within_15_percent": round(float((rel <= 0.15).mean()), 3)}
        res["deferred_decode_rows"] = engine.scheduler.num_deferred
    if mode == "off":
        res["device_idle_share"] = round(1 - d["device_seconds"] / max(d["step_seconds"], 1e-9), 3)
    if len(runs) == 2:
        _, off_s, off = runs["off"]
        # the device's time per step without overlap is what a step costs with no host work around it
        device_only = off["device_seconds"] / max(off["num_steps"], 1)
        res["off_output_tokens_per_s"] = round(n_out / off_s, 1)
        res["overlap_speedup"] = round(off_s / elapsed, 3)
        res["off_wall_ms_per_step"] = round(off["step_seconds"] / max(off["num_steps"], 1) * 1e3, 3)
        res["off_device_ms_per_step"] = round(device_only * 1e3, 3)
        res["host_share_with_overlap"] = round(max(0.0, 1 - device_only / (d["step_seconds"] / steps)), 3)
    print(f"requests            {n} ({n_out} output tokens, {n_total} total tokens) in {elapsed:.1f} s "
          f"(attention backend {res['attention_backend']}, KV pool {res['kv_cache_dtype']})")
    print(f"output tokens/s     {res['output_tokens_per_s']}")
    print(f"total tokens/s      {res['total_tokens_per_s']}")
    print(f"warm-up             {res['warmup_s']} s (engine start {res['init_s']} s)")
    print(f"peak memory (RSS)   {res['peak_rss_gib']} GiB")
    print(f"per step ({mode:>3})    {res['wall_ms_per_step']} ms wall over {res['steps']} steps, of which "
          f"{res['device_wait_ms_per_step']} ms waiting for the device; padding {res['padding_share'] * 100:.1f} %")
    if "device_idle_share" in res:
        print(f"                    without overlap the device idles {res['device_idle_share'] * 100:.1f} % of the time")
    if "cost_model_error" in res:
        e = res["cost_model_error"]
        print(f"step-cost model     prediction error over {e['steps']} steps: mean {e['mean'] * 100:.1f} %, p50 "
              f"{e['p50'] * 100:.1f} %, p90 {e['p90'] * 100:.1f} %, p99 {e['p99'] * 100:.1f} %; "
              f"{e['within_15_percent'] * 100:.0f} % within 15 %; {res['deferred_decode_rows']} decode rows deferred")
    if "overlap_speedup" in res:
        print(f"overlap off         {res['off_output_tokens_per_s']} output tokens/s, {res['off_wall_ms_per_step']} ms "
              f"per step of which {res['off_device_ms_per_step']} ms device")
        print(f"overlap on / off    {res['overlap_speedup']}x; with overlap the host's share of the step is "
              f"{res['host_share_with_overlap'] * 100:.1f} % (wall per step against the device-only time)")
    print(f"model FLOP/s        {achieved:.1f} GFLOP/s = {res['fraction_of_peak'] * 100:.1f} % of the measured "
          f"{args.dtype} matmul peak {peak:.1f} GFLOP/s (workload {res['model_tflop']} TFLOP)")
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
