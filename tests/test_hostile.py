"""One hostile request must never hurt anyone else: a fuzzer of random JSON bodies never gets a 5xx,
extreme integers never reach the device's arrays (and a request that still carries one fails alone),
request-supplied chat templates are refused, bodies must be JSON by media type, unknown roles are
refused, and tokenization stays off the event loop. (SIGTERM with a stalled client: test_runtime_deps.py.)"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servers import uvicorn_thread

from jaxsched import LLM, SamplingParams
from jaxsched.engine.core_messages import EngineCoreRequest
from serving.app import build_app
from serving.async_engine import AsyncEngine, EngineStepError

ENGINE = {"max_model_len": 64, "max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 8}
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
JSON = {"Content-Type": "application/json"}
PROMPTS = ["the capital of france is", "hello world , how are you", "one two three four", "what is a cat ?"]
LONG = "language models predict the next token from the previous tokens . jax runs on gpus and cpus ."  # shares no block with PROMPTS
EXTREME = [2**31, 2**63, 2**64, -(2**63) - 1, 10**30, -1]


class Server:
    def __init__(self, url: str, engine: AsyncEngine, app, refs: list[list[int]]) -> None:
        self.url, self.engine, self.app, self.refs = url, engine, app, refs
        self.http = httpx.Client(base_url=url, timeout=60, headers=JSON)

    def idle(self) -> tuple[dict, bool]:
        """(blocks still owned by requests, whether the engine has unfinished requests)."""
        return asyncio.run(self.engine.call(lambda e: (dict(e.block_manager.req_blocks), e.has_unfinished_requests())))[0]


@pytest.fixture(scope="module")
def server(llama_dir):
    llm = LLM(llama_dir, **ENGINE)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    refs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    engine = AsyncEngine(llm.llm_engine)
    app = build_app(engine, served_model_name="tiny")
    with uvicorn_thread(app) as url:
        yield Server(url, engine, app, refs)
    engine.shutdown()


def assert_openai_error(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"], err
    return err


# -- the fuzzer -----------------------------------------------------------------------------------
_ODD_TEXT = ["", "\x00", "\ud800", "\udfff\ud800", "\u202e\u200b", "🙂" * 1000, "é" * 100_000, "a" * 200_000,
             "<|im_start|>", "{{ 7 * 7 }}", "{% for x in range(10**9) %}x{% endfor %}"]
_SCALARS = st.one_of(
    st.none(), st.booleans(), st.sampled_from(EXTREME), st.integers(-3, 70),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e308, -1e308, 5e-324, 0.5]),
    st.sampled_from(_ODD_TEXT), st.text(max_size=20))


def _nested(depth: int):
    value = [0]
    for _ in range(depth):
        value = [value]
    return value


_VALUES = st.one_of(
    _SCALARS,
    st.lists(_SCALARS, max_size=6),
    st.dictionaries(st.text(max_size=8), _SCALARS, max_size=4),
    st.sampled_from([list(range(100_000)), [[1, 2], [3, -4]], _nested(50), {"a": _nested(30)}, [EXTREME] * 3]),
)
_FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "temperature", "top_p",
           "top_k", "min_p", "seed", "stop", "stop_token_ids", "logprobs", "top_logprobs", "presence_penalty",
           "frequency_penalty", "repetition_penalty", "min_tokens", "priority", "stream", "stream_options",
           "ignore_eos", "echo", "best_of", "logit_bias", "chat_template", "chat_template_kwargs",
           "add_generation_prompt", "skip_special_tokens", "user", "response_format"]
_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "wizard", ""]),
                                                             _SCALARS),
                                            "content": st.one_of(st.sampled_from(_ODD_TEXT), _VALUES)}),
                     max_size=3)
_BODIES = st.fixed_dictionaries(
    {"model": st.sampled_from(["tiny", None])},
    optional={
        **{f: _VALUES for f in _FIELDS if f not in ("model", "messages", "max_tokens", "stream")},
        "messages": st.one_of(_MESSAGES, _VALUES),
        # mostly small or invalid, so that accepted requests stay short
        "max_tokens": st.one_of(st.sampled_from([1, 2, 4, None, 0, -1, "4", 1.5]), st.sampled_from(EXTREME)),
        "stream": st.sampled_from([True, False, None, "yes"]),
    })
_RAW = st.sampled_from([b"[" * 100_000 + b"]" * 100_000, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                        b"{", b"null", b"1e999", b'{"prompt": "a", "n": 1e999}', b'{"prompt": NaN}',
                        b'{"prompt": "\xff"}', b"\x00" * 100, b'{"prompt": "a", "prompt": 5}', b""])


def _send(http: httpx.Client, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(path, content=body)
    return http.post(path, content=json.dumps(body, allow_nan=True).encode())


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(path=st.sampled_from([CMPL, CHAT]), body=st.one_of(_BODIES, _RAW))
def _fuzz(server: Server, path: str, body) -> None:
    r = _send(server.http, path, body)
    assert r.status_code < 500, (body if isinstance(body, bytes) else json.dumps(body)[:500], r.text[:500])
    if r.status_code != 200:
        assert_openai_error(r)


def test_fuzzed_bodies_get_200_or_an_openai_4xx_and_leave_nothing_behind(server):
    _fuzz(server)
    deadline = time.monotonic() + 10
    while server.idle() != ({}, False):  # streams whose clients left are aborted within a step
        assert time.monotonic() < deadline, server.idle()
        time.sleep(0.05)
    r = server.http.post(CMPL, json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0,
                                     "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20


# -- extreme integers -----------------------------------------------------------------------------
def _extreme_body(value: int) -> dict:
    return {"model": "tiny", "prompt": [value, value], "max_tokens": value, "n": value, "top_k": value,
            "seed": value, "logprobs": value, "min_tokens": value, "priority": value, "stop_token_ids": [value],
            "best_of": value}


def _stream_text(url: str, prompt: str) -> str:
    """A streamed greedy completion's text; fails on an error event."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text = ""
    with httpx.stream("POST", url + CMPL, json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += chunk["choices"][0]["text"]
    return text


_INT_FIELDS = ["prompt", "max_tokens", "n", "top_k", "seed", "logprobs", "min_tokens", "priority", "stop_token_ids"]


def _expected(field: str, value: int) -> tuple[int, str | None]:
    """(status, param) for a valid completion request with `value` in `field`."""
    # priority: this server schedules fcfs, where any priority but 0 is refused (not ignored)
    accepted = {"top_k": value >= -1,  # beyond the vocabulary, or -1: off
                "seed": -(2**63) <= value < 2**64, "priority": value == 0}
    return (200, None) if accepted.get(field, False) else (400, field)


def _field_body(field: str, value: int) -> dict:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    body[field] = [value] if field in ("prompt", "stop_token_ids") else value
    return body


@pytest.mark.parametrize("value", EXTREME)
def test_an_extreme_integer_in_every_field_is_a_400_and_four_streams_complete(server, value):
    want = [server.http.post(CMPL, json={"model": "tiny", "prompt": p, "max_tokens": 20, "temperature": 0,
                                         "ignore_eos": True}).json()["choices"][0]["text"] for p in PROMPTS]
    results: list = [None] * 4

    def run(i: int) -> None:
        results[i] = _stream_text(server.url, PROMPTS[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for path, body in ((CMPL, _extreme_body(value)),
                       (CHAT, {**_extreme_body(value), "prompt": None, "messages": [{"role": "user", "content": "x"}],
                               "top_logprobs": value, "max_completion_tokens": value})):
        r = server.http.post(path, json=body)
        assert r.status_code == 400, r.text
        assert_openai_error(r)
    for field in _INT_FIELDS:  # and each field alone, in an otherwise valid request: its own check answers
        status, param = _expected(field, value)
        r = server.http.post(CMPL, json=_field_body(field, value))
        assert r.status_code == status, (field, r.text)
        if status != 200:
            assert assert_openai_error(r)["param"] == param, (field, r.text)
    r = server.http.post(CHAT, json={**CHAT_OK, "logprobs": True, "top_logprobs": value})
    assert r.status_code == 400 and assert_openai_error(r)["param"] == "top_logprobs", r.text
    for t in threads:
        t.join(60)
    assert results == want


def test_stop_token_ids_beyond_the_vocabulary_are_a_400(server):
    r = server.http.post(CMPL, json=_field_body("stop_token_ids", 10**6))
    assert r.status_code == 400 and assert_openai_error(r)["param"] == "stop_token_ids", r.text


def test_one_request_queues_at_most_2048_sequences(server):
    r = server.http.post(CMPL, json={"model": "tiny", "prompt": [[1]] * 3000, "max_tokens": 1})
    assert r.status_code == 400 and assert_openai_error(r)["param"] == "prompt", r.text
    r = server.http.post(CMPL, json={"model": "tiny", "prompt": [[1]] * 20, "n": 128, "max_tokens": 1})
    assert r.status_code == 400 and assert_openai_error(r)["param"] == "n", r.text
    assert server.idle() == ({}, False)


def test_top_k_beyond_the_vocabulary_means_off(llama_dir):
    llm = LLM(llama_dir, **ENGINE)
    params = {"temperature": 1.0, "seed": 7, "max_tokens": 8, "ignore_eos": True}
    huge = llm.generate(PROMPTS[:2], SamplingParams(top_k=2**64, **params), use_tqdm=False)
    off = llm.generate(PROMPTS[:2], SamplingParams(top_k=0, **params), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in huge] == [o.outputs[0].token_ids for o in off]


def _smuggle(req, **values) -> None:
    """Give an accepted request values that make_request would have refused (a bug elsewhere, or a
    Request built by hand), to check the step's own guard."""
    sp = req.sampling_params
    for k, v in values.items():
        if k == "sample_seed":  # the per-request seed the packer writes, not a SamplingParams field
            req.sample_seed = v
        else:
            object.__setattr__(sp, k, v)
    if values.get("min_tokens"):
        object.__setattr__(sp, "_uses_penalties", True)


@pytest.mark.parametrize("bad", [{"top_k": 2**40}, {"logprobs": 2**33}, {"stop_token_ids": (2**35,), "min_tokens": 3},
                                 {"sample_seed": 2**45}], ids=["top_k", "logprobs", "stop_token_ids", "seed"])
def test_a_row_the_step_cannot_store_fails_alone(llama_dir, bad):
    llm = LLM(llama_dir, **ENGINE)
    eng = llm.llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate([*PROMPTS, LONG], greedy, use_tqdm=False)]
    assert len(eng.tokenize_prompt(LONG)[0]) >= 2 * ENGINE["block_size"]  # fills blocks it registers
    eng.core.block_manager.reset_prefix_cache()  # nothing of LONG cached: the victim registers its own blocks
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"ok{i}", p, greedy)
    victim = eng.make_request("bad", LONG, SamplingParams(temperature=0, max_tokens=10, n=2, ignore_eos=True))
    eng.add_request_obj(victim)
    samples = [r for r in eng.core.scheduler.requests.values() if r.group_id == "bad"]
    for r in samples:  # both samples (they share their SamplingParams)
        _smuggle(r, **bad)
    finals = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                finals[o.request_id] = o
    assert [finals[f"ok{i}"].outputs[0].token_ids for i in range(4)] == want[:4]
    failed = finals["bad"]
    assert [c.finish_reason for c in failed.outputs] == ["error", "error"]
    assert "does not fit the engine's int32 arrays" in failed.error
    assert eng.core.block_manager.num_free_blocks == eng.core.block_manager.num_usable_blocks
    # No block the failed row registered stays in the prefix cache (a row's token ids that did not
    # fit were written as 0, so its blocks' K/V need not match their hashes) ...
    assert samples[0].block_hashes and not set(samples[0].block_hashes) & set(eng.core.block_manager.cached)
    # ... and its prompt, sent again, generates what it did before
    again = llm.generate([LONG], greedy, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == want[4]


def test_a_row_the_step_cannot_store_fails_only_its_stream(server):
    async def main():
        eng = server.engine
        greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        streams = [await eng.add_request(p, greedy) for p in PROMPTS]
        for s in streams:  # each has a token: all four run
            await s.__anext__()

        def smuggle(e):  # straight into the core (the front end would refuse it): only the step's guard sees it
            e.add_request(EngineCoreRequest("smuggled", [5, 6, 7], SamplingParams(temperature=0, max_tokens=10),
                                            time.monotonic()))
            _smuggle(e.scheduler.requests["smuggled"], top_k=2**40)
            return len(e.scheduler.running)  # the four are mid-generation: the smuggled row joins their step

        running = (await eng.call(smuggle))[0]
        outs = [[o async for o in s][-1] for s in streams]
        return running, [o.outputs[0].token_ids for o in outs]

    running, outs = asyncio.run(main())
    assert running == 4 and outs == server.refs
    assert server.idle() == ({}, False)


def test_async_stream_of_a_failed_row_raises(server):
    async def main():
        eng = server.engine
        stream = await eng.add_request("one two", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        def smuggle(e):
            _smuggle(e.scheduler.requests[stream.request_id], top_k=2**40)
            # a running row's values are read when it is packed in full: steady decode steps reuse
            # the last step's (batch.BatchPacker._pack_steady; SamplingParams are frozen)
            e.runner.packer._steady = None

        await eng.call(smuggle)
        with pytest.raises(EngineStepError, match="does not fit"):
            async for _ in stream:
                pass

    asyncio.run(main())


# -- chat templates, media types, roles -----------------------------------------------------------
CHAT_OK = {"model": "tiny", "messages": [{"role": "user", "content": "what is a cat ?"}], "max_tokens": 2}
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.mark.parametrize("body", [{**CHAT_OK, "chat_template": TEMPLATE},
                                  {**CHAT_OK, "chat_template_kwargs": {"chat_template": TEMPLATE}}])
def test_request_chat_templates_are_refused_unless_trusted(server, body):
    r = server.http.post(CHAT, json=body)
    assert r.status_code == 400
    err = assert_openai_error(r)
    assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"]
    r = server.http.post("/tokenize", json={"messages": body["messages"], "chat_template": TEMPLATE})
    assert r.status_code == 400 and "--trust-request-chat-template" in r.json()["error"]["message"]


def test_chat_template_kwargs_cannot_set_the_renderer_arguments(server):
    r = server.http.post(CHAT, json={**CHAT_OK, "chat_template_kwargs": {"tokenize": False, "messages": []}})
    assert r.status_code == 400 and "messages, tokenize" in assert_openai_error(r)["message"]


@pytest.fixture(scope="module")
def trusting_server(llama_dir):
    engine = AsyncEngine(LLM(llama_dir, **ENGINE).llm_engine)
    with uvicorn_thread(build_app(engine, served_model_name="tiny", trust_request_chat_template=True)) as url:
        yield url
    engine.shutdown()


def test_a_trusted_request_template_renders_in_a_sandbox_with_a_length_bound(trusting_server):
    http = httpx.Client(base_url=trusting_server, timeout=60, headers=JSON)
    r = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hello world"}], "chat_template": TEMPLATE})
    assert r.status_code == 200
    assert r.json()["tokens"] == http.post("/tokenize", json={"prompt": "hello world",
                                                              "add_special_tokens": False}).json()["tokens"]
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    r = http.post(CHAT, json={**CHAT_OK, "chat_template": escape})
    assert r.status_code == 400 and "unsafe" in r.json()["error"]["message"]
    t0 = time.monotonic()
    huge = "{% for i in range(100000) %}{{ messages[0]['content'] * 20 }}{% endfor %}"
    r = http.post(CHAT, json={**CHAT_OK, "chat_template": huge})
    assert r.status_code == 400, r.text
    assert assert_openai_error(r)["code"] == "context_length_exceeded"
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
@pytest.mark.parametrize("path", [CMPL, CHAT, "/tokenize", "/detokenize"])
def test_post_bodies_must_be_json_by_media_type(server, path, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = httpx.post(server.url + path, content=json.dumps({**CHAT_OK, "prompt": "hi", "tokens": [1]}),
                   headers=headers, timeout=30)
    assert r.status_code == 415
    assert assert_openai_error(r)["code"] == "unsupported_media_type"


def test_json_with_a_charset_is_json(server):
    r = httpx.post(server.url + CMPL, content=json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1}),
                   headers={"Content-Type": "Application/JSON; charset=utf-8"}, timeout=30)
    assert r.status_code == 200


@pytest.mark.parametrize("role", ["wizard", "", "User", "model"])
def test_unknown_chat_roles_are_refused_naming_the_allowed_ones(server, role):
    r = server.http.post(CHAT, json={**CHAT_OK, "messages": [{"role": role, "content": "hi"}]})
    assert r.status_code == 400
    err = assert_openai_error(r)
    assert err["param"] == "messages"
    assert "system, developer, user, assistant, tool, function" in err["message"]


def test_a_prompt_too_long_for_max_model_len_is_refused_before_tokenizing(server):
    r = server.http.post(CMPL, json={"model": "tiny", "prompt": "a" * 1_000_000, "max_tokens": 1})
    assert r.status_code == 400 and assert_openai_error(r)["code"] == "context_length_exceeded"
    r = server.http.post(CHAT, json={**CHAT_OK, "messages": [{"role": "user", "content": "a" * 1_000_000}]})
    assert r.status_code == 400 and assert_openai_error(r)["code"] == "context_length_exceeded"


def test_health_answers_while_a_1mb_prompt_is_tokenized(server):
    text = "hello world , how are you today ? " * 30_000  # 1 MB
    done = threading.Event()
    result: list = []

    def tokenize() -> None:
        t0 = time.monotonic()
        try:
            r = httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=120)
            result.extend([time.monotonic() - t0, r.status_code, r.json().get("count")])
        finally:
            done.set()

    t = threading.Thread(target=tokenize)
    t.start()
    lat = []
    deadline = time.monotonic() + 120
    with httpx.Client(base_url=server.url, timeout=30) as http:
        while not done.is_set() and time.monotonic() < deadline:
            t0 = time.monotonic()
            assert http.get("/health").status_code == 200
            lat.append(time.monotonic() - t0)
            time.sleep(0.02)
    t.join(10)
    took, status, count = result
    assert status == 200 and count > 100_000
    # health checks ran all along while the tokenizer worked, none waiting for it to finish (the
    # latency itself, ~50 ms at most here, is a figure for docs, not a timed test)
    assert len(lat) >= 3 and max(lat) < took / 2, (max(lat), took, len(lat))


# -- structured outputs, tools and the wire: classes an adversarial search found past the fuzzer ---
def _ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def _rule_chain(max_chars: int) -> str:
    """A Lark grammar of one chain of rules, as long as `max_chars` allows."""
    lines, size, i = ["start: r0"], 10, 0
    while size + 2 * len(str(i)) + 10 < max_chars:
        lines.append(f"r{i}: r{i + 1}")
        size += len(lines[-1]) + 1
        i += 1
    return "\n".join([*lines, f'r{i}: "end"'])


def test_chains_of_refs_and_rules_as_long_as_the_size_limit_allows_compile(server):
    """llguidance reads a grammar with native recursion: a chain of ~2,500 $refs or rules used to
    overflow the compiling thread's stack and kill the server (SIGSEGV). The longest chain the size
    limit lets through must compile (or be refused), with the server alive."""
    from jaxsched.core.limits import MAX_GRAMMAR_CHARS

    for so in ({"json": _ref_chain(3000)}, {"json": _ref_chain(MAX_GRAMMAR_CHARS // 36)},
               {"grammar": _rule_chain(MAX_GRAMMAR_CHARS - 16)}):
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "structured_outputs": so}
        size = len(so["grammar"]) if "grammar" in so else len(json.dumps(so["json"]))
        assert size <= MAX_GRAMMAR_CHARS and (size > 0.97 * MAX_GRAMMAR_CHARS or "d3000" in so["json"]["$defs"])
        r = server.http.post(CMPL, json=body)
        assert r.status_code == 200, r.text[:500]  # compiled (well within the time limit), and ran
    assert server.http.get("/health").status_code == 200


@pytest.mark.parametrize("body", [
    {"model": "tiny", "prompt": "hi", "max_tokens": 2, "guided_json": "[" * 5000 + "]" * 5000},
    {"model": "tiny", "prompt": "hi", "max_tokens": 2, "structured_outputs": {"json": "[" * 5000 + "]" * 5000}},
    {**CHAT_OK, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]}]},
    {"model": "tiny", "prompt": "hi", "max_tokens": 2, "structured_outputs": {"json": _nested(130)}},
], ids=["guided_json text", "structured_outputs.json text", "tool call arguments", "schema object"])
def test_json_nested_too_deeply_anywhere_is_a_400(server, body):
    """JSON inside a string field is parsed past the body's own nesting limit: Python's parser
    raises RecursionError, which used to be a 500."""
    for path in ([CHAT, "/tokenize"] if "messages" in body else [CMPL]):
        r = server.http.post(path, json=body)
        assert r.status_code == 400, r.text[:500]
        assert "nested too deeply" in assert_openai_error(r)["message"]


