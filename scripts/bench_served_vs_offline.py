"""The same engine on the same requests, offline and served: what the server path costs.

    python scripts/bench_served_vs_offline.py --model /tmp/tiny/llama -n 256 --prompt 64 --output 128
    python scripts/bench_served_vs_offline.py -n 32 --prompt 128 --output 32 --core-process both --rounds 3
    python scripts/bench_served_vs_offline.py --model M --tree /tmp/base     # another checkout's code

Offline: scripts/bench_offline.py (LLM.generate of N requests of --prompt random token ids, --output
tokens each, greedy, ignore_eos). Served: `jaxsched serve` with the same engine flags, measured by
`jaxsched bench serve` (or with --vllm-python, vLLM's `vllm bench serve`) at request rate inf with
the same shapes (random prompts of its own, greedy, ignore_eos). Each round runs offline, then served once
per --core-process setting; rounds alternate their order. Every run starts its own process, so the
engines are built the same way (warm_up_runs on, cpu_reserved_cores auto, as `jaxsched serve` has
them).

Prints per run: output tok/s, the ratio served / offline of the same round, and the step loop's
idle share: the part of the run's wall time the engine's loop was not in a step (offline: 1 - the
steps' seconds / the elapsed time; served: the same from /metrics' engine_step_seconds over the
bench's duration). The client runs on the same machine: on 2 cores its own work competes with the
server's. --tree runs another checkout (PYTHONPATH and scripts from there; --core-process needs
a tree that has engine_core_process).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}


def engine_flags(ns: argparse.Namespace) -> list[str]:
    return ["--max-model-len", str(ns.max_model_len), "--max-num-seqs", str(ns.max_num_seqs),
            "--max-num-batched-tokens", str(ns.max_num_batched_tokens), "--dtype", ns.dtype]


def offline(ns: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(ns.tree / "scripts" / "bench_offline.py"), "-n", str(ns.num_requests),
           "--min-prompt", str(ns.prompt), "--max-prompt", str(ns.prompt), "--min-output", str(ns.output),
           "--max-output", str(ns.output), "--max-model-len", str(ns.max_model_len), "--max-num-seqs",
           str(ns.max_num_seqs), "--max-num-batched-tokens", str(ns.max_num_batched_tokens), "--dtype", ns.dtype,
           "--engine-arg", "warm_up_runs=true", "--json"]
    if ns.model:
        cmd += ["--model", ns.model]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env_for(ns.tree), cwd=ns.tree, check=False)
    line = next((x for x in res.stdout.splitlines() if x.startswith("{")), None)
    if res.returncode != 0 or line is None:
        raise SystemExit(f"bench_offline failed: {res.stderr[-3000:]}")
    d = json.loads(line)
    step_s = d["steps"] * d["wall_ms_per_step"] / 1e3
    return {"tok_s": d["output_tokens_per_s"], "loop_idle": max(0.0, 1 - step_s / d["elapsed_s"])}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its children still running (Linux)."""
    total = 0.0
    pids = [pid]
    while pids:
        p = pids.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            with open(f"/proc/{p}/task/{p}/children") as f:
                pids += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return total


def step_seconds(url: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    m = re.search(r"^jaxsched:engine_step_seconds_total\{[^}]*\} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def served(ns: argparse.Namespace, core_process: str | None) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "serving.cli", "--log-level", "WARNING", "serve", *([ns.model] if ns.model else []),
           "--port", str(port), "--served-model-name", "bench", *engine_flags(ns)]
    if core_process is not None:
        cmd.append("--engine-core-process" if core_process == "on" else "--no-engine-core-process")
    log = ns.log_dir / f"serve-{port}.log"
    with open(log, "w") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env_for(ns.tree), cwd=ns.tree)
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited: see {log}")
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the server did not come up in 600 s")
            time.sleep(0.5)
        before, server0 = step_seconds(url), cpu_seconds(server.pid)
        d = vllm_client(ns, url) if ns.vllm_python else jaxsched_client(ns, url)
        server_s = cpu_seconds(server.pid) - server0
        time.sleep(0.5)  # the core publishes its figures once idle
        step_s = step_seconds(url) - before
        tokens = d["output_throughput"] * d["duration"]
        return {"tok_s": d["output_throughput"], "loop_idle": max(0.0, 1 - step_s / d["duration"]),
                "ttft_ms": d["mean_ttft_ms"], "p99_itl_ms": d["p99_itl_ms"],
                # the server's CPU (its core process's included) per thousand output tokens
                "server_cpu_ms_per_1k": server_s / tokens * 1e6}
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def jaxsched_client(ns: argparse.Namespace, url: str) -> dict:
    bench = [sys.executable, "-m", "serving.cli", "--log-level", "WARNING", "bench", "serve", "--base-url", url,
             "--model", "bench", "-n", str(ns.num_requests), "--min-prompt", str(ns.prompt), "--max-prompt",
             str(ns.prompt), "--min-output", str(ns.output), "--max-output", str(ns.output),
             "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--json",
             *(["--tokenizer", ns.model] if ns.model else [])]
    res = subprocess.run(bench, capture_output=True, text=True, env=env_for(HERE.parent), cwd=HERE.parent,
                         check=False)
    line = next((x for x in res.stdout.splitlines() if x.startswith("{")), None)
    if res.returncode != 0 or line is None:
        raise SystemExit(f"jaxsched bench serve failed: {res.stderr[-3000:]}")
    d = json.loads(line)
    if d.get("failed"):
        raise SystemExit(f"{d['failed']} requests failed: {d.get('errors')}")
    return d


