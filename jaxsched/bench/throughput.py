"""`jaxsched bench throughput`: offline throughput of a workload on one engine, with continuous or
static batching (or both, on the same engine: the ratio is the value of continuous batching), and
overlapped scheduling on or off (or both).

  jaxsched bench throughput                                     # the demo model, uniform workload
  jaxsched bench throughput --workload long-tail -n 128 --max-num-seqs 32 --batching both --plot out/
  jaxsched bench throughput MODEL --dataset prompts.jsonl --overlap both --json

Every request is greedy with ignore_eos (as vLLM's throughput benchmark), so it produces exactly its
max_tokens. Figures per run: requests/s, output and total tokens/s, steps, padding per step, peak
and mean KV usage (sampled between steps), preemptions, idle seats (seat-steps with no running
request: in static batching, the rows of a batch that have finished while its longest runs on),
and host / device time per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import resource
from typing import Any

import numpy as np

from jaxsched.bench import driver, workloads
from jaxsched.bench.driver import Run
from jaxsched.bench.engine_args import add_engine_arguments, build_engine, describe_engine
from jaxsched.bench.results import add_output_arguments, emit
from jaxsched.core.request import RequestOutputKind, SamplingParams
from jaxsched.core.stats import HOST_PHASES
from jaxsched.core.step_cost import WITHIN  # the "close enough" share of the cost model's error report
from jaxsched.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    workloads.add_workload_arguments(p)
    g = p.add_argument_group("runs")
    g.add_argument("--batching", choices=("continuous", "static", "both"), default="continuous",
                   help="static: batches of --max-num-seqs requests in arrival order, each run until all of its "
                        "requests finish; 'both' runs continuous, then static, on one engine")
    g.add_argument("--overlap", choices=("on", "off", "both"), default=None,
                   help="overlapped scheduling per run (default: the engine's --async-scheduling); 'both' runs "
                        "without, then with it")
    g.add_argument("--penalized", type=float, default=0.0, metavar="SHARE",
                   help="share of the requests with a repetition penalty (0 to 1)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="every request's temperature (default 0: greedy); above 0 each request has a seed of its own")
    g.add_argument("--top-p", type=float, default=1.0, help="every request's top_p (with --temperature)")
    g.add_argument("--top-k", type=int, default=0, help="every request's top_k, 0 for none (with --temperature)")
    g.add_argument("--structured", default="0", metavar="SHARES",
                   help="comma-separated shares of the requests (0 to 1) constrained by a grammar (JSON objects, "
                        "one per line, without end: each still runs to its max_tokens); one run per share, e.g. "
                        "0,0.5,1 for the cost of structured outputs")
    g.add_argument("--speculation", choices=("on", "off", "both"), default=None,
                   help="with --speculative-config: make proposals in the runs ('on'), not ('off'), or a run "
                        "without then one with ('both', on the same engine and programs: the ratio is "
                        "speculation_speedup); default: on")
    g.add_argument("--max-steps", type=int, default=None, metavar="N",
                   help="stop each run after N engine steps and abort the requests left: the steps with the "
                        "whole workload queued (e.g. -n 2000 --max-steps 40 for the scheduler's share then); "
                        "token throughputs then count finished requests only")
    g.add_argument("--flops", action="store_true",
                   help="also the model FLOP/s achieved, against a float matmul peak measured here (~10 s)")
    add_output_arguments(p)


# --structured: JSON objects, one per line, for ever. With ignore_eos the grammar never ends by itself
# (EOS is taken out of its masks), so a constrained request makes exactly its max_tokens, as the others.
BENCH_GRAMMAR = StructuredOutputsParams(grammar=(
    'start: (obj "\\n")+\nobj: %json {"type": "object", "properties": {"id": {"type": "integer"}, "name": '
    '{"type": "string", "maxLength": 24}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, '
    '"maxItems": 4}}, "required": ["id", "name", "tags"], "additionalProperties": false}\n'))


def sampling_params(reqs: list[workloads.BenchRequest], penalized: float, structured: float = 0.0,
                    temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0) -> list[SamplingParams]:
    # --penalized: that share of the requests uses a repetition penalty, whose tables are built on
    # the host from the tokens so far (with overlap, a step with such rows waits for the one before);
    # --structured: that share (spread evenly over the arrival order) follows BENCH_GRAMMAR. Only
    # the final outputs are read, as vLLM's throughput benchmark reads LLM.generate's (FINAL_ONLY).
    # --temperature (--top-p, --top-k): every request samples, request i with seed i, so that runs
    # draw the same tokens.
    n = len(reqs)
    pen = np.arange(n) < round(penalized * n)
    so = np.floor(np.arange(1, n + 1) * structured) > np.floor(np.arange(n) * structured)
    sampled = {"temperature": temperature, "top_p": top_p, "top_k": top_k} if temperature > 0 else {"temperature": 0.0}
    return [SamplingParams(**sampled, seed=i if temperature > 0 else None, ignore_eos=r.ignore_eos, max_tokens=r.output_len,
                           repetition_penalty=1.1 if p else 1.0, structured_outputs=BENCH_GRAMMAR if c else None,
                           output_kind=RequestOutputKind.FINAL_ONLY)
            for i, (r, p, c) in enumerate(zip(reqs, pen, so))]


def measure(engine: Any, reqs: list[workloads.BenchRequest], params: list[SamplingParams],
            batchings: list[str], overlaps: list[bool | None], max_steps: int | None = None,
            speculations: tuple[bool | None, ...] = (None,)) -> list[Run]:
    """One run per (batching, overlap, speculation), batching outermost; overlap None keeps the
    engine's, speculation None makes no proposals' switch (an engine without speculative_config)."""
    runs = []
    for b in batchings:
        for o in overlaps:
            for spec in speculations:
                if o is not None:
                    driver.set_overlap(engine, o)
                if spec is not None:
                    engine.client.call_utility("set_speculation", spec)
                logger.info("run: %s batching, overlap %s%s, %d requests", b,
                            "on" if driver.overlap_of(engine) else "off",
                            "" if spec is None else f", speculation {'on' if spec else 'off'}", len(reqs))
                r = driver.run(engine, reqs, params, b, max_steps)
                runs.append(dataclasses.replace(r, speculation=spec))
    return runs


def speculation_runs(engine: Any, choice: str | None) -> tuple[bool | None, ...]:
    """The --speculation runs an engine can make: (None,) without speculative_config."""
    if engine.config.scheduler.speculative is None:
        if choice not in (None, "off"):
            raise ValueError("--speculation needs --speculative-config (e.g. '{\"method\": \"ngram\", "
                             "\"num_speculative_tokens\": 4}')")
        return (None,)
    return {None: (True,), "on": (True,), "off": (False,), "both": (False, True)}[choice]


def spec_fields(c: dict[str, float]) -> dict[str, Any]:
    """A run's speculative decoding figures (vLLM's names): proposals verified and kept."""
    drafts, proposed, kept = (int(c.get(f"spec_decode_num_{k}", 0)) for k in ("drafts", "draft_tokens",
                                                                               "accepted_tokens"))
    return {"num_drafts": drafts, "num_draft_tokens": proposed, "num_accepted_tokens": kept,
            "overlap_pauses": int(c.get("spec_decode_overlap_pauses", 0)),
            "acceptance_rate": round(kept / proposed, 4) if proposed else None,
            "mean_accepted_length": round(1 + kept / drafts, 3) if drafts else None}


def run_fields(r: Run) -> dict[str, Any]:
    """One run's figures, named as vLLM's benchmarks name them where the concept is the same."""
    c = r.counters
    steps = max(r.num_steps, 1)
    scheduled, padded = c.get("num_scheduled_tokens", 0), c.get("num_padded_tokens", 0)
    step_s, device_s = c.get("step_seconds", 0.0), c.get("device_seconds", 0.0)
    d: dict[str, Any] = {
        "batching": r.batching, "overlap": "on" if r.overlap else "off",
        "elapsed_time": round(r.elapsed, 3), "num_requests": r.num_finished,
        "total_input_tokens": r.prompt_tokens, "total_output_tokens": r.output_tokens,
        "request_throughput": round(r.num_finished / r.elapsed, 3),
        "output_throughput": round(r.output_tokens / r.elapsed, 2),
        "total_token_throughput": round((r.output_tokens + r.prompt_tokens) / r.elapsed, 2),
        "num_steps": r.num_steps,
        "scheduled_tokens_per_step": round(scheduled / steps, 2),
        "padded_tokens_per_step": round(padded / steps, 2),
        "padding_share": round(padded / max(scheduled + padded, 1), 4),
        "peak_kv_cache_usage_perc": round(r.peak_kv_usage, 4),
        "mean_kv_cache_usage_perc": round(r.mean_kv_usage, 4),
        # the share of allocated KV slots holding no token (last blocks' tails), over the run's steps;
        # external fragmentation is 0 by construction (EngineStats.kv_external_fragmentation_perc)
        "mean_kv_internal_waste_perc": round(r.kv_waste_slot_steps / max(r.kv_allocated_slot_steps, 1), 4),
        "num_preemptions": int(c.get("num_preemptions", 0)),
        "seats": r.seats,
        "mean_running_requests": round(r.running_request_steps / max(r.step_calls, 1), 2),
        "idle_seat_steps": r.idle_seat_steps,
        "idle_seat_share": round(r.idle_seat_steps / max(r.seats * r.step_calls, 1), 4),
        # per step: the wall time, and the part of it the host waited for the device; without
        # overlap the device idles for the rest (the host's work), with overlap the host works
        # while the device runs
        "wall_ms_per_step": round(step_s / steps * 1e3, 3),
        "host_ms_per_step": round((step_s - device_s) / steps * 1e3, 3),
        "device_wait_ms_per_step": round(device_s / steps * 1e3, 3),
    }
    if not r.overlap:
        if c.get("device_busy_steps", 0) > 0:
            # the device's own time per step, from the model program's dispatch to the results read
            # (every step but first runs and block moves): the host's wait alone leaves out what the
            # device did while the host was still dispatching
            d["device_busy_ms_per_step"] = round(c["device_busy_seconds"] / c["device_busy_steps"] * 1e3, 3)
        busy_ms = d.get("device_busy_ms_per_step", d["device_wait_ms_per_step"])
        d["device_idle_share"] = round(max(0.0, 1 - busy_ms / max(d["wall_ms_per_step"], 1e-9)), 4)
    # the host's time per step by phase (schedule, pack, launch, update, output), where the engine counts it
    phases = {p: round(c[f"{p}_seconds"] / steps * 1e3, 3) for p in HOST_PHASES if f"{p}_seconds" in c}
    if phases:
        d["host_ms_per_step_by_phase"] = phases
        d["scheduling_share"] = round(c.get("schedule_seconds", 0.0) / max(step_s, 1e-9), 5)
    if r.speculation is not None:
        d["speculation"] = "on" if r.speculation else "off"
        d["spec_decode"] = spec_fields(c)
    if r.cost_errors:
        # the step-cost model's one-step-ahead predictions against the measured step times
        pred, meas = np.array(r.cost_errors).T
        rel = np.abs(pred - meas) / meas
        d["cost_model_error"] = {"steps": int(rel.size), "mean": round(float(rel.mean()), 3),
                                 **{f"p{q}": round(float(np.percentile(rel, q)), 3) for q in (50, 90, 99)},
                                 "within_15_percent": round(float((rel <= WITHIN).mean()), 3)}
    return d


def speculation_ratios(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Output tokens/s with speculation over without, per batching, overlap and structured share."""
    by = {(r["batching"], r["overlap"], r["structured_share"], r.get("speculation")): r for r in runs}
    out = {}
    for (b, o, share, spec), r in by.items():
        off = by.get((b, o, share, "off"))
        if spec == "on" and off is not None and off["output_throughput"]:
            out[f"{b}/overlap {o}/{share:g}"] = round(r["output_throughput"] / off["output_throughput"], 3)
    return out