def test_the_body_nesting_limit_is_stated_and_exact(server):
    from serving.protocol import MAX_JSON_DEPTH, json_depth

    assert json_depth(_nested(MAX_JSON_DEPTH - 1)) == MAX_JSON_DEPTH and json_depth({"a": [1, {}]}) == 3
    assert json_depth([[1, 2], {"a": [[]]}, 3]) == 4 and json_depth(7) == 0
    assert json_depth(_nested(100_000)) == MAX_JSON_DEPTH + 1  # counted up to the limit, not further
    ok = {"model": "tiny", "prompt": "hi", "max_tokens": 1, "user": "u", "x": _nested(MAX_JSON_DEPTH - 2)}
    assert server.http.post(CMPL, json=ok).status_code == 200  # the body object is a level of its own
    r = server.http.post(CMPL, json={**ok, "x": _nested(MAX_JSON_DEPTH - 1)})
    assert r.status_code == 400 and f"limited to {MAX_JSON_DEPTH} levels" in assert_openai_error(r)["message"]


def test_a_schema_object_nested_past_pythons_encoder_is_refused_where_it_enters():
    """Offline, a schema object goes to json.dumps without the server's body limit."""
    from jaxsched.errors import InvalidRequestError
    from jaxsched.structured.params import StructuredOutputsParams

    with pytest.raises(InvalidRequestError, match="nested too deeply") as e:
        StructuredOutputsParams(json={"type": "array", "items": _nested(5000)})
    assert e.value.param == "structured_outputs.json"


