"""An engine core in a process of its own (engine_core_process=True): the outputs of the in-process
core, msgspec over ZeroMQ in between, and a core that dies is seen at once.

  offline  LLM(..., engine_core_process=True) gives the in-process engine's outputs (greedy, n > 1
           with logprobs, a stop string, a seeded sample), its utilities answer, bad input is
           refused before anything reaches the core
  served   `jaxsched serve --engine-core-process` with streams in flight: the core process killed
           with SIGKILL; every stream ends with an error event and [DONE], and the server exits
           non-zero within 10 s
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from servers import free_port, wait_healthy

from jaxsched import LLM, SamplingParams
from jaxsched.core.stats import EngineStats
from jaxsched.engine.core_messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    LogprobArrays,
    encoder,
    input_decoder,
    output_decoder,
)
from jaxsched.errors import InvalidRequestError
from jaxsched.structured.params import StructuredOutputsParams

ENGINE = {"max_model_len": 96, "max_num_seqs": 8, "max_num_batched_tokens": 32, "block_size": 8}
PROMPTS = ["the capital of france is", "hello world , how are you", "one two three", "what is a cat ?"]
ROOT = Path(__file__).parent.parent


def test_messages_round_trip_through_msgpack():
    """What crosses the process boundary: a request with its SamplingParams (a structured output
    included) and a step's outputs with numpy logprob arrays, decoded as they were sent."""
    import numpy as np

    sp = SamplingParams(n=2, temperature=0.5, stop=["x"], logit_bias={3: 1.5}, max_tokens=7, seed=-5,
                        structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    req = EngineCoreRequest("r", [1, 2, 3], sp, 12.5, priority=-3, sample_seed=9, cache_salt=2**63)
    got = input_decoder().decode(encoder().encode(req))
    assert isinstance(got, EngineCoreRequest) and got.sampling_params == sp
    assert (got.request_id, got.prompt_token_ids, got.arrival_time, got.priority, got.sample_seed, got.cache_salt) == \
        ("r", [1, 2, 3], 12.5, -3, 9, 2**63)
    lp = LogprobArrays(np.array([-0.5], np.float32), np.array([2], np.int32), np.array([[4, 5]], np.int32),
                       np.array([[-0.1, -0.7]], np.float32))
    outs = EngineCoreOutputs([EngineCoreOutput("r", [4], lp, finish_reason="stop", stop_reason=4)],
                             EngineStats(num_steps=3, step_seconds=0.25))
    back = output_decoder().decode(encoder().encode(outs))
    o = back.outputs[0]
    assert (o.request_id, o.new_token_ids, o.finish_reason, o.stop_reason) == ("r", [4], "stop", 4)
    assert o.logprobs.top_ids.tolist() == [[4, 5]] and o.logprobs.top_logprobs.dtype == np.float32
    assert back.stats.num_steps == 3 and back.stats.step_seconds == 0.25


@pytest.fixture(scope="module")
def pair(llama_dir):
    here = LLM(llama_dir, **ENGINE)
    there = LLM(llama_dir, **ENGINE, engine_core_process=True)
    yield here, there
    there.llm_engine.shutdown()


def test_a_core_process_gives_the_in_process_outputs(pair):
    here, there = pair
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=8, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, stop=["e"]),
              SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)]  # its seed drawn by the front end

    def view(outs):
        return [[(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason,
                  [{t: round(lp.logprob, 4) for t, lp in e.items()} for e in c.logprobs or ()]) for c in o.outputs]
                for o in outs]

    a = view(here.generate(PROMPTS, params, use_tqdm=False))
    b = view(there.generate(PROMPTS, params, use_tqdm=False))
    assert a == b
    assert pair[1].llm_engine.client.process.is_alive()


def test_a_core_process_answers_utilities_and_refuses_bad_input_up_front(pair):
    _, there = pair
    eng = there.llm_engine
    assert eng.stats().num_steps > 0  # the core's figures come with its outputs
    assert eng.client.call_utility("reset_prefix_cache") == [None]
    assert eng.client.call_utility("take_cost_errors") == [[]]
    with pytest.raises(RuntimeError, match="unknown engine core utility"):
        eng.client.call_utility("shutdown_everything")
    with pytest.raises(InvalidRequestError, match="max_model_len") as e:
        eng.add_request("too-long", {"prompt_token_ids": [5] * 200})
    assert e.value.param == "prompt" and not eng.has_unfinished_requests()


def _serve(model: str, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "serving.cli", "serve", model, "--port", str(port), "--served-model-name", "tiny",
           "--max-model-len", "96", "--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--block-size", "8",
           "--engine-core-process", "--shutdown-timeout", "3"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def _core_pid(server: subprocess.Popen) -> int:
    """The server's child named jaxsched-core0 (the core process names itself)."""
    for _ in range(100):
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            if comm == "jaxsched-core0" and int(stat.rsplit(")", 1)[1].split()[1]) == server.pid:
                return int(pid)
        time.sleep(0.1)
    raise AssertionError("no jaxsched-core0 child of the server")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the core process through /proc")
def test_a_killed_core_process_ends_every_stream_and_the_server(llama_dir, tmp_path):
    port, log = free_port(), tmp_path / "serve.log"
    server = _serve(llama_dir, port, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, url, log)
        core = _core_pid(server)

        async def stream(client: httpx.AsyncClient, i: int) -> list[str]:
            body = {"model": "tiny", "prompt": PROMPTS[i % 4], "max_tokens": 60, "ignore_eos": True, "stream": True}
            events = []
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 3 and i == 0:
                            killed.append(time.monotonic())
                            os.kill(core, signal.SIGKILL)  # mid-stream: every stream has tokens by now
            return events

        async def main():
            async with httpx.AsyncClient(timeout=30) as client:
                return await asyncio.gather(*(stream(client, i) for i in range(4)))

        killed: list[float] = []
        results = asyncio.run(main())
        for events in results:
            assert events[-1] == "[DONE]", events[-3:]
            err = json.loads(events[-2])["error"]
            assert "engine core process died (signal SIGKILL)" in err["message"] and err["code"] == "engine_dead"
        code = server.wait(max(0.1, 10 - (time.monotonic() - killed[0])))  # TimeoutExpired past 10 s
        assert code != 0, log.read_text()[-2000:]
        assert "the engine is gone" in log.read_text()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