def parse_shares(text: str) -> list[float]:
    try:
        shares = [float(x) for x in str(text).split(",")]
    except ValueError:
        shares = []
    if not shares or any(not 0.0 <= x <= 1.0 for x in shares):
        raise ValueError(f"--structured takes comma-separated shares between 0 and 1, got {text!r}")
    return shares


def structured_ratios(runs: list[dict[str, Any]], base: float) -> dict[str, float]:
    """Output tokens/s of each share's run over the `base` share's, for the same batching and overlap."""
    by = {(r["batching"], r["overlap"], r["structured_share"]): r for r in runs}
    out = {}
    for r in runs:
        b = by[(r["batching"], r["overlap"], base)]
        if r["structured_share"] != base and b["output_throughput"]:
            key = f"{r['batching']}/overlap {r['overlap']}/{r['structured_share']:g}"
            out[key] = round(r["output_throughput"] / b["output_throughput"], 3)
    return out


def primary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run the top-level fields describe: continuous batching and overlap on, where run."""
    return max(runs, key=lambda r: (r["batching"] == "continuous", r["overlap"] == "on"))


def compare(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios between runs that differ in one setting."""
    out: dict[str, Any] = {}
    by = {(r["batching"], r["overlap"]): r for r in runs}
    p = primary(runs)
    s = by.get(("static", p["overlap"]))
    if p["batching"] == "continuous" and s is not None:
        out["continuous_over_static"] = {
            # None where a run finished nothing (--max-steps)
            "output_throughput": round(p["output_throughput"] / s["output_throughput"], 3)
            if s["output_throughput"] else None,
            "elapsed_time": round(s["elapsed_time"] / p["elapsed_time"], 3),
            "num_steps": round(s["num_steps"] / max(p["num_steps"], 1), 3),
            "idle_seat_share": [p["idle_seat_share"], s["idle_seat_share"]],
        }
    off = by.get((p["batching"], "off"))
    if p["overlap"] == "on" and off is not None:
        # the device's time per step without overlap is what a step costs with no host work around it:
        # its busy time where measured, else (older counters) the host's wait for it, which leaves
        # out the part of the step that ran while the host dispatched the sampler
        out["overlap_speedup"] = round(off["elapsed_time"] / p["elapsed_time"], 3)
        wall = max(p["wall_ms_per_step"], 1e-9)
        device_only = off.get("device_busy_ms_per_step", off["device_wait_ms_per_step"])
        out["device_only_ms_per_step"] = device_only
        out["host_share_with_overlap"] = round(max(0.0, 1 - device_only / wall), 3)
        out["host_share_with_overlap_by_wait"] = round(max(0.0, 1 - off["device_wait_ms_per_step"] / wall), 3)
    return out


