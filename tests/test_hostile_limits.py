"""Hostile requests beside an innocent one: each case runs with a bystander stream and a /health
poller. The hostile request gets a 4xx (or a correct 200), /health never takes more than a second,
and the bystander gets the tokens it gets alone. Every list or string a request carries has a limit
(jaxsched/core/limits.py), checked before any work proportional to it."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Callable

import httpx
import pytest
from servers import uvicorn_thread

from jaxsched import LLM, SamplingParams
from jaxsched.core import limits
from serving.app import LOOPBACK_HOSTS, build_app
from serving.async_engine import AsyncEngine
from serving.grpc_server import GrpcFrontEnd

ENGINE = {"max_model_len": 64, "max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 8}
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
KEY = "hostile-test-key"
HEADERS = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
BYSTANDER = "the capital of france is"
BODY_TIMEOUT = 2.0


class Server:
    def __init__(self, url: str, ref: str, llm: LLM, engine: AsyncEngine, app) -> None:
        self.url, self.ref, self.llm, self.engine, self.app = url, ref, llm, engine, app
        self.http = httpx.Client(base_url=url, timeout=120, headers=HEADERS)


@pytest.fixture(scope="module")
def server(llama_dir):
    llm = LLM(llama_dir, **ENGINE)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = llm.generate([BYSTANDER], greedy, use_tqdm=False)[0].outputs[0].text
    engine = AsyncEngine(llm.llm_engine)
    app = build_app(engine, served_model_name="tiny", api_key=KEY, allowed_hosts=LOOPBACK_HOSTS,
                    body_timeout=BODY_TIMEOUT)
    front = GrpcFrontEnd(app, 0, api_key=KEY)
    with uvicorn_thread(app, engine, (front,)) as url:
        s = Server(url, ref, llm, engine, app)
        s.grpc_target = front.target
        yield s
    engine.shutdown()


def beside(server: Server, hostile: Callable[[], httpx.Response]) -> httpx.Response:
    """Run `hostile` with a bystander stream and a /health poller; check both, return its response."""
    stop = threading.Event()
    worst = [0.0]
    got: dict[str, object] = {}

    def poll() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                assert c.get("/health").status_code == 200
                worst[0] = max(worst[0], time.monotonic() - t0)
                time.sleep(0.02)

    def bystander() -> None:
        body = {"model": "tiny", "prompt": BYSTANDER, "max_tokens": 20, "temperature": 0, "ignore_eos": True,
                "stream": True}
        text = ""
        with httpx.Client(base_url=server.url, timeout=120, headers=HEADERS) as c, \
                c.stream("POST", CMPL, json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk["choices"]:
                        text += chunk["choices"][0]["text"]
        got["text"] = text

    threads = [threading.Thread(target=poll, daemon=True), threading.Thread(target=bystander, daemon=True)]
    for t in threads:
        t.start()
    try:
        resp = hostile()
    finally:
        threads[1].join(120)
        stop.set()
        threads[0].join(30)
    assert got.get("text") == server.ref, "the bystander's tokens changed"
    assert worst[0] < 1.0, f"/health took {worst[0]:.2f} s"
    return resp


def error_of(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def post(server: Server, path: str, body: dict, **kw) -> Callable[[], httpx.Response]:
    return lambda: server.http.post(path, content=json.dumps(body, separators=(",", ":")).encode(), **kw)


# -- 1. every list bounded before work over it ----------------------------------------------------
def test_many_prompts_with_a_huge_allowed_list_is_refused_at_once(server):
    body = {"model": "tiny", "prompt": [BYSTANDER] * 2048, "allowed_token_ids": list(range(400_000)),
            "max_tokens": 1}
    err = error_of(beside(server, post(server, CMPL, body)))
    assert err["param"] == "allowed_token_ids" and str(limits.MAX_ALLOWED_TOKEN_IDS) in err["message"]
    body["allowed_token_ids"] = list(range(100)) * 2000  # within the list's limit, over the request's
    err = error_of(beside(server, post(server, CMPL, body)))
    assert err["param"] == "allowed_token_ids" and "send fewer prompts" in err["message"]


def test_a_moderate_allowed_list_over_several_prompts_is_served(server):
    allowed = list(range(200))
    body = {"model": "tiny", "prompt": [BYSTANDER] * 4, "allowed_token_ids": allowed, "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}
    r = beside(server, post(server, CMPL, body))
    assert r.status_code == 200, r.text[:300]
    assert len(r.json()["choices"]) == 4 and r.json()["usage"]["completion_tokens"] == 16


def test_forty_thousand_tools_are_refused_by_count(server):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [tool] * 40_000}
    t0 = time.monotonic()
    err = error_of(beside(server, post(server, CHAT, body)))
    assert err["param"] == "tools" and f"<= {limits.MAX_TOOLS}" in err["message"]
    assert time.monotonic() - t0 < 10


def test_detokenize_of_millions_of_ids_is_refused_and_health_answers(server):
    ids = [5] * 3_500_000
    err = error_of(beside(server, post(server, "/detokenize", {"tokens": ids})))
    assert err["param"] == "tokens"
    r = server.http.post("/detokenize", json={"tokens": [5, 6, 7]})
    assert r.status_code == 200 and isinstance(r.json()["prompt"], str)


def test_a_token_prompt_longer_than_max_model_len_is_refused_before_it_is_walked(server):
    err = error_of(beside(server, post(server, CMPL, {"model": "tiny", "prompt": [5] * 2_000_000})))
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    err = error_of(beside(server, post(server, CMPL, {"model": "tiny", "prompt": [[5] * 10, [5] * 100_000]})))
    assert err["param"] == "prompt"
    err = error_of(server.http.post(CMPL, json={"model": "tiny", "prompt": [5, 6, 10**9]}))
    assert err["param"] == "prompt" and "token ids must be integers" in err["message"]


@pytest.mark.parametrize("field,value,param", [
    ("messages", [{"role": "user", "content": "x"}] * (limits.MAX_MESSAGES + 1), "messages"),
    ("request_id", "r" * (limits.MAX_REQUEST_ID_CHARS + 1), "request_id"),
    ("stop", ["x"] * (limits.MAX_STOP + 1), "stop"),
    ("logit_bias", {str(i): 1.0 for i in range(limits.MAX_LOGIT_BIAS + 1)}, "logit_bias"),
    ("structured_outputs", {"choice": ["a"] * (limits.MAX_CHOICES + 1)}, "structured_outputs"),
])
def test_each_list_and_string_has_a_limit_named_in_its_error(server, field, value, param):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    err = error_of(beside(server, post(server, CHAT, body)))
    assert err["param"] == param and "limit" in err["message"], err


def test_a_schema_over_the_limit_is_refused_before_it_is_parsed(server):
    schema = json.dumps({"type": "object", "description": "x" * (limits.MAX_GRAMMAR_CHARS + 10)})
    body = {"model": "tiny", "prompt": "a", "max_tokens": 2, "structured_outputs": {"json": schema}}
    err = error_of(beside(server, post(server, CMPL, body)))
    assert err["param"].startswith("structured_outputs") and str(limits.MAX_GRAMMAR_CHARS) in err["message"]


# -- 2. impossible constraints are a 400 ----------------------------------------------------------
def test_allowed_ids_that_min_tokens_holds_back_are_a_400(server):
    body = {"model": "tiny", "prompt": "a", "max_tokens": 4, "allowed_token_ids": [7], "stop_token_ids": [7],
            "min_tokens": 2}
    err = error_of(beside(server, post(server, CMPL, body)))
    assert err["param"] == "allowed_token_ids" and "min_tokens" in err["message"]


def test_choices_too_short_for_min_tokens_are_a_400(server):
    body = {"model": "tiny", "prompt": "a", "max_tokens": 20, "min_tokens": 10,
            "structured_outputs": {"choice": ["yes", "no"]}}
    err = error_of(beside(server, post(server, CMPL, body)))
    assert err["param"] == "min_tokens"


def test_a_mask_that_leaves_nothing_ends_the_request_with_a_400_naming_the_fields(server):
    """The EOS id is only known to the engine, so an allowed list of EOS alone is found at admission
    too; sampling-time exclusion (a token outside the set) names the fields, never a 500."""
    eos = server.llm.llm_engine.eos_token_ids[0]
    body = {"model": "tiny", "prompt": "a", "max_tokens": 4, "allowed_token_ids": [eos], "min_tokens": 2}
    err = error_of(beside(server, post(server, CMPL, body)))
    assert err["param"] == "allowed_token_ids"


# -- 5. the Host check -----------------------------------------------------------------------------
def test_a_foreign_host_header_is_refused_and_loopback_names_are_served(server):
    err = error_of(beside(server, lambda: server.http.get("/v1/models", headers={"Host": "evil.example"})))
    assert err["code"] == "invalid_host"
    err = error_of(server.http.get("/health", headers={"Host": "evil.example:8000"}))
    for host in ("localhost:1234", "127.0.0.1", "[::1]:8000", "LOCALHOST"):
        assert server.http.get("/v1/models", headers={"Host": host}).status_code == 200, host


# -- 6. what the client and the log see ----------------------------------------------------------
def test_a_500_names_no_exception_and_the_log_has_it_under_the_id(server, monkeypatch, caplog):
    from serving import convert

    works = convert.Converter.sampling_params

    def broken(self, req, *a, **k):
        if req.prompt == "boom":
            raise RuntimeError("secret internals at /home/user/model")
        return works(self, req, *a, **k)

    monkeypatch.setattr(convert.Converter, "sampling_params", broken)
    with caplog.at_level(logging.ERROR, logger="serving.app"):
        r = beside(server, post(server, CMPL, {"model": "tiny", "prompt": "boom", "max_tokens": 2}))
    err = error_of(r, 500)
    assert "RuntimeError" not in r.text and "secret" not in r.text and "error id" in err["message"]
    ref = err["message"].split("error id ")[1].split(",")[0]
    assert any(ref in rec.getMessage() and "secret internals" in rec.getMessage() for rec in caplog.records)


def test_unknown_field_names_are_logged_escaped_and_capped(server, caplog):
    body = {"model": "tiny", "prompt": "a", "max_tokens": 1, **{f"x{i}": 1 for i in range(500)},
            "evil\nINFO forged line": 1}
    with caplog.at_level(logging.WARNING, logger="serving.app"):
        r = beside(server, post(server, CMPL, body))
    assert r.status_code == 200
    [line] = [rec.getMessage() for rec in caplog.records if "ignoring unknown fields" in rec.getMessage()]
    assert "\n" not in line and f"and {501 - limits.MAX_UNKNOWN_FIELDS_LOGGED} more" in line


def test_models_shows_no_path_unless_asked(server):
    card = server.http.get("/v1/models").json()["data"][0]
    assert card["root"] == "tiny" and "/" not in card["root"]


# -- 11. a body that never comes, several Authorization headers ------------------------------------
def test_a_body_shorter_than_its_content_length_gets_a_408(server):
    host, port = server.url.removeprefix("http://").split(":")

    def slow() -> httpx.Response:
        with socket.create_connection((host, int(port)), timeout=BODY_TIMEOUT + 10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"model\"")
            t0 = time.monotonic()
            head = s.recv(65536).decode(errors="replace")
            assert time.monotonic() - t0 < BODY_TIMEOUT + 5
            status = int(head.split(" ", 2)[1])
            return httpx.Response(status, content=head.split("\r\n\r\n", 1)[1].encode())

    r = beside(server, slow)
    assert r.status_code == 408 and b"request_timeout" in r.content


def test_several_authorization_headers_are_refused(server):
    def two() -> httpx.Response:
        headers = [("Content-Type", "application/json"), ("Authorization", f"Bearer {KEY}"),
                   ("Authorization", "Bearer other")]
        return httpx.post(server.url + CMPL, headers=headers, content=b'{"model": "tiny", "prompt": "a"}')

    err = error_of(beside(server, two))
    assert "Authorization headers" in err["message"]


# -- 4. queue timeouts and deadlines ----------------------------------------------------------------
def idle(server: Server) -> dict:
    """Blocks still owned by requests, once the engine has nothing left to do."""
    for _ in range(200):
        owned, busy = asyncio.run(server.engine.call(
            lambda e: (dict(e.block_manager.req_blocks), e.has_unfinished_requests())))[0]
        if not busy:
            return owned
        time.sleep(0.02)
    raise AssertionError("the engine stayed busy")


def test_a_request_past_its_own_timeout_ends_with_finish_reason_timeout(server):
    m = server.engine.metrics
    before = m.value("request_timeouts_total", kind="deadline")
    body = {"model": "tiny", "prompt": "a", "max_tokens": 40, "ignore_eos": True, "timeout": 0.001}
    r = beside(server, post(server, CMPL, body))
    assert r.status_code == 200, r.text[:300]
    assert r.json()["choices"][0]["finish_reason"] == "timeout" and r.json()["usage"]["completion_tokens"] < 40
    assert m.value("request_timeouts_total", kind="deadline") == before + 1
    assert idle(server) == {}
    err = error_of(server.http.post(CMPL, json={**body, "timeout": -1}))
    assert err["param"] == "timeout"


def test_requests_waiting_past_the_queue_timeout_get_503_and_the_rest_run(server, monkeypatch):
    monkeypatch.setattr(server.engine, "queue_timeout", 0.05)
    m = server.engine.metrics
    before = m.value("request_timeouts_total", kind="queue")
    body = {"model": "tiny", "prompt": BYSTANDER, "max_tokens": 40, "temperature": 0, "ignore_eos": True}

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120, headers=HEADERS) as c:
            return await asyncio.gather(*(c.post(CMPL, json=body) for _ in range(48)))

    rs = asyncio.run(flood())
    late = [r for r in rs if r.status_code == 503]
    served = [r for r in rs if r.status_code == 200]
    assert late and served and len(late) + len(served) == len(rs), [r.status_code for r in rs]
    for r in late:
        assert r.json()["error"]["code"] == "queue_timeout" and r.headers["Retry-After"] == "1"
    texts = {r.json()["choices"][0]["text"] for r in served}
    assert len(texts) == 1 and all(r.json()["usage"]["completion_tokens"] == 40 for r in served)
    assert m.value("request_timeouts_total", kind="queue") == before + len(late)
    assert idle(server) == {}


# -- 8. /health tells the truth ----------------------------------------------------------------------
def test_a_stuck_step_turns_health_503_until_it_ends(server, monkeypatch):
    monkeypatch.setattr(server.engine, "watchdog_min", 0.5)
    monkeypatch.setattr(server.engine, "WATCHDOG_STEPS", 0)
    core = server.engine.engine.client.local_cores[0]
    collect, stuck = core.runner.collect, threading.Event()

    def slow_collect(step):
        if not stuck.is_set():
            stuck.set()
            time.sleep(2.0)  # a kernel that hangs, for a while
        return collect(step)

    monkeypatch.setattr(core.runner, "collect", slow_collect)
    done: list[httpx.Response] = []
    t = threading.Thread(target=lambda: done.append(server.http.post(
        CMPL, json={"model": "tiny", "prompt": "a", "max_tokens": 3, "ignore_eos": True})))
    t.start()
    seen = set()
    with httpx.Client(base_url=server.url, timeout=5) as c:
        while t.is_alive():
            seen.add(c.get("/health").status_code)
            time.sleep(0.05)
        t.join()
        assert c.get("/health").status_code == 200
    assert 503 in seen and done[0].status_code == 200


# -- 3. grammar compiles are fair --------------------------------------------------------------------
def test_slow_schemas_from_one_client_do_not_make_anothers_time_out(server, monkeypatch):
    """A client (here 127.0.0.2) sends slow grammars: each is a 400 at the time limit and, while
    one still compiles, its next ones are a 429 at once; another client's grammar compiles as usual."""
    s = server.app.state.server
    monkeypatch.setattr(s, "grammar_timeout", 1.0)
    grammars = s.grammars
    real = grammars.compile

    class Slow:
        def __getattr__(self, name):
            return getattr(grammars, name)

        def compile(self, so):
            if so.regex is not None and so.regex.startswith("slow"):
                time.sleep(2.5)  # past the limit, as a hostile schema's compile would be
            return real(so)

    monkeypatch.setattr(s, "grammars", Slow())
    hostile = httpx.Client(base_url=server.url, timeout=60, headers=HEADERS,
                           transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    slow = {"model": "tiny", "prompt": "a", "max_tokens": 3, "structured_outputs": {"regex": "slow[0-9]+"}}
    fine = {"model": "tiny", "prompt": "a", "max_tokens": 3, "structured_outputs": {"regex": "[0-9]{3}"}}
    results: dict[str, list[int]] = {"hostile": [], "other": []}

    def attack() -> httpx.Response:
        threads = [threading.Thread(target=lambda: results["hostile"].append(
            hostile.post(CMPL, json=slow).status_code)) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        r = server.http.post(CMPL, json=fine)  # another client, while the hostile compiles run
        results["other"].append(round(time.monotonic() - t0, 2))
        for t in threads:
            t.join()
        return r

    r = beside(server, attack)
    assert r.status_code == 200, r.text[:300]
    assert results["other"][0] < 1.0  # it did not wait for the hostile compiles
    assert sorted(results["hostile"]) in ([400, 400, 400, 400], [400, 400, 400, 429], [400, 400, 429, 429],
                                          [400, 429, 429, 429]), results
    time.sleep(3)  # the stuck compiles end
    assert s.grammar_pool.stuck == 0


# -- 7. one request's error keeps the prefix cache -----------------------------------------------------
def test_a_request_that_fails_alone_keeps_the_others_cached_prefix(server):
    """A request that fails on its own (here one carrying a value make_request would refuse, which
    the step's guard fails) forgets only the blocks it computed: a later request sharing the
    prefix it found cached still hits it."""
    from jaxsched.engine.core_messages import EngineCoreRequest

    prefix = list(range(10, 34))  # three full blocks of 8
    base = {"model": "tiny", "max_tokens": 2, "ignore_eos": True, "temperature": 0}
    assert server.http.post(CMPL, json={**base, "prompt": prefix + [40]}).status_code == 200

    def hits() -> int:
        return asyncio.run(server.engine.call(lambda e: e.block_manager.prefix_hits))[0]

    def fail_one() -> httpx.Response:
        def add(e):
            e.add_request(EngineCoreRequest("fails-alone", prefix + list(range(50, 60)),
                                            SamplingParams(temperature=0, max_tokens=5), time.monotonic()))
            object.__setattr__(e.scheduler.requests["fails-alone"].sampling_params, "top_k", 2**40)

        asyncio.run(server.engine.call(add))
        idle(server)
        before = hits()
        r = server.http.post(CMPL, json={**base, "prompt": prefix + [41]})
        r.hits = hits() - before
        return r

    r = beside(server, fail_one)
    assert r.status_code == 200 and r.hits >= len(prefix), r.hits


# -- 10. gRPC ----------------------------------------------------------------------------------------
def test_grpc_abort_racing_a_duplicate_generate_is_not_lost(server, monkeypatch):
    """Abort(X) while Generate(X) and a duplicate Generate(X) are both being admitted; the first is
    admitted, the duplicate fails afterwards: the abort still ends the first one."""
    import grpc

    from jaxsched.proto import jaxsched_pb2 as pb
    from jaxsched.proto import jaxsched_pb2_grpc as pb_grpc

    s = server.app.state.server
    inputs = s.completion_inputs

    async def slow_inputs(req, client=""):
        if req.prompt in ("race", "dup"):
            await asyncio.sleep(1.2 if req.prompt == "dup" else 0.6)  # the duplicate is admitted last
        return await inputs(req, client)

    monkeypatch.setattr(s, "completion_inputs", slow_inputs)
    core = server.engine.engine.client.local_cores[0]
    collect = core.runner.collect
    monkeypatch.setattr(core.runner, "collect", lambda step: (time.sleep(0.03), collect(step))[1])
    auth = (("authorization", f"Bearer {KEY}"),)
    params = pb.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def main():
        async with grpc.aio.insecure_channel(server.grpc_target) as ch:
            stub = pb_grpc.GenerationStub(ch)
            first = stub.Generate(pb.GenerateRequest(request_id="race", text="race", sampling_params=params),
                                  metadata=auth)
            second = stub.Generate(pb.GenerateRequest(request_id="race", text="dup", sampling_params=params),
                                   metadata=auth)
            await asyncio.sleep(0.2)
            found = (await stub.Abort(pb.AbortRequest(request_id="race"), metadata=auth)).found
            msgs = [m async for m in first]
            try:
                await second.read()
                dup = None
            except grpc.aio.AioRpcError as e:
                dup = e.code()
            return found, msgs, dup

    found, msgs, dup = beside(server, lambda: asyncio.run(main()))
    assert found and dup == grpc.StatusCode.INVALID_ARGUMENT
    assert msgs[-1].finished and [o.finish_reason for o in msgs[-1].outputs] == ["abort"]
    assert idle(server) == {}


def test_a_grpc_call_past_the_queue_timeout_is_unavailable(server, monkeypatch):
    import grpc

    from jaxsched.proto import jaxsched_pb2 as pb
    from jaxsched.proto import jaxsched_pb2_grpc as pb_grpc

    monkeypatch.setattr(server.engine, "queue_timeout", 0.05)
    auth = (("authorization", f"Bearer {KEY}"),)
    params = pb.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def main():
        async with grpc.aio.insecure_channel(server.grpc_target) as ch:
            stub = pb_grpc.GenerationStub(ch)

            async def one():
                try:
                    return [m async for m in stub.Generate(pb.GenerateRequest(text=BYSTANDER, sampling_params=params),
                                                           metadata=auth)][-1].usage.completion_tokens
                except grpc.aio.AioRpcError as e:
                    return e.code(), e.details()

            return await asyncio.gather(*(one() for _ in range(32)))

    res = asyncio.run(main())
    late = [r for r in res if isinstance(r, tuple)]
    assert late and all(code == grpc.StatusCode.UNAVAILABLE and "queue" in details for code, details in late), late
    assert all(r == 40 for r in res if not isinstance(r, tuple))
    assert idle(server) == {}
