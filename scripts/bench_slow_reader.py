"""A client that reads slowly: what it costs the server's memory and the other streams.

    python scripts/bench_slow_reader.py --model M [--others 8] [--other-tokens 400] [--engine-flag=--flag ...]

Starts `jaxsched serve M` and runs three phases on it, each with the same --others streaming
completions (prompt 16 random tokens, --other-tokens tokens each, greedy, ignore_eos), read as fast
as they come:
  without   the others alone
  prompt    plus one stream with n=16, --slow-tokens tokens each and logprobs=5, read as fast too
  slow      the same stream, read one SSE event a second by a client with a 16 KiB receive buffer,
            which hangs up after --hold seconds (at one event a second it would take hours to read)
Prints, per phase, the others' p50 / p99 inter-token latency (between SSE events that carry text,
per stream) and the server's peak RSS above its RSS before the phase (the server process and its
children, sampled every 50 ms), plus the slow stream's events and tokens. The model must take
--slow-tokens + 16 tokens (max_model_len).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    """Resident bytes of a process and its children (Linux)."""
    total, pids = 0, [pid]
    while pids:
        p = pids.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) * 1024
            with open(f"/proc/{p}/task/{p}/children") as f:
                pids += [int(c) for c in f.read().split()]
        except (OSError, StopIteration):
            pass
    return total


class Peak:
    """The peak of rss_bytes(pid), sampled on a thread until stopped."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, rss_bytes(pid), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def stop(self) -> int:
        self._stop.set()
        self.thread.join()
        return self.peak


def slow_stream(port: int, body: dict, every: float, out: dict, stop: threading.Event) -> None:
    """One streamed request over a raw socket with a small receive buffer, one event per `every` s,
    until it ends or `stop` is set (the socket is then closed: the server aborts the request)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    s.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(payload)).encode() + b"\r\nConnection: close\r\n\r\n" + payload)
    f = s.makefile("rb", buffering=1024)
    events = tokens = 0
    while not stop.is_set():
        line = f.readline()
        if not line:
            break
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        events += 1
        chunk = json.loads(data)
        for c in chunk.get("choices", []):
            tokens += len((c.get("logprobs") or {}).get("tokens") or [])
        stop.wait(every)
    out.update(events=events, tokens=tokens)
    s.close()


async def others(url: str, n: int, tokens: int, vocab: int, seed: int) -> list[float]:
    """Inter-token latencies (s) of n concurrent streams, each read as fast as it comes."""
    rng = np.random.default_rng(seed)

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> list[float]:
        body = {"model": "bench", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        gaps, last = [], None
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if json.loads(line[6:])["choices"][0].get("text"):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
        return gaps

    async with httpx.AsyncClient(timeout=600) as client:
        res = await asyncio.gather(*(one(client, rng.integers(3, vocab, 16).tolist()) for _ in range(n)))
    return [g for gaps in res for g in gaps]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--others", type=int, default=8)
    p.add_argument("--other-tokens", type=int, default=400)
    p.add_argument("--slow-tokens", type=int, default=900)
    p.add_argument("--every", type=float, default=1.0, help="seconds between the slow client's reads")
    p.add_argument("--hold", type=float, default=20.0,
                   help="seconds the slow client reads before it hangs up (the engine is done with its request "
                        "well before; what the server holds for it is then at its largest)")
    p.add_argument("--engine-flag", action="append", default=[], help="a flag for jaxsched serve (repeat)")
    ns = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(f"/tmp/bench_slow_reader_{port}.log")
    cmd = [sys.executable, "-m", "serving.cli", "--log-level", "WARNING", "serve", ns.model, "--port", str(port),
           "--served-model-name", "bench", *ns.engine_flag]
    with open(log, "w") as f:
        server = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=HERE.parent)
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited: {log.read_text()[-2000:]}")
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        vocab = json.loads((Path(ns.model) / "config.json").read_text())["vocab_size"]
        asyncio.run(others(url, ns.others, 8, vocab, 99))  # first requests: warm the server
        slow_body = {"model": "bench", "prompt": [5] * 16, "max_tokens": ns.slow_tokens, "n": 16, "logprobs": 5,
                     "temperature": 1.0, "ignore_eos": True, "stream": True}
        for phase in ("without", "prompt", "slow"):
            base = rss_bytes(server.pid)
            peak = Peak(server.pid)
            got: dict = {}
            reader, stop = None, threading.Event()
            if phase != "without":
                reader = threading.Thread(target=slow_stream, args=(port, slow_body, ns.every if phase == "slow"
                                                                     else 0.0, got, stop), daemon=True)
                reader.start()
                time.sleep(0.2)  # its samples are in the batch when the others arrive
            t0 = time.perf_counter()
            gaps = asyncio.run(others(url, ns.others, ns.other_tokens, vocab, 0))
            others_s = time.perf_counter() - t0
            if reader is not None:
                if phase == "slow":  # the engine has generated all of it by now: the server holds it
                    time.sleep(max(0.0, ns.hold - (time.perf_counter() - t0)))
                    stop.set()
                reader.join()
            grew = peak.stop() - base
            ms = sorted(g * 1e3 for g in gaps)
            print(f"{phase:<8} others: {len(ms)} gaps in {others_s:.1f} s, ITL p50 {statistics.median(ms):.2f} ms, "
                  f"p99 {ms[int(0.99 * (len(ms) - 1))]:.2f} ms | server peak RSS +{grew / 2**20:.1f} MiB"
                  + (f" | slow stream: {got.get('events')} events, {got.get('tokens')} tokens" if got else ""),
                  flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