def flops_fields(engine: Any, reqs: list[workloads.BenchRequest], elapsed: float, dtype: str) -> dict[str, Any]:
    from jaxsched.bench.flops import matmul_peak_gflops, model_flops

    if any(r.prompt_len is None for r in reqs):
        return {}
    flops = model_flops(engine.model_config, np.array([r.prompt_len for r in reqs]),
                        np.array([r.output_len for r in reqs]))
    peak = matmul_peak_gflops(dtype)
    achieved = flops["total"] / elapsed / 1e9
    return {"model_tflop": round(flops["total"] / 1e12, 2),
            "model_tflop_matmul_attention_lmhead": [round(flops[k] / 1e12, 2) for k in ("matmul", "attention", "lm_head")],
            "achieved_gflops": round(achieved, 1), "matmul_peak_gflops": round(peak, 1),
            "fraction_of_peak": round(achieved / peak, 3)}


def benchmark(engine: Any, ns: argparse.Namespace, init_s: float = 0.0) -> dict[str, Any]:
    """The whole throughput result for `ns` on `engine`."""
    vocab = engine.model_config.vocab_size
    reqs = workloads.build(ns, vocab_size=vocab, tokenizer=engine.tokenizer,
                           max_model_len=engine.scheduler_config.max_model_len)
    shares = parse_shares(ns.structured)
    batchings = ["continuous", "static"] if ns.batching == "both" else [ns.batching]
    overlaps = overlap_runs(ns.overlap)
    if ns.max_steps is not None and ns.max_steps < 1:
        raise ValueError(f"--max-steps must be >= 1, got {ns.max_steps}")
    if any(shares):  # compiled (and the tokenizer converted for llguidance) before any run is timed
        engine.grammars.compile(BENCH_GRAMMAR)
    speculations = speculation_runs(engine, getattr(ns, "speculation", None))
    runs, measured = [], []
    for share in shares:
        params = sampling_params(reqs, ns.penalized, share, ns.temperature, ns.top_p, ns.top_k)
        for r in measure(engine, reqs, params, batchings, overlaps, ns.max_steps, speculations):
            measured.append(r)
            runs.append({**run_fields(r), "structured_share": share})
    spec_ratio = speculation_ratios(runs)
    if len(speculations) > 1:  # the rest compares runs with speculation on (or as the engine makes it)
        keep = [r.get("speculation") != "off" for r in runs]
        runs_on = [r for r, k in zip(runs, keep) if k]
        measured_on = [m for m, k in zip(measured, keep) if k]
    else:
        runs_on, measured_on = runs, measured
    for r in runs:
        if (r["total_output_tokens"] != sum(x.output_len for x in reqs) and ns.max_steps is None
                and all(x.ignore_eos for x in reqs)):
            logger.warning("%s batching produced %d output tokens, %d were asked for", r["batching"],
                           r["total_output_tokens"], sum(x.output_len for x in reqs))
    res: dict[str, Any] = {"command": "throughput", "engine": describe_engine(engine),
                           "workload": workloads.describe(ns, reqs), "init_s": round(init_s, 2),
                           "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}
    free = [r for r in runs_on if r["structured_share"] == shares[0]]
    res.update(primary(free))
    res["runs"] = runs
    res.update(compare(free))
    if spec_ratio:
        res["speculation_speedup"] = spec_ratio
    if len(shares) > 1:
        res["structured_over_free"] = structured_ratios(runs_on, shares[0])
    if engine.config.step_cost_model:
        res["deferred_decode_rows"] = sum(engine.client.call_utility(lambda core: core.scheduler.num_deferred))
    if ns.flops:  # the matmul peak in the weights' dtype where it is one of these, else float32
        dtype = ns.dtype if ns.dtype in ("float32", "bfloat16") else "float32"
        res["flops"] = flops_fields(engine, reqs, measured_on[runs_on.index(primary(free))].elapsed, dtype)
    return res


def print_summary(res: dict[str, Any]) -> None:
    e, w = res["engine"], res["workload"]
    print(f"engine     {e['model']}: {e['max_num_seqs']} seats, KV {e['kv_blocks']} blocks x {e['block_size']}, "
          f"{e['attention_backend']}, warm-up {e['warmup_s']} s")
    print(f"workload   {w['name']}: {w['num_requests']} requests, {w['requested_output_tokens']} output tokens asked")
    print(f"{'batching':<11}{'overlap':<8}{'spec':<5}{'struct':>7}{'req/s':>8}{'out tok/s':>11}{'tot tok/s':>11}{'steps':>8}"
          f"{'pad/step':>10}{'peak KV':>9}{'preempt':>9}{'idle seats':>12}{'ms/step':>9}")
    for r in res["runs"]:
        print(f"{r['batching']:<11}{r['overlap']:<8}{r.get('speculation', '-'):<5}{r['structured_share']:>7.2f}{r['request_throughput']:>8.2f}{r['output_throughput']:>11.1f}"
              f"{r['total_token_throughput']:>11.1f}{r['num_steps']:>8}{r['padded_tokens_per_step']:>10.1f}"
              f"{r['peak_kv_cache_usage_perc'] * 100:>8.1f}%{r['num_preemptions']:>9}"
              f"{r['idle_seat_share'] * 100:>11.1f}%{r['wall_ms_per_step']:>9.2f}")
    if "continuous_over_static" in res:
        c = res["continuous_over_static"]
        print(f"continuous / static: {c['output_throughput']}x output tokens/s, {c['num_steps']}x fewer steps; "
              f"idle seats {c['idle_seat_share'][0] * 100:.1f} % vs {c['idle_seat_share'][1] * 100:.1f} %")
    for k, v in res.get("structured_over_free", {}).items():
        print(f"structured {k} / share {res['runs'][0]['structured_share']:g}: {v}x output tokens/s")
    for r in res["runs"]:
        sd = r.get("spec_decode")
        if sd and sd["num_drafts"]:
            print(f"speculation {r['speculation']:<4}{r['batching']:<11} acceptance rate {sd['acceptance_rate']:.3f}, "
                  f"mean accepted length {sd['mean_accepted_length']:.2f} ({sd['num_drafts']} rows verified "
                  f"{sd['num_draft_tokens']} proposals" + (f"; overlap paused before {sd['overlap_pauses']} of "
                                                            f"{r['num_steps']} steps" if r["overlap"] == "on" else "")
                  + ")")
    for k, v in res.get("speculation_speedup", {}).items():
        print(f"speculation on / off ({k}): {v}x output tokens/s")
    if "overlap_speedup" in res:
        print(f"overlap on / off: {res['overlap_speedup']}x; host share of a step with overlap "
              f"{res['host_share_with_overlap'] * 100:.1f} %")


def overlap_runs(overlap: str | None) -> list[bool | None]:
    """The runs an --overlap value measures: None (or "auto") keeps the engine's choice, "both" runs
    without, then with."""
    return {None: [None], "auto": [None], "on": [True], "off": [False], "both": [False, True]}[overlap]


def overlap_built(overlap: str | None) -> bool | None:
    """async_scheduling for the engine an --overlap value measures: built as it is measured, so that
    cpu_reserved_cores="auto" decides for that engine ("both": built overlapped, then switched);
    None (or "auto"): the engine's own choice."""
    return None if overlap in (None, "auto") else overlap != "off"


def main(ns: argparse.Namespace) -> int:
    if ns.plot:
        from jaxsched.bench.plots import require_matplotlib

        require_matplotlib()
    if ns.async_scheduling is None:
        ns.async_scheduling = overlap_built(ns.overlap)
    engine, init_s = build_engine(ns)
    res = benchmark(engine, ns, init_s)
    print_summary(res)
    if ns.plot:
        from jaxsched.bench import plots

        for path in plots.throughput(res, ns.plot):
            print(f"plot       {path}")
    emit(res, ns)
    return 0
