"""Where the offline benchmark's time goes: engine steps by kind, then single steps timed on their own.

Runs bench_offline.py's workload (same options, same defaults) with every model step synchronised
and timed, and prints seconds per (T, S) bucket and kind (decode-only, or carrying prefill chunks).
Then it replays the first step of the largest decode-only bucket and of the largest prefill bucket
--reps times each through the engine's own compiled program and prints best / median ms, so that a
change to the model step can be judged on the same inputs without the whole run's noise.
--no-prefill-attention also times the prefill step with prefill attention switched off (its
result is wrong; only the time matters): the difference is what prefill attention costs in a step.
It works on the "xla" backend (--engine-arg attention_backend=xla), whose prefill tiles it swaps.
--profile DIR also replays both captured steps under jax.profiler and prints each one's ops by time
per step, exclusive of nested events ("ThunkExecutor::Execute (wait for completion)" is the calling
thread waiting for the step, not work of its own).
--no-row-limits also times the decode step compiled without numba_matmul.row_limits (its matmuls
multiply the bucket's padding rows too), interleaved with the engine's own; the decode step
captured is then the largest with padding (the "numba" backend's packed matmuls).

  JAXSCHED_CACHE=/tmp/jcache python scripts/bench_steps.py
  python scripts/bench_steps.py -n 32 --max-output 64 --reps 5 --no-prefill-attention \
      --engine-arg attention_backend=xla
  JAXSCHED_CACHE=/tmp/jcache python scripts/bench_steps.py -n 32 --reps 3 --profile /tmp/prof
  python scripts/bench_steps.py -n 100 --min-prompt 64 --max-prompt 64 --min-output 96 \
      --max-output 96 --reps 20 --no-row-limits
"""

from __future__ import annotations

import collections
import contextlib
import glob
import gzip
import json
import logging
import os
import re
import statistics
import time

import jax
import numpy as np
from bench_offline import make_llm, parser, workload

from jaxsched.runner.batch import BatchDescriptor


def _replay(runner, exe, batch_flat, S: int, reps: int) -> tuple[list[float], np.ndarray]:
    """Seconds of `reps` runs of one step (the model program `exe`, then S's sampler) on captured
    flat buffers (the KV pool is donated and kept, as in run()), and the sampled ids of the last run."""
    prev, fi, ff, needs = batch_flat
    pen = runner._idle_tables[S]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        ints, _, _ = runner.launch(exe, S, prev, fi, ff, pen, needs)
        ints = np.asarray(ints)  # waits for the step
        times.append(time.perf_counter() - t0)
    return times, ints[:S]


