"""Offline throughput benchmark: N requests of random prompt token ids, greedy, ignore_eos.

Prompt lengths are uniform in [16, 512] and output lengths uniform in [16, 256] (both inclusive),
as in the issue. Prints output tokens/s, total tokens/s, warm-up time, peak memory, host and device
time per step (and the share the device idles), and the model FLOP/s achieved as a fraction of a
float32 matmul peak measured on this machine in the same run.

A thin wrapper over `jaxsched bench throughput` (jaxsched/bench/), kept for its flags and output,
which docs/PERFORMANCE.md quotes; bench_steps.py and bench_vs_vllm.py import parser, make_llm and
workload from here.

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

from jaxsched.bench import throughput, workloads


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
    extra.setdefault("cpu_reserved_cores", "auto")  # as the jaxsched commands (serve, bench) have it
    overlap = throughput.overlap_built(getattr(args, "overlap", None))  # bench_steps, bench_vs_vllm: no flag
    if overlap is not None:
        extra.setdefault("async_scheduling", overlap)
    return LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len, **extra)


def requests(args, vocab_size: int) -> list[workloads.BenchRequest]:
    """The uniform workload of `args` (jaxsched bench throughput --workload uniform draws the same)."""
    ns = argparse.Namespace(workload="uniform", num_requests=args.num_requests, seed=args.seed,
                            min_prompt=args.min_prompt, max_prompt=args.max_prompt, min_output=args.min_output,
                            max_output=args.max_output, long_share=0.0, long_factor=1)
    return workloads.synthetic(ns, vocab_size)


def workload(args, vocab_size: int):
    """(prompts, sampling params, prompt lengths, output lengths) of the benchmark for `args`."""
    reqs = requests(args, vocab_size)
    prompts = [{"prompt_token_ids": r.prompt} for r in reqs]
    params = throughput.sampling_params(reqs, getattr(args, "penalized", 0.0))
    return prompts, params, np.array([r.prompt_len for r in reqs]), np.array([r.output_len for r in reqs])


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


def traced_run(trace_dir, engine, reqs, params, overlap) -> dict:
    """One more run under jax.profiler.trace: the trace's summary (device_trace.summary), or
    {"error": ...} when the profiler cannot start or its trace cannot be read (CUPTI missing on a
    GPU, for one): the untraced runs' figures must come out whatever the profiler does."""
    import jax

    from jaxsched.bench import device_trace

    # without the Python tracer (every Python call an event: a slower host and a far larger
    # trace) and the programs' HLO; the device's activity and XLA's host regions stay
    try:
        opts = jax.profiler.ProfileOptions()
        opts.python_tracer_level = 0
        opts.enable_hlo_proto = False
        with jax.profiler.trace(trace_dir, profiler_options=opts):
            traced = throughput.measure(engine, reqs, params, ["continuous"], overlap)[0]
        return device_trace.summary(trace_dir, traced.num_steps)
    except Exception as e:  # reported in the results instead of ending the run
        logging.getLogger(__name__).warning("the traced run failed: %s", e, exc_info=True)
        return {"error": f"{type(e).__name__}: {e}"}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--json", action="store_true", help="also print one JSON line of all figures")
    ap.add_argument("--penalized", type=float, default=0.0, metavar="SHARE",
                    help="share of the requests with a repetition penalty (0 to 1)")
    ap.add_argument("--overlap", choices=("auto", "on", "off", "both"), default="auto",
                    help="overlapped scheduling; 'auto' (the default) as the engine chooses it "
                         "(async_scheduling's default), 'both' runs the workload without, then with it, on one engine")
    ap.add_argument("--trace-dir", metavar="DIR",
                    help="after the measured runs, run the workload once more (last overlap setting) under "
                         "jax.profiler.trace into DIR and report the device's busy time per step from it; the "
                         "tracing slows the host, so that run's throughput is not reported")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)

    t0 = time.perf_counter()
    llm = make_llm(args)
    init_s = time.perf_counter() - t0
    engine = llm.llm_engine
    n = args.num_requests
    reqs = requests(args, engine.model_config.vocab_size)
    params = throughput.sampling_params(reqs, args.penalized)
    prompt_lens = np.array([r.prompt_len for r in reqs])
    output_lens = np.array([r.output_len for r in reqs])

    overlaps = throughput.overlap_runs(args.overlap)
    measured = throughput.measure(engine, reqs, params, ["continuous"], overlaps)
    runs = {"on" if r.overlap else "off": r for r in measured}
    mode = "on" if "on" in runs else "off"
    run = runs[mode]
    d = throughput.run_fields(run)
    elapsed, n_out = run.elapsed, run.output_tokens
    assert n_out == int(output_lens.sum()), "every request must produce exactly max_tokens tokens"
    n_total = n_out + int(prompt_lens.sum())
    flops = throughput.flops_fields(engine, reqs, elapsed, args.dtype)
    cc = engine.cache_config
    res = {
        "requests": n,
        "overlap": mode,
        "elapsed_s": round(elapsed, 2),
        "output_tokens_per_s": round(n_out / elapsed, 1),
        "total_tokens_per_s": round(n_total / elapsed, 1),
        "warmup_s": round(engine.info.warmup_seconds, 1),
        "init_s": round(init_s, 1),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        **flops,
        "preemptions": d["num_preemptions"],
        "padding_share": round(d["padding_share"], 3),
        "steps": d["num_steps"],
        "wall_ms_per_step": d["wall_ms_per_step"],
        "host_ms_per_step": d["host_ms_per_step"],
        "device_wait_ms_per_step": d["device_wait_ms_per_step"],
        # where the host's time goes (schedule, pack, launch, update, output): on a GPU the step is bound by it
        "host_ms_per_step_by_phase": d.get("host_ms_per_step_by_phase", {}),
        "kv_blocks": cc.num_blocks - 1,
        "block_size": cc.block_size,
        "attention_backend": engine.config.attention_backend,
        "layer_weights": engine.config.layer_weights,
        "sampler_branches": engine.config.sampler_branches,
        "kv_cache_dtype": cc.dtype,
    }
    if "cost_model_error" in d:
        res["cost_model_error"] = d["cost_model_error"]
        res["deferred_decode_rows"] = engine.core.scheduler.num_deferred
    if args.trace_dir:
        res["trace"] = traced_run(args.trace_dir, engine, reqs, params, overlaps[-1:])
        busy = res["trace"].get("device_busy_ms_per_step")
        if busy is not None:  # the kernels' time against the untraced run's wall time per step
            res["device_busy_share"] = round(min(busy / res["wall_ms_per_step"], 1.0), 3)
    # the device's idle share is a figure of the synchronous run: with --overlap both, of the off run
    # (gpu_check.py reports it from there)
    if "off" in runs:
        off = throughput.run_fields(runs["off"])
        res["device_idle_share"] = round(off["device_idle_share"], 3)
    if len(runs) == 2:
        ratios = throughput.compare([off, d])
        res["off_output_tokens_per_s"] = round(n_out / runs["off"].elapsed, 1)
        res["overlap_speedup"] = ratios["overlap_speedup"]
        res["off_wall_ms_per_step"] = off["wall_ms_per_step"]
        res["off_device_ms_per_step"] = off["device_wait_ms_per_step"]
        res["off_device_busy_ms_per_step"] = ratios["device_only_ms_per_step"]
        res["host_share_with_overlap_by_wait"] = ratios["host_share_with_overlap_by_wait"]
        res["off_host_ms_per_step_by_phase"] = off.get("host_ms_per_step_by_phase", {})
        res["host_share_with_overlap"] = ratios["host_share_with_overlap"]
    print(f"requests            {n} ({n_out} output tokens, {n_total} total tokens) in {elapsed:.1f} s "
          f"(attention backend {res['attention_backend']}, KV pool {res['kv_cache_dtype']})")
    print(f"output tokens/s     {res['output_tokens_per_s']}")
    print(f"total tokens/s      {res['total_tokens_per_s']}")
    print(f"warm-up             {res['warmup_s']} s (engine start {res['init_s']} s)")
    print(f"peak memory (RSS)   {res['peak_rss_gib']} GiB")
    print(f"per step ({mode:>3})    {res['wall_ms_per_step']} ms wall over {res['steps']} steps, of which "
          f"{res['device_wait_ms_per_step']} ms waiting for the device; padding {res['padding_share'] * 100:.1f} %")
    if res["host_ms_per_step_by_phase"]:
        print("host ms per step    " + ", ".join(f"{k} {v}" for k, v in res["host_ms_per_step_by_phase"].items()))
    if "device_idle_share" in res:
        print(f"                    without overlap the device idles {res['device_idle_share'] * 100:.1f} % of the time")
    if "cost_model_error" in res:
        e = res["cost_model_error"]
        print(f"step-cost model     prediction error over {e['steps']} steps: mean {e['mean'] * 100:.1f} %, p50 "
              f"{e['p50'] * 100:.1f} %, p90 {e['p90'] * 100:.1f} %, p99 {e['p99'] * 100:.1f} %; "
              f"{e['within_15_percent'] * 100:.0f} % within 15 %; {res['deferred_decode_rows']} decode rows deferred")
    if "overlap_speedup" in res:
        print(f"overlap off         {res['off_output_tokens_per_s']} output tokens/s, {res['off_wall_ms_per_step']} ms "
              f"per step of which {res['off_device_ms_per_step']} ms waiting for the device, which was busy "
              f"{res['off_device_busy_ms_per_step']} ms (the device-only time)")
        print(f"overlap on / off    {res['overlap_speedup']}x; with overlap the host's share of the step is "
              f"{res['host_share_with_overlap'] * 100:.1f} % (wall per step against the device-only time; "
              f"{res['host_share_with_overlap_by_wait'] * 100:.1f} % against the wait alone)")
    if "trace" in res and "error" in res["trace"]:
        print(f"trace               not taken: {res['trace']['error']}")
    elif "trace" in res:
        t = res["trace"]
        if t["device_busy_ms_per_step"] is None:
            print(f"trace               no device plane (lines: {t['device_lines']}); host regions only")
        else:
            print(f"trace               device busy {t['device_busy_ms_per_step']} ms per step = "
                  f"{res['device_busy_share'] * 100:.1f} % of the {mode} run's wall time per step")
        print("                    top host regions (ms per step): " + ", ".join(
            f"{k} {v}" for k, v in list(t["top_host_ms_per_step"].items())[:6]))
    print(f"model FLOP/s        {res['achieved_gflops']:.1f} GFLOP/s = {res['fraction_of_peak'] * 100:.1f} % of the measured "
          f"{args.dtype} matmul peak {res['matmul_peak_gflops']:.1f} GFLOP/s (workload {res['model_tflop']} TFLOP)")
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
