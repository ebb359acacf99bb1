"""Two processes on loopback, one engine: jax.distributed.initialize("127.0.0.1:PORT", 2, i), one
simulated CPU device each, tensor_parallel_size=2 across them (the collectives between the
processes go through gloo, JAX's CPU collectives). Their outputs must equal, token for token, those
of one process on one device.

  offline  the same script (multihost_worker.py) as process 0 and process 1: two LLM.generate
           batches (chunked prefill, preemption, a sampled request), an abort between steps, the
           leader's shutdown
  served   `jaxsched serve` as process 0 (HTTP) and process 1 (follows): completions and chat
           answer as the single-process engine does; when process 0 stops, process 1 exits by itself

Every subprocess runs under a deadline; when one fails or hangs (a collective waiting for a peer
that is gone), both are killed and both logs' tails shown.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import multihost_worker as worker
import pytest
from servers import free_port, wait_healthy

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
ROOT = HERE.parent
DEADLINE = 600  # seconds for a pair: two engine builds (compilation) share this machine's cores
# The leader is stopped as a process manager stops it, with SIGTERM. uvicorn re-raises the signal
# once its graceful shutdown is over; serving.server.serve() first runs the leader's shutdown
# (publish "stop", jax.distributed.shutdown), then lets the signal end the process (without that,
# process 0 would die first and process 1's coordination agent would abort).
STOP_SIGNAL = signal.SIGTERM


def _env() -> dict[str, str]:
    """One CPU device per process (set before jax initialises). The session's compilation cache
    (conftest: JAXSCHED_CACHE) is inherited, so the second pair reuses the first one's programs."""
    return {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu",
            "PYTHONUNBUFFERED": "1"}


def _tails(logs: list[Path], chars: int = 3000) -> str:
    parts = []
    for i, log in enumerate(logs):
        text = log.read_text(errors="replace") if log.exists() else "(no log)"
        parts.append(f"---- process {i}: {log} (last {chars} characters) ----\n{text[-chars:]}")
    return "\n".join(parts)


@contextlib.contextmanager
def _processes(cmds: list[list[str]], logs: list[Path]) -> Iterator[list[subprocess.Popen]]:
    """Start every command (stdout and stderr into its log); kill those still running on exit."""
    procs: list[subprocess.Popen] = []
    try:
        for cmd, log in zip(cmds, logs):
            with open(log, "w") as out:
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT))
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)


def _wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout: float) -> None:
    """Until every process exits 0; fails (the caller's _processes kills the rest) as soon as one
    exits otherwise, or at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            pytest.fail(f"process(es) exited with {bad} (the others are killed)\n{_tails(logs)}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"no exit within {timeout:.0f} s (return codes so far {codes}; a collective waiting for a "
                        f"peer?); killing both\n{_tails(logs)}")
        time.sleep(0.5)


def _results(log: Path) -> dict[str, dict]:
    out = {}
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("RESULT "):
            _, phase, payload = line.split(" ", 2)
            out[phase] = json.loads(payload)
    return out


# -- the reference: one process, one device (this one) --------------------------------------------
@pytest.fixture(scope="module")
def reference(llama_dir):
    """The worker's phases in this process, without a coordinator, and its LLM for the served checks."""
    llm = worker.build({"model": llama_dir})
    res: dict[str, dict] = {}
    worker.run(llm, lambda phase, **payload: res.__setitem__(phase, json.loads(json.dumps(payload))))
    return llm, res


# -- offline: the same script on both processes ----------------------------------------------------
@pytest.fixture(scope="module")
def offline_pair(llama_dir, tmp_path_factory) -> list[dict[str, dict]]:
    folder = tmp_path_factory.mktemp("multihost-offline")
    coordinator = f"127.0.0.1:{free_port()}"
    logs = [folder / f"process{i}.log" for i in range(2)]
    cmds = [[sys.executable, str(HERE / "multihost_worker.py"),
             json.dumps({"model": llama_dir, "coordinator": coordinator, "process_id": i})] for i in range(2)]
    with _processes(cmds, logs) as procs:
        _wait_all(procs, logs, DEADLINE)
    return [_results(log) for log in logs]


