"""One server's two front ends on the same requests: HTTP (/v1/completions, SSE) against gRPC (Generate).

    python scripts/bench_front_ends.py [MODEL] [--rounds 3] [--bench "-n 32 ..."] [-- engine flags]

Starts `jaxsched serve MODEL --grpc-port` with the engine flags, then runs `jaxsched bench serve`
on it over HTTP and over gRPC in turn, --rounds times each (alternating, so that drift on a shared
machine falls on both), and prints each round and the medians: output tokens/s, mean TTFT and mean
TPOT, with gRPC's ratio to HTTP. The client runs on the same machine as the server, as it does in
`make test`'s loopback tests: on 2 cores the client's own work is part of what is measured, so
each round also reports the CPU seconds the server process and the client process spent per
thousand output tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

KEYS = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms", "server_cpu_s_per_1k", "client_cpu_s_per_1k")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench(args: list[str]) -> dict:
    res = subprocess.run([sys.executable, "-m", "serving.cli", "--log-level", "WARNING", "bench", "serve", *args,
                          "--json"], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"jaxsched bench serve {shlex.join(args)} failed: {res.stderr.strip()[-2000:]}")
    return next(json.loads(line) for line in res.stdout.splitlines() if line.startswith("{"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="HF folder or .gguf (default: the demo model)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bench", default="-n 32 --min-prompt 128 --max-prompt 128 --min-output 32 --max-output 32 "
                                      "--num-warmups 2", help="`jaxsched bench serve` workload flags")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)  # after --: `jaxsched serve` engine flags
    ns = p.parse_args(argv[:split])
    http_port, grpc_port = free_port(), free_port()
    engine = argv[split + 1:] or ["--max-model-len", "2048", "--max-num-seqs", "8"]
    cmd = [sys.executable, "-m", "serving.cli", "--log-level", "WARNING", "serve", *([ns.model] if ns.model else []),
           "--port", str(http_port), "--grpc-port", str(grpc_port), *engine]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited ({shlex.join(cmd)})")
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("the server did not come up in 600 s") from None
                time.sleep(1)
        workload = shlex.split(ns.bench)
        rows: dict[str, list[dict]] = {"http": [], "grpc": []}
        for r in range(ns.rounds):
            for name, target in (("http", ["--base-url", url]), ("grpc", ["--grpc", f"127.0.0.1:{grpc_port}"])):
                server0, client0 = cpu_seconds(server.pid), children_cpu()
                res = bench([*target, *workload])
                tokens = res["total_output_tokens"] / 1000
                res["server_cpu_s_per_1k"] = (cpu_seconds(server.pid) - server0) / tokens
                res["client_cpu_s_per_1k"] = (children_cpu() - client0) / tokens  # warm-ups and start-up included
                if res["failed"]:
                    raise SystemExit(f"{name}: {res['failed']} requests failed: {res['errors']}")
                rows[name].append(res)
                print(f"round {r + 1} {name:<4} " + "  ".join(f"{k} {res[k]:.2f}" for k in KEYS), flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    med = {name: {k: statistics.median(x[k] for x in rs) for k in KEYS} for name, rs in rows.items()}
    print(f"\nmedians of {ns.rounds} rounds ({ns.bench}; server: {' '.join(engine)})")
    print(f"{'':<6}{'output tok/s':>14}{'TTFT ms':>10}{'TPOT ms':>10}{'server CPU s/1k tok':>21}"
          f"{'client CPU s/1k tok':>21}")
    for name in ("http", "grpc"):
        m = med[name]
        print(f"{name:<6}{m['output_throughput']:>14.1f}{m['mean_ttft_ms']:>10.1f}{m['mean_tpot_ms']:>10.1f}"
              f"{m['server_cpu_s_per_1k']:>21.2f}{m['client_cpu_s_per_1k']:>21.2f}")
    print("gRPC / HTTP: " + "  ".join(f"{k} {med['grpc'][k] / med['http'][k]:.3f}" for k in KEYS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
