"""The OpenAI-compatible server over a real socket: the official `openai` client for the OpenAI
routes, httpx for the rest and for hostile input. One uvicorn server per module, on a tiny model."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from servers import uvicorn_thread

from jaxsched import LLM, SamplingParams
from serving.app import build_app
from serving.async_engine import AsyncEngine

ENGINE = {"max_model_len": 128, "max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 8}
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["the capital of france is", "hello world , how are you", "one two three four", "what is a cat ?"]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a cat ?"}]
MAX_REQUEST_BYTES = 64 * 1024


class Server:
    def __init__(self, url: str, engine: AsyncEngine, refs: dict) -> None:
        self.url, self.engine, self.refs = url, engine, refs
        self.client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def server(llama_dir):
    llm = LLM(llama_dir, **ENGINE)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    refs = {  # computed offline before the engine thread takes the engine over
        "completions": [o.outputs[0].text for o in llm.generate(PROMPTS, greedy, use_tqdm=False)],
        "long": [o.outputs[0].text for o in llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)],
        "chat": llm.chat(CHAT, greedy, use_tqdm=False)[0].outputs[0].text,
        "prompt_lens": [len(llm.get_tokenizer().encode(p)) for p in PROMPTS],
    }
    engine = AsyncEngine(llm.llm_engine)
    app = build_app(engine, served_model_name="tiny", api_key=KEY, max_request_bytes=MAX_REQUEST_BYTES)
    with uvicorn_thread(app) as url:
        yield Server(url, engine, refs)
    engine.shutdown()


def owned_blocks(engine: AsyncEngine) -> dict:
    return asyncio.run(engine.call(lambda eng: dict(eng.block_manager.req_blocks)))[0]


def greedy_extra(**kw):
    return {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True, **kw}}


def test_completions_greedy_equal_offline_generate(server):
    r = server.client.completions.create(model="tiny", prompt=PROMPTS, **greedy_extra())
    assert r.object == "text_completion" and r.model == "tiny"
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == server.refs["completions"]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.prompt_tokens == sum(server.refs["prompt_lens"]) and r.usage.completion_tokens == 48
    assert r.usage.total_tokens == r.usage.prompt_tokens + 48
    texts = [""] * 4
    finish = [None] * 4
    for chunk in server.client.completions.create(model="tiny", prompt=PROMPTS, stream=True, **greedy_extra()):
        assert chunk.object == "text_completion"
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = finish[c.index] or c.finish_reason
    assert texts == server.refs["completions"] and finish == ["length"] * 4


def test_chat_greedy_equals_offline_chat_streaming_or_not(server):
    r = server.client.chat.completions.create(model="tiny", messages=CHAT, **greedy_extra())
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == server.refs["chat"] and r.choices[0].finish_reason == "length"
    chunks = list(server.client.chat.completions.create(
        model="tiny", messages=CHAT, stream=True, stream_options={"include_usage": True}, **greedy_extra()))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == server.refs["chat"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    # content given as a list of text parts is the same prompt
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in CHAT]
    again = server.client.chat.completions.create(model="tiny", messages=parts, **greedy_extra())
    assert again.choices[0].message.content == server.refs["chat"]


def test_n_2_gives_two_choices_per_prompt(server):
    r = server.client.completions.create(model="tiny", prompt=PROMPTS[:2], n=2, temperature=1.0, seed=3,
                                         max_tokens=8, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in r.choices) and r.usage.completion_tokens == 32
    got: dict[int, str] = {}
    for chunk in server.client.chat.completions.create(model="tiny", messages=CHAT, n=2, stream=True,
                                                       temperature=1.0, seed=5, max_tokens=8):
        for c in chunk.choices:
            got[c.index] = got.get(c.index, "") + (c.delta.content or "")
    assert sorted(got) == [0, 1]


def test_logprobs(server):
    r = server.client.completions.create(model="tiny", prompt=PROMPTS[0], logprobs=3, **greedy_extra())
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) >= 3 and chosen <= 0 and abs(chosen - max(top.values())) < 1e-5  # greedy: the best
    c = server.client.chat.completions.create(model="tiny", messages=CHAT, logprobs=True, top_logprobs=2,
                                              **greedy_extra()).choices[0]
    assert len(c.logprobs.content) == 12
    for entry in c.logprobs.content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.token.startswith("bytes:") or bytes(entry.bytes).decode() == entry.token


def test_stop_strings_are_cut_streaming_or_not(server):
    full = server.refs["completions"][1]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    want = full[: full.index(stop)]
    r = server.client.completions.create(model="tiny", prompt=PROMPTS[1], stop=[stop], **greedy_extra())
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = list(server.client.completions.create(model="tiny", prompt=PROMPTS[1], stop=stop, stream=True,
                                                     **greedy_extra()))
    assert "".join(c.choices[0].text for c in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seed_reproducibility(server):
    def run(seed):
        return server.client.completions.create(model="tiny", prompt=PROMPTS[2], temperature=1.0, seed=seed,
                                                max_tokens=16, extra_body={"ignore_eos": True}).choices[0].text

    assert run(7) == run(7)
    assert len({run(7), run(8), run(9)}) > 1


def test_other_routes(server):
    c = httpx.Client(base_url=server.url, timeout=30)
    models = server.client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert c.get("/health").status_code == 200
    assert c.get("/version").json()["version"]
    tok = c.post("/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert tok["count"] == server.refs["prompt_lens"][0] == len(tok["tokens"]) and tok["max_model_len"] == 128
    assert c.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == PROMPTS[0]
    chat_tok = c.post("/tokenize", json={"messages": CHAT}).json()
    assert chat_tok["count"] > tok["count"]


def _get_health(sock: socket.socket) -> bytes:
    """One GET /health on an open keep-alive connection: the response's head and body, b"" if the
    server had closed the connection."""
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _content_length(data):
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk
    return data


def _content_length(data: bytes) -> int:
    m = re.search(rb"content-length: *(\d+)", data, re.IGNORECASE)
    return int(m.group(1)) if m else 0


def test_an_idle_connection_outlives_the_clients_pool_expiry(server):
    # httpx (and the openai client on it) keep an idle connection for 5 s: a server that closed it at
    # the same moment could drop the request a client just sent on it. The server must keep it longer.
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        assert _get_health(sock).startswith(b"HTTP/1.1 200")
        time.sleep(httpx.Limits().keepalive_expiry + 0.5)
        assert _get_health(sock).startswith(b"HTTP/1.1 200")


def scrape(client: httpx.Client) -> dict[str, tuple[str, dict]]:
    """GET /metrics parsed: family name -> (type, {(sample name, sorted labels): value})."""
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: (f.type, {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples})
            for f in text_string_to_metric_families(r.text)}


def total(families: dict, family: str, sample: str) -> float:
    """The sum of a family's samples named `sample` (over their labels)."""
    return sum(v for (name, _), v in families.get(family, ("", {}))[1].items() if name == sample)