def test_tools_whose_schema_is_too_large_to_enforce_are_a_400(server):
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(12)}}}} for i in range(600)]
    for choice in ("required", {"type": "function", "function": {"name": "f0"}}):
        huge = tools if choice == "required" else [{"type": "function", "function": {"name": "f0", "parameters": {
            "type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(12_000)}}}}]
        r = server.http.post(CHAT, json={**CHAT_OK, "tools": huge, "tool_choice": choice})
        assert r.status_code == 400, r.text[:500]
        assert assert_openai_error(r)["param"] == "tools"


def test_a_grammar_past_the_parsers_limits_fails_its_request_alone_as_a_client_error(server):
    """2,000 choices compile, then the parser refuses the first token (its row limit): the request
    ends alone, as a 400 naming the field (an error event when streamed), with a short message."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4,
            "structured_outputs": {"choice": [f"c{i}" for i in range(2000)]}}
    results: list = [None] * 4
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _stream_text(server.url, PROMPTS[i])))
               for i in range(4)]
    for t in threads:
        t.start()
    r = server.http.post(CMPL, json=body)
    assert r.status_code == 400, r.text[:500]
    err = assert_openai_error(r)
    assert err["param"] == "structured_outputs" and "simplify" in err["message"] and len(err["message"]) < 1000
    with httpx.stream("POST", server.url + CMPL, json={**body, "stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events[-1]["error"]["type"] == "invalid_request_error"
    assert events[-1]["error"]["param"] == "structured_outputs"
    for t in threads:
        t.join(60)
    want = [server.http.post(CMPL, json={"model": "tiny", "prompt": p, "max_tokens": 20, "temperature": 0,
                                         "ignore_eos": True}).json()["choices"][0]["text"] for p in PROMPTS]
    assert results == want
    assert server.idle() == ({}, False)
    # the field named is the one the grammar came in
    r = server.http.post(CMPL, json={"model": "tiny", "prompt": "hi", "max_tokens": 4,
                                     "guided_choice": [f"c{i}" for i in range(2000)]})
    assert r.status_code == 400 and assert_openai_error(r)["param"] == "guided_choice", r.text[:500]


class _RefusesSecondToken:
    """A constraint that allows every token and refuses the second it is given (as a grammar past
    the parser's limits on one sampled path only)."""

    depends_on_tokens = False
    param = "structured_outputs"
    finished = False

    def __init__(self) -> None:
        self.seen = 0

    def fill(self, row) -> None:
        row[:] = -1

    def accept(self, token: int) -> str | None:
        self.seen += 1
        return "refused" if self.seen == 2 else None

    def fork(self):
        return self


def test_one_sample_failing_ends_its_siblings_too(server):
    """n = 2, and the grammar refuses one sample's path: the request fails, and the other sample
    does not go on generating unseen (outside the admission limit)."""
    async def main():
        eng = server.engine
        stream = await eng.add_request("one two", SamplingParams(temperature=0, max_tokens=50, n=2, ignore_eos=True))
        rid = stream.request_id

        def constrain(e):
            first = next(r for r in e.scheduler.requests.values() if r.group_id == rid)
            first.constraint = _RefusesSecondToken()

        await eng.call(constrain)
        with pytest.raises(EngineStepError) as e:
            async for _ in stream:
                pass
        left = (await eng.call(lambda e: [r.request_id for r in e.scheduler.requests.values()
                                         if r.group_id == rid and not r.is_finished]))[0]
        return e.value, left

    err, left = asyncio.run(main())
    assert err.param == "structured_outputs" and "refused" in str(err)
    assert left == []
    assert server.idle() == ({}, False)


def test_a_client_that_leaves_a_non_streamed_request_gets_nothing_and_logs_nothing(server):
    """until_disconnect cancels the work when the client leaves; it used to read the task's result
    before the cancellation had landed (InvalidStateError, logged as an unhandled error)."""
    async def receive() -> dict:
        return {"type": "http.disconnect"}

    class Gone:
        async def receive(self) -> dict:
            return await receive()

    async def main():
        return await server.app.state.server.until_disconnect(Gone(), asyncio.sleep(30))

    assert asyncio.run(main()).status_code == 499


@pytest.mark.parametrize("key", ["1_0", " 5 ", "\u0663", "+5", "-1"])
def test_logit_bias_keys_are_plain_digits(server, key):
    r = server.http.post(CMPL, json={"model": "tiny", "prompt": "hi", "max_tokens": 1, "logit_bias": {key: 1}})
    assert r.status_code == 400 and assert_openai_error(r)["param"] == "logit_bias", r.text


def test_an_unknown_model_name_is_not_echoed_in_full(server):
    r = server.http.post(CMPL, json={"model": "m" * 100_000, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 404 and len(assert_openai_error(r)["message"]) < 1000