def _profile(runner, exe, batch_flat, S: int, reps: int, out_dir: str, top: int = 14) -> None:
    """Replays one captured step `reps` times under jax.profiler and prints the ops that took the
    most time per step, exclusive of the events nested in them (a fusion inside a thunk counts once)."""
    _replay(runner, exe, batch_flat, S, 1)
    with jax.profiler.trace(out_dir, create_perfetto_trace=True):
        _replay(runner, exe, batch_flat, S, reps)
    path = max(glob.glob(f"{out_dir}/**/perfetto_trace.json.gz", recursive=True), key=os.path.getmtime)
    with gzip.open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    by_thread: dict[tuple, list] = collections.defaultdict(list)
    for e in events:
        by_thread[(e["pid"], e["tid"])].append(e)
    exclusive: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, name, time of nested events, duration]
        for e in evs:
            while stack and stack[-1][0] <= e["ts"]:
                end, name, child, dur = stack.pop()
                exclusive[name] += dur - child
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([e["ts"] + e["dur"], e["name"], 0.0, e["dur"]])
        for end, name, child, dur in stack:
            exclusive[name] += dur - child
    for e in events:
        calls[e["name"]] += 1
    # An FFI call is named by its target and result shape (the matmul handler serves three wrappers);
    # other ops are grouped by their kind: "fusion.12", "fusion.7" ... under "fusion".
    targets = {m[1]: f"{m[3].removeprefix('jaxsched_')} -> {re.sub(r'{[^}]*}', '', m[2])}" for m in re.finditer(
        r"(?m)^\s*(?:ROOT )?%?(\S+) = (.+?) custom-call\(.*custom_call_target=\"([^\"]+)\"", exe.as_text())}
    grouped: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for name, us in exclusive.items():
        if name.startswith(("$", "end: ")):
            continue  # Python frames and the executor's own markers
        base = targets.get(name) or re.sub(r"[.:]\d+$", "", name)
        grouped[base][0] += us
        grouped[base][1] += calls[name]
    print(f"  profile ({reps} runs, trace in {out_dir}), ms per step exclusive, calls per step:")
    for name, (us, n) in sorted(grouped.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {us / reps / 1e3:10.1f} ms {n / reps:8.0f}  {name[:90]}")


def _fmt(times: list[float]) -> str:
    return f"best {min(times) * 1e3:8.1f} ms   median {statistics.median(times) * 1e3:8.1f} ms"


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--reps", type=int, default=10, help="replays of each captured step")
    ap.add_argument("--no-prefill-attention", action="store_true",
                    help="also time the prefill step with prefill attention switched off")
    ap.add_argument("--no-row-limits", action="store_true",
                    help="also time the padded decode step without the matmuls' row limits")
    ap.add_argument("--profile", metavar="DIR",
                    help="also replay each captured step under jax.profiler (trace written to DIR) and print "
                         "its ops by time, exclusive of nested ones")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    llm = make_llm(args)
    engine = llm.llm_engine
    if args.no_prefill_attention and engine.config.attention_backend != "xla":
        raise SystemExit(f"--no-prefill-attention switches off the xla backend's prefill tiles, but this engine "
                         f"runs attention_backend={engine.config.attention_backend!r}; add --engine-arg "
                         "attention_backend=xla")
    runner = engine.core.runner
    prompts, params, _, _ = workload(args, engine.model_config.vocab_size)

    seconds: dict[tuple, float] = collections.defaultdict(float)
    count: collections.Counter = collections.Counter()
    # kind -> ((T, S), (prev_ids, flat_i32, flat_f32, sampler needs)) of its largest bucket; prev_ids: the sampled
    # ids of the step before, where decode rows of an overlapped engine take their input token
    captured: dict[str, tuple] = {}
    execute = runner.run

    def timed_execute(batch):
        T, S = batch.num_tokens_bucket, batch.num_seqs_bucket
        n = int(batch.num_seqs[0])
        kind = "decode" if int(batch.query_start_loc[n]) == n else "prefill"
        wanted = not args.no_row_limits or kind != "decode" or n < T  # with --no-row-limits: padded
        if wanted and (kind not in captured or (T, S) > captured[kind][0]):
            captured[kind] = ((T, S), (np.asarray(runner._prev_ids), batch.flat_i32.copy(), batch.flat_f32.copy(),
                                       runner.step_needs(batch)))
        t0 = time.perf_counter()
        out = jax.block_until_ready(execute(batch))  # run() only dispatches: wait for the step
        seconds[(kind, T, S)] += time.perf_counter() - t0
        count[(kind, T, S)] += 1
        return out

    runner.run = timed_execute
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - t0
    runner.run = execute

    stepped = sum(seconds.values())
    print(f"{sum(count.values())} steps in {total:.1f} s: {stepped:.1f} s in model steps, "
          f"{total - stepped:.1f} s on the host between them")
    print(f"{'kind':8s} {'T':>5s} {'S':>4s} {'steps':>6s} {'seconds':>8s} {'ms/step':>8s}")
    for key in sorted(seconds, key=lambda k: -seconds[k]):
        kind, T, S = key
        print(f"{kind:8s} {T:5d} {S:4d} {count[key]:6d} {seconds[key]:8.1f} {seconds[key] / count[key] * 1e3:8.0f}")

    for kind in ("decode", "prefill"):
        if kind not in captured:
            continue
        (T, S), flat = captured[kind]
        times, _ = _replay(runner, runner._executables[(T, S)], flat, S, args.reps)
        print(f"replay {kind} step (T={T}, S={S}), {args.reps} runs: {_fmt(times)}")
        if args.profile:
            _profile(runner, runner._executables[(T, S)], flat, S, args.reps, f"{args.profile}/{kind}")
    if args.no_row_limits and "decode" in captured:
        (T, S), flat = captured["decode"]
        original = runner._row_limits
        runner._row_limits = lambda *a: contextlib.nullcontext()
        try:
            exe = runner.compile(T, S)
        finally:
            runner._row_limits = original
        with_limits, without = [], []
        for _ in range(args.reps):  # interleaved, so machine drift hits both alike
            t, ids = _replay(runner, runner._executables[(T, S)], flat, S, 1)
            with_limits += t
            t, ids_off = _replay(runner, exe, flat, S, 1)
            without += t
        n = int(BatchDescriptor.from_flat(flat[1], flat[2], T, S).num_seqs[0])
        same = "same" if np.array_equal(ids[:n], ids_off[:n]) else "DIFFERENT"
        print(f"decode step (T={T}, S={S}, {n} real rows) with row limits:    {_fmt(with_limits)}")
        print(f"decode step (T={T}, S={S}, {n} real rows) without row limits: {_fmt(without)} ({same} ids)")
    if args.no_prefill_attention and "prefill" in captured:
        # A second program of the same step whose prefill attention returns its input unchanged.
        import pallas_kernels.xla_attention as xa

        (T, S), flat = captured["prefill"]
        original = xa._prefill_tiles
        xa._prefill_tiles = lambda q, k, v, layer, bt, sl, qsl, is_prefill, out, *rest: out
        try:
            exe = runner.compile(T, S)
        finally:
            xa._prefill_tiles = original
        base = runner._executables[(T, S)]
        with_attn, without = [], []
        for _ in range(args.reps):  # interleaved, so machine drift hits both alike
            t, ids = _replay(runner, base, flat, S, 1)
            with_attn += t
            t, ids_off = _replay(runner, exe, flat, S, 1)
            without += t
        if np.array_equal(ids, ids_off):  # the prefill rows' tokens must change without attention
            raise SystemExit("the program without prefill attention sampled the same tokens: the switch "
                             "did not reach the compiled step (pallas_kernels.xla_attention changed?)")
        print(f"prefill step (T={T}, S={S}) with prefill attention:    {_fmt(with_attn)}")
        print(f"prefill step (T={T}, S={S}) without prefill attention: {_fmt(without)}")


if __name__ == "__main__":
    main()
