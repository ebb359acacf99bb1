"""The runtime paths need only the runtime dependencies: `jaxsched generate` and `jaxsched serve` on a
GGUF file (tokenizer and chat template from its metadata) run in a subprocess where every
test-only distribution (torch, pytest, openai, ...) is hidden as if not installed (runtime_only.py).
This is what `make serve` meets on a fresh machine, where only the runtime dependencies are installed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest
import tiny_gguf
from servers import free_port, wait_healthy

HERE = os.path.dirname(__file__)
RUNTIME_ONLY = [sys.executable, os.path.join(HERE, "runtime_only.py")]
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
    assert "[6 tokens in" in res.stderr or "tokens in" in res.stderr


def test_serve_runs_without_test_dependencies(tiny_llama_gguf, tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115 - read after the process ends
    proc = subprocess.Popen([*RUNTIME_ONLY, "serving.cli", "serve", tiny_llama_gguf, "--port", str(port),
                             "--served-model-name", "tiny", *ENGINE_FLAGS], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, tmp_path / "serve.log")
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "what is a cat ?"}], "max_tokens": 5,
            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 5
        assert body["choices"][0]["message"]["role"] == "assistant"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = (tmp_path / "serve.log").read_text()
    assert "runtime_only: hiding" in text and "Traceback" not in text, text[-3000:]