def test_two_processes_generate_what_one_process_does(offline_pair, reference):
    _, ref = reference
    lead, follow = offline_pair
    for i, res in enumerate(offline_pair):
        assert set(res) == {"init", "batch1", "batch2", "abort", "stop"}, res.keys()
        assert res["init"] == {"process_index": i, "process_count": 2, "device_count": 2, "local_device_count": 1,
                               "engine_devices": 2}
    assert ref["init"]["engine_devices"] == 1 and ref["init"]["process_count"] == 1

    # batch 1: chunked prefill (a prompt longer than the step's 32 tokens), preemption (recompute)
    b1 = ref["batch1"]
    assert max(b1["prompt_lens"]) > worker.ENGINE["max_num_batched_tokens"]
    assert b1["preemptions"] > 0, "the pool is meant to be small enough to preempt"
    assert len({t for toks in b1["tokens"] for t in toks}) > 8, "degenerate outputs would prove nothing"
    assert lead["batch1"] == follow["batch1"]  # tokens, ids, preemptions: the follower ran the same schedule
    assert lead["batch1"] == b1
    assert all(b1["finished"]) and not b1["unfinished"]

    # batch 2: the followers' generate() returned after batch 1 and followed the next one; the sampled
    # request's seed is the one the leader drew (the reference draws the same from the same engine seed)
    assert lead["batch2"] == follow["batch2"] == ref["batch2"]
    assert lead["batch2"]["ids"] == [str(i) for i in range(6, 10)]
    assert len(ref["batch2"]["tokens"][-1]) == 12  # the sampled one

    # an abort between steps reaches the follower before the step it precedes
    ab = ref["abort"]
    assert lead["abort"] == follow["abort"] == ab
    assert 0 < len(ab["tokens"][worker.ABORTED]) < 16
    assert all(len(t) == 16 for rid, t in ab["tokens"].items() if rid != worker.ABORTED)
    assert not follow["abort"]["unfinished"]

    assert follow["stop"] == {"added": [], "outputs": 0}  # follow() returned on the leader's shutdown()


# -- served: `jaxsched serve` as both processes -----------------------------------------------------
def _serve_cmd(model: str, port: int, coordinator: str, process_id: int) -> list[str]:
    return [sys.executable, "-m", "serving.cli", "serve", model, "--port", str(port), "--served-model-name", "tiny",
            "--tensor-parallel-size", "2", "--distributed-coordinator", coordinator, "--num-processes", "2",
            "--process-id", str(process_id), "--max-model-len", "256", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "32", "--block-size", "16", "--attention-backend", "xla",
            # the offline pair's pool, so that warm-up finds its programs in the compilation cache
            "--num-gpu-blocks-override", str(worker.ENGINE["num_gpu_blocks_override"])]


def test_process_0_serves_process_1_follows_and_exits_with_it(llama_dir, reference, tmp_path):
    from jaxsched import SamplingParams

    llm, _ = reference
    prompts = [worker.PROMPTS[0], worker.PROMPTS[1]]  # the second: a chunked prefill
    want = [o.outputs[0].text for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)]
    messages = [{"role": "user", "content": "what is a cat ?"}]
    want_chat = llm.chat(messages, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].text

    port, coordinator = free_port(), f"127.0.0.1:{free_port()}"
    url = f"http://127.0.0.1:{port}"
    logs = [tmp_path / f"serve{i}.log" for i in range(2)]
    with _processes([_serve_cmd(llama_dir, port, coordinator, i) for i in range(2)], logs) as (lead, follow):
        try:
            wait_healthy(lead, url, logs[0], timeout=DEADLINE)
        except AssertionError as e:
            pytest.fail(f"{e}\n{_tails(logs)}")
        assert follow.poll() is None, _tails(logs)
        try:  # the first step also waits for process 1 to finish its warm-up
            r = httpx.post(url + "/v1/completions", timeout=DEADLINE, json={
                "model": "tiny", "prompt": prompts, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            c = httpx.post(url + "/v1/chat/completions", timeout=120, json={
                "model": "tiny", "messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True})
        except httpx.HTTPError as e:
            pytest.fail(f"{type(e).__name__}: {e}\n{_tails(logs)}")
        assert r.status_code == 200, f"{r.text}\n{_tails(logs)}"
        body = r.json()
        assert [ch["text"] for ch in sorted(body["choices"], key=lambda ch: ch["index"])] == want
        assert body["usage"]["completion_tokens"] == 16
        assert c.status_code == 200, f"{c.text}\n{_tails(logs)}"
        assert c.json()["choices"][0]["message"]["content"] == want_chat
        assert c.json()["usage"]["completion_tokens"] == 5

        t0 = time.monotonic()
        lead.send_signal(STOP_SIGNAL)
        try:
            follow_rc = follow.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"process 1 still runs 30 s after process 0 was stopped\n{_tails(logs)}")
        took = time.monotonic() - t0
        try:
            lead_rc = lead.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"process 0 still runs 30 s after its {STOP_SIGNAL.name}\n{_tails(logs)}")
    assert follow_rc == 0, f"process 1 exited with {follow_rc}\n{_tails(logs)}"
    # ended by the re-raised SIGTERM, after serve()'s on_exit published "stop"
    assert lead_rc in (0, -STOP_SIGNAL), f"process 0 exited with {lead_rc}\n{_tails(logs)}"
    text = logs[1].read_text(errors="replace")
    assert "follows process 0" in text and "Traceback" not in text, _tails(logs)
    assert took < 30