def vllm_client(ns: argparse.Namespace, url: str) -> dict:
    """`vllm bench serve` (random dataset) from the vLLM environment at --vllm-python."""
    from bench_vs_vllm import VLLM_CLI  # scripts/ is on sys.path

    out = ns.log_dir / f"vllm-bench-{time.time_ns()}.json"
    cmd = [ns.vllm_python, "-c", VLLM_CLI, "bench", "serve", "--backend", "openai", "--base-url", url,
           "--model", "bench", "--tokenizer", ns.model or "", "--dataset-name", "random",
           "--random-input-len", str(ns.prompt), "--random-output-len", str(ns.output),
           "--num-prompts", str(ns.num_requests), "--request-rate", "inf", "--ignore-eos", "--temperature", "0",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False,
                         env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    if res.returncode != 0:
        raise SystemExit(f"vllm bench serve failed: {res.stdout[-2000:]}{res.stderr[-2000:]}")
    return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the demo model)")
    p.add_argument("-n", "--num-requests", type=int, default=256)
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens of every request")
    p.add_argument("--output", type=int, default=128, help="output tokens of every request")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--core-process", choices=("default", "on", "off", "both"), default="default",
                   help="the served engine's core: its own process, the server's, both in turn, or the "
                        "command's default")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--tree", type=Path, default=HERE.parent, help="the checkout to run (default: this one)")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    p.add_argument("--vllm-python", default=None,
                   help="measure the server with vLLM's client (`vllm bench serve`) from this interpreter's "
                        "environment instead of `jaxsched bench serve` (needs --model: its tokenizer)")
    ns = p.parse_args()
    ns.tree = ns.tree.resolve()
    modes = {"default": [None], "on": ["on"], "off": ["off"], "both": ["off", "on"]}[ns.core_process]
    rows: dict[str, list[dict]] = {}
    for r in range(ns.rounds):
        runs = [("offline", None)] + [("served" + (f" core process {m}" if m else ""), m) for m in modes]
        if r % 2:
            runs.reverse()
        got = {}
        for label, mode in runs:
            got[label] = offline(ns) if mode is None and label == "offline" else served(ns, mode)
        for label, d in got.items():
            if label != "offline":
                d["ratio"] = d["tok_s"] / got["offline"]["tok_s"]
            rows.setdefault(label, []).append(d)
            extra = "".join(f"  {k} {v:.1f}" for k, v in d.items()
                            if k in ("ttft_ms", "p99_itl_ms", "server_cpu_ms_per_1k"))
            ratio = f"  x{d['ratio']:.3f} of offline" if "ratio" in d else ""
            print(f"round {r + 1} {label:<28} {d['tok_s']:9.1f} output tok/s  loop idle {d['loop_idle'] * 100:5.1f} %"
                  f"{ratio}{extra}", flush=True)
    print("medians:")
    for label, ds in rows.items():
        med = {k: statistics.median(d[k] for d in ds) for k in ds[0]}
        ratio = f"  x{med['ratio']:.3f}" if "ratio" in med else ""
        print(f"  {label:<28} {med['tok_s']:9.1f} tok/s  loop idle {med['loop_idle'] * 100:5.1f} %{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
