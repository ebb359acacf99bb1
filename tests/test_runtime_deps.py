"""`jaxsched generate` and `jaxsched serve` as processes.

They need only the runtime dependencies: both run on a GGUF file (tokenizer and chat template from
its metadata) in a subprocess where every test-only distribution (torch, pytest, openai, ...) is
hidden as if not installed (runtime_only.py), which is what `make serve` meets on a fresh machine.
And the server exits on SIGTERM within its --shutdown-timeout plus a few seconds, even while a
client that stopped reading holds a stream open."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import tiny_gguf
from servers import free_port, wait_healthy

HERE = os.path.dirname(__file__)
RUNTIME_ONLY = [sys.executable, os.path.join(HERE, "runtime_only.py")]
SHUTDOWN_TIMEOUT = 3
ENGINE_FLAGS = ["--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                "--block-size", "8", "--gpu-memory-utilization", "0.05"]


@pytest.fixture(scope="module")
def tiny_llama_gguf(model_dirs, tmp_path_factory) -> str:
    return tiny_gguf.write_llama_gguf(str(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"), model_dirs["llama"])


def test_the_guard_hides_test_only_packages(tmp_path):
    (tmp_path / "uses_torch.py").write_text("import torch\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    res = subprocess.run([*RUNTIME_ONLY, "uses_torch"], capture_output=True, text=True, timeout=120, env=env,
                         check=False)
    assert res.returncode != 0
    assert "No module named 'torch'" in res.stderr, res.stderr[-2000:]
    hidden = res.stderr.split("runtime_only: hiding", 1)[1].splitlines()[0].strip().split(", ")
    assert {"pytest", "openai", "hypothesis"} <= set(hidden)  # torch too, where it is installed


def test_generate_runs_without_test_dependencies(tiny_llama_gguf):
    res = subprocess.run([*RUNTIME_ONLY, "serving.cli", "--log-level", "WARNING", "generate", tiny_llama_gguf,
                          "--prompt", "what is a cat ?", "--max-tokens", "6", *ENGINE_FLAGS],
                         capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    assert ">>> what is a cat ?" in res.stdout
    assert re.search(r"\[[1-6] tokens in [0-9.]+ s", res.stderr), res.stderr[-2000:]  # up to max_tokens, or EOS


@pytest.fixture(scope="module")
def served(tiny_llama_gguf, tmp_path_factory):
    """`jaxsched serve` on the tiny GGUF, runtime dependencies only, with a 3 s shutdown deadline."""
    port, grpc_port = free_port(), free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*RUNTIME_ONLY, "serving.cli", "serve", tiny_llama_gguf, "--port", str(port),
                                 "--grpc-port", str(grpc_port), "--served-model-name", "tiny",
                                 "--shutdown-timeout", str(SHUTDOWN_TIMEOUT), *ENGINE_FLAGS],
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log)
        yield proc, url, log, f"127.0.0.1:{grpc_port}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_runs_without_test_dependencies(served):
    _, url, log, _ = served
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "what is a cat ?"}], "max_tokens": 5,
        "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 5
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert "runtime_only: hiding" in log.read_text()


def test_grpc_serves_beside_http_without_test_dependencies(served):
    import grpc

    from jaxsched.proto import jaxsched_pb2 as pb
    from jaxsched.proto import jaxsched_pb2_grpc as pb_grpc

    *_, target = served
    with grpc.insecure_channel(target) as channel:
        msgs = list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
            text="what is a cat ?", sampling_params=pb.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)),
            timeout=60))
    assert sum(len(o.token_ids) for m in msgs for o in m.outputs) == 5 and msgs[-1].finished


def test_sigterm_exits_within_the_deadline_despite_a_stalled_stream(served):
    """Runs last in this module: it ends the server. A gRPC stream that is never read holds on too."""
    import grpc

    from jaxsched.proto import jaxsched_pb2 as pb
    from jaxsched.proto import jaxsched_pb2_grpc as pb_grpc

    proc, url, log, target = served
    # no BDP probing: the flow-control window stays at 64 KiB, so the unread stream stalls the
    # server's writes (with probing, a fast machine can take the whole stream into the client's
    # buffer before SIGTERM, and nothing is left to end)
    channel = grpc.insecure_channel(target, options=[("grpc.http2.bdp_probe", 0)])
    unread = pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
        text="one two", return_text=True, sampling_params=pb.SamplingParams(
            max_tokens=100, n=128, ignore_eos=True, logprobs=5)), timeout=120)
    port = int(url.rsplit(":", 1)[1])
    # a client that asks for a large stream and never reads it (a small receive buffer fills fast)
    with socket.socket() as stalled:
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(("127.0.0.1", port))
        body = json.dumps({"model": "tiny", "prompt": "one two", "max_tokens": 100, "n": 128, "stream": True,
                           "ignore_eos": True, "logprobs": 5}).encode()  # megabytes of events, 4 rows at a time
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        # the server is now blocked writing to it (the engine may be done with its request: the
        # stream holds the rest, merged; "shutdown deadline" below says it was still open)
        time.sleep(3)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(SHUTDOWN_TIMEOUT + 5)
        took = time.monotonic() - t0
    text = log.read_text()
    assert took < SHUTDOWN_TIMEOUT + 5, text[-3000:]
    assert "shutdown deadline" in text and "Traceback" not in text, text[-3000:]
    with pytest.raises(grpc.RpcError):  # the unread gRPC stream was ended, not left hanging
        for _ in unread:
            pass
    channel.close()