def test_metrics_move(server):
    c = httpx.Client(base_url=server.url, timeout=30)
    before = scrape(c)
    server.client.completions.create(model="tiny", prompt=PROMPTS[0], **greedy_extra())
    after = scrape(c)
    for family, sample, delta in [
            ("request_success", "request_success_total", 1), ("generation_tokens", "generation_tokens_total", 12),
            ("prompt_tokens", "prompt_tokens_total", server.refs["prompt_lens"][0]),
            ("time_to_first_token_seconds", "time_to_first_token_seconds_count", 1),
            ("e2e_request_latency_seconds", "e2e_request_latency_seconds_count", 1),
            ("inter_token_latency_seconds", "inter_token_latency_seconds_count", 11)]:
        family, sample = "jaxsched:" + family, "jaxsched:" + sample
        assert total(after, family, sample) - total(before, family, sample) == delta, sample
    assert after["jaxsched:request_success"][1][("jaxsched:request_success_total", (
        ("finished_reason", "length"), ("model_name", "tiny")))] >= 1
    for gauge in ("num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc"):
        kind, samples = after["jaxsched:" + gauge]
        assert kind == "gauge" and samples == {("jaxsched:" + gauge, (("model_name", "tiny"),)): 0.0}, gauge
    kind, samples = after["jaxsched:num_preemptions"]
    assert kind == "counter" and list(samples) == [("jaxsched:num_preemptions_total", (("model_name", "tiny"),))]
    steps = [total(m, "jaxsched:engine_step_seconds", "jaxsched:engine_step_seconds_total") for m in (before, after)]
    device = total(after, "jaxsched:engine_device_wait_seconds", "jaxsched:engine_device_wait_seconds_total")
    assert steps[1] > steps[0] and 0 < device <= steps[1]  # the engine thread's time in steps moved
    kind, samples = after["jaxsched:engine_host_seconds"]
    phases = {dict(labels)["phase"]: v for (name, labels), v in samples.items()}
    assert kind == "counter" and set(phases) == {"schedule", "pack", "launch", "update", "output"}
    assert all(v > 0 for v in phases.values()) and sum(phases.values()) < steps[1]
    host_steps = total(after, "jaxsched:engine_step_host_seconds", "jaxsched:engine_step_host_seconds_count")
    assert host_steps > total(before, "jaxsched:engine_step_host_seconds", "jaxsched:engine_step_host_seconds_count")
    for gauge in ("kv_cache_internal_waste_perc", "kv_cache_external_fragmentation_perc"):
        kind, samples = after["jaxsched:" + gauge]
        assert kind == "gauge" and samples == {("jaxsched:" + gauge, (("model_name", "tiny"),)): 0.0}, gauge
    kind, samples = after["jaxsched:request_queue_time_seconds"]
    assert kind == "histogram"
    assert ("jaxsched:request_queue_time_seconds_bucket", (("le", "+Inf"), ("model_name", "tiny"))) in samples


def _big(n):
    return {"model": "tiny", "prompt": "a" * n}


CMPL, CHATP = "/v1/completions", "/v1/chat/completions"
OK = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
MSG = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
HOSTILE = [  # (what, method, path, body (dict = JSON, bytes = raw), headers, status, param)
    ("bad JSON", "POST", CMPL, b"{not json", AUTH, 400, None),
    ("JSON array body", "POST", CMPL, b"[1, 2]", AUTH, 400, None),
    ("invalid UTF-8", "POST", CMPL, b'{"model": "tiny", "prompt": "\xff\xfe"}', AUTH, 400, None),
    ("missing prompt", "POST", CMPL, {"model": "tiny"}, AUTH, 400, "prompt"),
    ("missing messages", "POST", CHATP, {"model": "tiny"}, AUTH, 400, "messages"),
    ("max_tokens as a string", "POST", CMPL, {**OK, "max_tokens": "12"}, AUTH, 400, "max_tokens"),
    ("negative max_tokens", "POST", CMPL, {**OK, "max_tokens": -5}, AUTH, 400, "max_tokens"),
    ("huge max_tokens", "POST", CMPL, {**OK, "max_tokens": 10**6}, AUTH, 400, "max_tokens"),
    ("enormous max_tokens", "POST", CHATP, {**MSG, "max_completion_tokens": 10**30}, AUTH, 400, "max_tokens"),
    ("n = 0", "POST", CMPL, {**OK, "n": 0}, AUTH, 400, "n"),
    ("n = 10**6", "POST", CMPL, {**OK, "n": 10**6}, AUTH, 400, "n"),
    ("negative temperature", "POST", CMPL, {**OK, "temperature": -1}, AUTH, 400, "temperature"),
    ("temperature as text", "POST", CMPL, {**OK, "temperature": "hot"}, AUTH, 400, "temperature"),
    ("top_p = 0", "POST", CHATP, {**MSG, "top_p": 0}, AUTH, 400, "top_p"),
    ("presence_penalty = 5", "POST", CMPL, {**OK, "presence_penalty": 5}, AUTH, 400, "presence_penalty"),
    ("repetition_penalty = 0", "POST", CMPL, {**OK, "repetition_penalty": 0}, AUTH, 400, "repetition_penalty"),
    ("min_tokens > max_tokens", "POST", CMPL, {**OK, "min_tokens": 5}, AUTH, 400, "min_tokens"),
    ("stop as a number", "POST", CMPL, {**OK, "stop": 5}, AUTH, 400, "stop"),
    ("stop_token_ids negative", "POST", CMPL, {**OK, "stop_token_ids": [-1]}, AUTH, 400, "stop_token_ids"),
    ("too many logprobs", "POST", CMPL, {**OK, "logprobs": 100}, AUTH, 400, "logprobs"),
    ("top_logprobs without logprobs", "POST", CHATP, {**MSG, "top_logprobs": 2}, AUTH, 400, "top_logprobs"),
    ("logit_bias key not a token id", "POST", CMPL, {**OK, "logit_bias": {"abc": 1.0}}, AUTH, 400, "logit_bias"),
    ("logit_bias out of range", "POST", CMPL, {**OK, "logit_bias": {"5": 1000}}, AUTH, 400, "logit_bias"),
    ("logit_bias beyond the vocabulary", "POST", CMPL, {**OK, "logit_bias": {"99999": 1}}, AUTH, 400, "logit_bias"),
    ("refused field", "POST", CHATP, {**MSG, "use_beam_search": True}, AUTH, 400, "use_beam_search"),
    ("priority under fcfs", "POST", CMPL, {**OK, "priority": 1}, AUTH, 400, "priority"),
    ("bad regex", "POST", CMPL, {**OK, "structured_outputs": {"regex": "[a-"}}, AUTH, 400, "structured_outputs.regex"),
    ("priority as text", "POST", CMPL, {**OK, "priority": "high"}, AUTH, 400, "priority"),
    ("stream as text", "POST", CMPL, {**OK, "stream": "yes"}, AUTH, 400, "stream"),
    ("unknown model", "POST", CMPL, {**OK, "model": "gpt-9"}, AUTH, 404, "model"),
    ("empty prompt", "POST", CMPL, {**OK, "prompt": ""}, AUTH, 400, "prompt"),
    ("empty prompt list", "POST", CMPL, {**OK, "prompt": []}, AUTH, 400, "prompt"),
    ("mixed prompt list", "POST", CMPL, {**OK, "prompt": ["a", 1]}, AUTH, 400, "prompt"),
    ("token id out of range", "POST", CMPL, {**OK, "prompt": [10**6]}, AUTH, 400, "prompt"),
    ("prompt longer than max_model_len", "POST", CMPL, {**OK, "prompt": list(range(3, 203))}, AUTH, 400, "prompt"),
    ("empty messages", "POST", CHATP, {**MSG, "messages": []}, AUTH, 400, "messages"),
    ("messages not a list", "POST", CHATP, {**MSG, "messages": "hi"}, AUTH, 400, "messages"),
    ("message without role", "POST", CHATP, {**MSG, "messages": [{"content": "hi"}]}, AUTH, 400, "messages"),
    ("image content part", "POST", CHATP, {**MSG, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, AUTH, 400, "messages"),
    ("oversized body", "POST", CMPL, _big(MAX_REQUEST_BYTES + 10), AUTH, 413, None),
    ("missing API key", "POST", CMPL, OK, {}, 401, None),
    ("wrong API key", "POST", CHATP, MSG, {"Authorization": "Bearer nope"}, 401, None),
    ("API key on the models route too", "GET", "/v1/models", None, {}, 401, None),
    ("unknown route", "POST", "/v1/edits", OK, AUTH, 404, None),
    ("wrong method", "GET", CMPL, None, AUTH, 405, None),
    ("detokenize out of range", "POST", "/detokenize", {"tokens": [10**6]}, {}, 400, "tokens"),
    ("tokenize with nothing", "POST", "/tokenize", {}, {}, 400, "prompt"),
    ("unknown fields are ignored, as vLLM does", "POST", CMPL, {**OK, "frobnicate": 1, "tools": []}, AUTH, 200, None),
    ("JSON nulls mean the defaults", "POST", CMPL, {**OK, "n": None, "stream": None, "temperature": None,
                                                     "echo": None, "min_tokens": None}, AUTH, 200, None),
]


@pytest.mark.parametrize("what,method,path,body,headers,status,param", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_requests_get_openai_errors(server, what, method, path, body, headers, status, param):
    c = httpx.Client(base_url=server.url, timeout=30)
    kw = {"content": body} if isinstance(body, bytes) else ({"json": body} if body is not None else {})
    r = c.request(method, path, headers={**headers, "Content-Type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    if status == 200:
        assert r.json()["choices"][0]["text"] is not None
    else:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
        assert err["param"] == param, err
    if what == "prompt longer than max_model_len":
        assert "200 tokens" in err["message"] and "max_model_len is 128" in err["message"]
    if status == 401:
        assert r.headers["www-authenticate"] == "Bearer"


def test_server_still_serves_after_hostile_input(server):
    assert len(HOSTILE) >= 25
    r = server.client.completions.create(model="tiny", prompt=PROMPTS[0], **greedy_extra())
    assert r.choices[0].text == server.refs["completions"][0]


def test_a_full_queue_is_a_503_with_retry_after(llama_dir):
    engine = AsyncEngine(LLM(llama_dir, **ENGINE, max_num_queued_requests=1).llm_engine)
    gate = threading.Event()

    async def main(url):
        # Hold the engine thread, so that the first request stays queued while the second arrives.
        held = asyncio.ensure_future(engine.call(lambda eng: gate.wait(30)))
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=AUTH) as client:
            first = asyncio.ensure_future(client.post(CMPL, json=OK))
            while engine.num_queued < 1:
                await asyncio.sleep(0.01)
            second = await client.post(CMPL, json=OK)
            gate.set()
            await held
            return await first, second

    try:
        with uvicorn_thread(build_app(engine, served_model_name="tiny", api_key=KEY)) as url:
            first, second = asyncio.run(main(url))
    finally:
        gate.set()
        engine.shutdown()
    assert first.status_code == 200, first.text
    assert second.status_code == 503 and second.headers["retry-after"] == "1", second.text
    err = second.json()["error"]
    assert err["code"] == "server_overloaded" and "max_num_queued_requests is 1" in err["message"]


def test_64_streams_half_disconnect_rest_complete_and_blocks_free(server):
    body = {"model": "tiny", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}

    async def one(client, i):
        done = False
        text = ""
        # the half that walks away asks for more than it could get before its disconnect is seen
        extra = {"max_tokens": 128 - server.refs["prompt_lens"][i % 4]} if i % 2 else {}
        async with client.stream("POST", CMPL, json={**body, "prompt": PROMPTS[i % 4], **extra}) as r:
            assert r.status_code == 200
            n = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                text += json.loads(line[6:])["choices"][0]["text"]
                n += 1
                if i % 2 and n == 3:  # walk away midway
                    break
        return i, done, text

    async def main():
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120, limits=limits) as client:
            results = await asyncio.gather(*(one(client, i) for i in range(64)))
        deadline = time.monotonic() + 10
        while True:  # aborts land within an engine step of the server seeing the disconnect
            owned = (await server.engine.call(lambda eng: (dict(eng.block_manager.req_blocks),
                                                          eng.has_unfinished_requests())))[0]
            if owned == ({}, False) or time.monotonic() > deadline:
                return results, owned
            await asyncio.sleep(0.05)

    m = server.engine.metrics
    before = m.value("request_success_total", finished_reason="length"), m.value("generation_tokens_total")
    results, owned = asyncio.run(main())
    finished, generated = (m.value("request_success_total", finished_reason="length") - before[0],
                           m.value("generation_tokens_total") - before[1])
    # the abandoned half was aborted, not run to the end: 32 x 40 tokens plus some each for the rest
    assert finished == 32 and generated < 32 * 40 + 32 * 60, (finished, generated)
    for i, done, text in results:
        if i % 2 == 0:
            assert done and text == server.refs["long"][i % 4], i
        else:
            assert not done
    assert owned == ({}, False)
    used = asyncio.run(server.engine.call(lambda eng: eng.block_manager.stats().num_used_blocks))[0]
    assert used == 0


def test_non_streaming_client_that_leaves_is_aborted(server):
    m = server.engine.metrics
    before = m.value("generation_tokens_total"), m.value("request_success_total", finished_reason="length")

    def slow_down(eng):  # 5 ms a step, so that the client surely leaves first
        real = eng.runner.run
        eng.runner.run = lambda batch: (time.sleep(0.005), real(batch))[1]
        return real

    real = asyncio.run(server.engine.call(slow_down))[0]
    try:
        c = httpx.Client(base_url=server.url, headers=AUTH, timeout=0.1)
        with pytest.raises(httpx.TimeoutException):
            c.post(CMPL, json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 100, "ignore_eos": True})
    finally:
        asyncio.run(server.engine.call(lambda eng: setattr(eng.runner, "run", real)))
    deadline = time.monotonic() + 10
    while asyncio.run(server.engine.call(lambda eng: eng.has_unfinished_requests()))[0]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert owned_blocks(server.engine) == {}
    assert m.value("request_success_total", finished_reason="length") == before[1]  # aborted, not finished
    assert m.value("generation_tokens_total") - before[0] < 100


def test_unknown_fields_are_logged(server, caplog):
    with caplog.at_level("WARNING", logger="serving.app"):
        r = httpx.post(server.url + CHATP, headers=AUTH, json={**MSG, "frobnicate": True})
    assert r.status_code == 200
    assert "ignoring unknown fields ['frobnicate']" in caplog.text


def test_echo_and_vllm_extensions(server):
    r = server.client.completions.create(model="tiny", prompt=PROMPTS[0], echo=True,
                                         **greedy_extra(priority=0, top_k=5, min_p=0.01, min_tokens=2))
    assert r.choices[0].text == PROMPTS[0] + server.refs["completions"][0]
    chunks = list(server.client.completions.create(model="tiny", prompt=PROMPTS[0], echo=True, stream=True,
                                                   **greedy_extra()))
    assert "".join(c.choices[0].text for c in chunks) == PROMPTS[0] + server.refs["completions"][0]


def test_the_converter_checks_every_prompts_ids_on_its_worker_threads(tokenizer_dir):
    """Text and chat prompts' ids are checked against the model's vocabulary where they are made, on
    a tokenizer thread (a tokenizer may hold more tokens than the model has rows); id prompts too.
    The engine then takes them unchecked (test_engine.py: CheckedTokens)."""
    from transformers import AutoTokenizer

    from serving.convert import Converter
    from serving.protocol import ChatMessage, RequestError

    conv = Converter(AutoTokenizer.from_pretrained(tokenizer_dir), 64, 40, 5)  # ids of 40 and up: no row
    loop_thread = threading.get_ident()
    checked_on = []
    check = conv._check_ids
    conv._check_ids = lambda ids, param: (checked_on.append(threading.get_ident()), check(ids, param))[1]

    async def run():
        for make, param in ((conv.tokenize("the capital of france"), "prompt"),
                            (conv.chat_prompt([ChatMessage(role="user", content="the capital")]), "messages"),
                            (conv.completion_prompts([[1, 2, 99]]), "prompt")):
            with pytest.raises(RequestError) as e:
                await make
            assert e.value.param == param and "token ids must be integers in [0, 40)" in e.value.message
        assert await conv.completion_prompts([[1, 2, 39]]) == [([1, 2, 39], None)]

    asyncio.run(run())
    assert len(checked_on) == 4 and loop_thread not in checked_on
