"""The gRPC front end over a real socket, with grpcio's own client, beside the HTTP server on one
engine (as `jaxsched serve --grpc-port` runs them): token ids equal the offline engine's, streams,
cancellation, Abort, errors as status codes naming the field, the API key, the queue limit, the
health service, and the committed stubs against the .proto."""

from __future__ import annotations

import asyncio
import filecmp
import os
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from servers import uvicorn_thread

from jaxsched import LLM, SamplingParams
from jaxsched.proto import jaxsched_pb2 as pb
from jaxsched.proto import jaxsched_pb2_grpc as pb_grpc
from serving.app import build_app
from serving.async_engine import AsyncEngine
from serving.grpc_server import SERVICE, GrpcFrontEnd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = {"max_model_len": 128, "max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 8}
KEY = "grpc-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
PROMPTS = ["the capital of france is", "hello world , how are you", "one two three four", "what is a cat ?"]
MAX_REQUEST_BYTES = 64 * 1024


class Served:
    def __init__(self, url: str, target: str, engine: AsyncEngine, refs: dict, app) -> None:
        self.url, self.target, self.engine, self.refs, self.app = url, target, engine, refs, app
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def generate(self, **kw) -> list[pb.GenerateResponse]:
        return list(self.stub.Generate(pb.GenerateRequest(**kw), metadata=AUTH, timeout=60))


@pytest.fixture(scope="module")
def served(llama_dir):
    llm = LLM(llama_dir, **ENGINE)
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    refs = {"ids": [list(o.outputs[0].token_ids) for o in outs], "texts": [o.outputs[0].text for o in outs],
            "prompt_ids": [list(o.prompt_token_ids) for o in outs], "vocab": llm.llm_engine.model_config.vocab_size,
            "tokenizer": tok}
    engine = AsyncEngine(llm.llm_engine)
    app = build_app(engine, served_model_name="tiny", api_key=KEY, max_request_bytes=MAX_REQUEST_BYTES)
    front = GrpcFrontEnd(app, 0, api_key=KEY)
    with uvicorn_thread(app, engine, (front,)) as url:
        s = Served(url, front.target, engine, refs, app)
        yield s
        s.channel.close()
    engine.shutdown()


def greedy(max_tokens: int = 12, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def tokens(msgs: list[pb.GenerateResponse], index: int = 0) -> list[int]:
    return [t for m in msgs for o in m.outputs if o.index == index for t in o.token_ids]


def test_committed_stubs_match_the_proto(tmp_path):
    """The stubs in jaxsched/proto are what `make proto` writes from jaxsched.proto today."""
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", "jaxsched/proto/jaxsched.proto"],
                   cwd=ROOT, check=True, capture_output=True, timeout=120)
    names = ["jaxsched_pb2.py", "jaxsched_pb2.pyi", "jaxsched_pb2_grpc.py"]
    match, mismatch, errors = filecmp.cmpfiles(tmp_path / "jaxsched" / "proto", os.path.join(ROOT, "jaxsched", "proto"),
                                               names, shallow=False)
    assert match == names, f"stale gRPC stubs {mismatch + errors}: run `make proto` and commit them"


def test_greedy_ids_equal_offline_generate_for_text_and_token_prompts(served):
    for i, prompt in enumerate(PROMPTS):
        by_text = served.generate(text=prompt, sampling_params=greedy())
        by_ids = served.generate(token_ids=pb.TokenIds(ids=served.refs["prompt_ids"][i]), sampling_params=greedy())
        assert tokens(by_text) == served.refs["ids"][i] == tokens(by_ids), i


def test_a_stream_yields_every_token_once_and_ends_with_usage(served, monkeypatch):
    # steps of a few ms, as a real model's: on a loaded 2-core machine the tiny model's steps outran
    # the reader, whose unread deltas were merged (by design) into fewer messages than this expects
    core = served.engine.engine.client.local_cores[0]
    collect = core.runner.collect
    monkeypatch.setattr(core.runner, "collect", lambda step: (time.sleep(0.005), collect(step))[1])
    msgs = served.generate(text=PROMPTS[0], sampling_params=greedy(), request_id="stream-1", return_text=True)
    assert len(msgs) > 2  # a message per step, not one at the end
    assert tokens(msgs) == served.refs["ids"][0]
    assert "".join(o.text for m in msgs for o in m.outputs) == served.refs["texts"][0]
    assert all(m.request_id == "stream-1" for m in msgs)
    assert [m.finished for m in msgs] == [False] * (len(msgs) - 1) + [True]
    assert [o.finish_reason for m in msgs for o in m.outputs if o.finish_reason] == ["length"]
    last = msgs[-1]
    n_prompt = len(served.refs["prompt_ids"][0])
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (n_prompt, 12,
                                                                                                  n_prompt + 12)
    assert not any(m.HasField("usage") for m in msgs[:-1])
    # no text unless asked for
    assert all(o.text == "" for m in served.generate(text=PROMPTS[0], sampling_params=greedy()) for o in m.outputs)


def test_stream_granularity(served):
    final = served.generate(text=PROMPTS[1], sampling_params=greedy(), stream=pb.STREAM_MODE_FINAL)
    assert len(final) == 1 and final[0].finished and tokens(final) == served.refs["ids"][1]
    chunked = served.generate(text=PROMPTS[1], sampling_params=greedy(), stream_interval=5)
    assert tokens(chunked) == served.refs["ids"][1]
    sizes = [len(o.token_ids) for m in chunked for o in m.outputs]
    assert all(n >= 5 for n in sizes[:-1]) and sum(sizes) == 12, sizes


def test_n_samples_stream_each_token_once(served):
    msgs = served.generate(text=PROMPTS[2], sampling_params=pb.SamplingParams(n=3, temperature=1.0, seed=7,
                                                                              max_tokens=10, ignore_eos=True))
    for i in range(3):
        assert len(tokens(msgs, i)) == 10
        assert [o.finish_reason for m in msgs for o in m.outputs if o.index == i and o.finish_reason] == ["length"]
    assert msgs[-1].usage.completion_tokens == 30


def test_logprobs_and_stop(served):
    msgs = served.generate(text=PROMPTS[0], sampling_params=greedy(logprobs=2))
    lps = [lp for m in msgs for o in m.outputs for lp in o.logprobs]
    assert [lp.token_id for lp in lps] == served.refs["ids"][0]
    for lp in lps:
        assert [t.rank for t in lp.top] == [1, 2]
        assert lp.top[0].token_id == lp.token_id and abs(lp.top[0].logprob - lp.logprob) < 1e-6  # greedy: the best
    stop_id = served.refs["ids"][0][3]
    msgs = served.generate(text=PROMPTS[0], sampling_params=greedy(stop_token_ids=[stop_id]))
    last = next(o for m in msgs for o in m.outputs if o.finish_reason)
    want = served.refs["ids"][0][:served.refs["ids"][0].index(stop_id) + 1]
    assert tokens(msgs) == want and last.finish_reason == "stop" and last.stop_token_id == stop_id


def test_prompt_logprobs_come_in_the_first_message(served):
    """sampling_params.prompt_logprobs: one TokenLogprob per prompt token from the second on, each
    the prompt's own token with its logprob and the k most likely, in the first message only (both
    stream modes); the offline engine's figures."""
    ids = served.refs["prompt_ids"][0]
    for mode in (pb.STREAM_MODE_TOKENS, pb.STREAM_MODE_FINAL):
        msgs = served.generate(text=PROMPTS[0], sampling_params=greedy(prompt_logprobs=2), stream=mode)
        carried = [m for m in msgs if m.prompt_logprobs]
        assert len(carried) == 1 and carried[0] is msgs[0]
        pl = list(carried[0].prompt_logprobs)
        assert [lp.token_id for lp in pl] == ids[1:]
        assert all(len(lp.top) <= 2 and [t.rank for t in lp.top] == sorted(t.rank for t in lp.top) for lp in pl)
        assert all(lp.logprob <= 0 and any(t.logprob >= lp.logprob for t in lp.top) for lp in pl)
        assert tokens(msgs) == served.refs["ids"][0]


BAD = [  # (what, request fields, the field the error must name)
    ("no prompt", {"sampling_params": greedy()}, "prompt"),
    ("empty text", {"text": "", "sampling_params": greedy()}, "text"),
    ("empty token_ids", {"token_ids": pb.TokenIds(ids=[])}, "token_ids"),
    ("token id past the vocabulary", {"token_ids": pb.TokenIds(ids=[5, 10**6])}, "token_ids"),
    ("prompt longer than max_model_len", {"token_ids": pb.TokenIds(ids=[5] * 200)}, "token_ids"),
    ("negative temperature", {"text": "hi", "sampling_params": pb.SamplingParams(temperature=-1)},
     "sampling_params.temperature"),
    ("top_k below -1", {"text": "hi", "sampling_params": pb.SamplingParams(top_k=-5)}, "sampling_params.top_k"),
    ("top_p above 1", {"text": "hi", "sampling_params": pb.SamplingParams(top_p=1.5)}, "sampling_params.top_p"),
    ("n = 0", {"text": "hi", "sampling_params": pb.SamplingParams(n=0)}, "sampling_params.n"),
    ("max_tokens past max_model_len", {"text": "hi", "sampling_params": pb.SamplingParams(max_tokens=500)},
     "sampling_params.max_tokens"),
    ("too many logprobs", {"text": "hi", "sampling_params": pb.SamplingParams(logprobs=10**6)},
     "sampling_params.logprobs"),
    ("too many prompt logprobs", {"text": "hi", "sampling_params": pb.SamplingParams(prompt_logprobs=10**6)},
     "sampling_params.prompt_logprobs"),
    ("stop token past the vocabulary", {"text": "hi", "sampling_params": pb.SamplingParams(stop_token_ids=[10**6])},
     "sampling_params.stop_token_ids"),
    ("logit_bias out of range", {"text": "hi", "sampling_params": pb.SamplingParams(logit_bias={5: 1000.0})},
     "sampling_params.logit_bias"),
    ("a schema that is not JSON", {"text": "hi", "sampling_params": pb.SamplingParams(
        structured_outputs=pb.StructuredOutputs(json="{not json"))}, "sampling_params.structured_outputs.json"),
    ("priority under fcfs", {"text": "hi", "priority": 3}, "priority"),
    ("truncate_prompt_tokens of 0", {"text": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("negative stream_interval", {"text": "hi", "stream_interval": -5}, "stream_interval"),
    ("a stream mode that does not exist", {"text": "hi", "stream": 7}, "stream"),
    # compiles, then the parser refuses the first token (its row limit): the request's own input, so
    # INVALID_ARGUMENT with a message short enough for a trailer (llguidance's runs to 20 KB)
    ("a grammar past the parser's limits", {"text": "hi", "sampling_params": pb.SamplingParams(
        max_tokens=4, structured_outputs=pb.StructuredOutputs(choice=pb.ChoiceList(
            choices=[f"c{i}" for i in range(2000)])))}, "sampling_params.structured_outputs"),
]


@pytest.mark.parametrize("what,fields,param", BAD, ids=[b[0] for b in BAD])
def test_bad_parameters_are_invalid_argument_naming_the_field(served, what, fields, param):
    with pytest.raises(grpc.RpcError) as e:
        served.generate(**fields)
    err = e.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    assert err.details().startswith(f"{param}: "), err.details()
    assert dict(err.trailing_metadata())["param"] == param


def test_bad_input_never_fails_other_requests(served):
    """Hostile calls while a good stream runs: the good one is untouched."""
    async def main():
        async with grpc.aio.insecure_channel(served.target) as ch:
            stub = pb_grpc.GenerationStub(ch)
            good = stub.Generate(pb.GenerateRequest(text=PROMPTS[3], sampling_params=greedy()), metadata=AUTH)
            bad = [stub.Generate(pb.GenerateRequest(**f), metadata=AUTH) for _, f, _ in BAD]
            codes = []
            for call in bad:
                try:
                    [m async for m in call]
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
            return [m async for m in good], codes

    msgs, codes = asyncio.run(main())
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * len(BAD)
    assert tokens(msgs) == served.refs["ids"][3]


@pytest.mark.parametrize("method,payload", [("Generate", b"\xff\xff\xff\xff\x0f"),
                                            ("Tokenize", b"\x0a\x02\xff\xfe"),  # text: not UTF-8
                                            ("Detokenize", b"\x0a\x05\x01")])  # token_ids: cut short
def test_a_request_that_does_not_decode_is_invalid_argument(served, method, payload):
    path = f"/{SERVICE}/{method}"
    call = (served.channel.unary_stream if method == "Generate" else served.channel.unary_unary)(
        path, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as e:
        result = call(payload, metadata=AUTH, timeout=30)
        list(result) if method == "Generate" else result
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.value.code(), e.value.details())
    assert f"not a valid {method} request message" in e.value.details()
    assert served.generate(text=PROMPTS[0], sampling_params=greedy())  # the server goes on


def test_status_messages_are_cut_to_fit_a_trailer():
    from serving.grpc_server import MAX_MESSAGE_BYTES, trailer_safe

    assert trailer_safe("short") == "short"
    for text in ("a" * 50_000, "é" * 20_000, "\n" * 9_000, "🙂" * 5_000):
        cut = trailer_safe(text)
        assert len(cut.encode()) <= MAX_MESSAGE_BYTES and cut.endswith("...") and text.startswith(cut[:-3])


def test_a_request_too_large_is_resource_exhausted(served):
    with pytest.raises(grpc.RpcError) as e:
        served.generate(text="x " * MAX_REQUEST_BYTES, sampling_params=greedy())
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_duplicate_request_id_in_flight_is_invalid_argument(served):
    async def main():
        async with grpc.aio.insecure_channel(served.target) as ch:
            stub = pb_grpc.GenerationStub(ch)
            first = stub.Generate(pb.GenerateRequest(request_id="dup", text=PROMPTS[0],
                                                     sampling_params=greedy(100)), metadata=AUTH)
            await first.read()  # in flight
            second = stub.Generate(pb.GenerateRequest(request_id="dup", text=PROMPTS[0], sampling_params=greedy()),
                                   metadata=AUTH)
            try:
                await second.read()
            except grpc.aio.AioRpcError as e:
                return e
            finally:
                first.cancel()

    err = asyncio.run(main())
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("request_id: ") and "already in flight" in err.details()


def test_the_api_key_is_required_except_for_health(served):
    for metadata in ((), (("authorization", "Bearer wrong"),)):
        with pytest.raises(grpc.RpcError) as e:
            list(served.stub.Generate(pb.GenerateRequest(text="hi", sampling_params=greedy()), metadata=metadata,
                                      timeout=30))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "--api-key" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            served.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    health = health_pb2_grpc.HealthStub(served.channel)
    for service in ("", SERVICE):
        r = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
        assert r.status == health_pb2.HealthCheckResponse.SERVING


def test_a_port_in_use_is_an_error_naming_the_flag(served):
    """No silent port sharing (SO_REUSEPORT off): a second server on the same port fails to start."""
    taken = int(served.target.rsplit(":", 1)[1])
    with pytest.raises(OSError, match=r"could not listen for gRPC on 127\.0\.0\.1:\d+ \(--host, --grpc-port\)"):
        asyncio.run(GrpcFrontEnd(served.app, taken).start())


def test_tokenize_detokenize_and_model_info(served):
    tok = served.refs["tokenizer"]
    r = served.stub.Tokenize(pb.TokenizeRequest(text=PROMPTS[0]), metadata=AUTH, timeout=30)
    assert list(r.token_ids) == tok(PROMPTS[0])["input_ids"] == served.refs["prompt_ids"][0]
    assert r.count == len(r.token_ids) and r.max_model_len == 128
    d = served.stub.Detokenize(pb.DetokenizeRequest(token_ids=served.refs["ids"][0]), metadata=AUTH, timeout=30)
    assert d.text == tok.decode(served.refs["ids"][0])
    with pytest.raises(grpc.RpcError) as e:
        served.stub.Detokenize(pb.DetokenizeRequest(token_ids=[10**6]), metadata=AUTH, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("token_ids: ")
    info = served.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH, timeout=30)
    assert (info.served_model_name, info.max_model_len, info.vocab_size, info.max_num_seqs) == (
        "tiny", 128, served.refs["vocab"], 8)
    assert info.scheduling_policy == "fcfs" and len(info.eos_token_ids) >= 1 and info.version


def owned(engine: AsyncEngine) -> dict:
    return asyncio.run(engine.call(lambda eng: dict(eng.block_manager.req_blocks)))[0]


def slowed(engine: AsyncEngine, seconds: float):
    """Each engine step takes at least `seconds` (so a client surely acts within one step)."""
    def slow_down(eng):
        real = eng.runner.run
        eng.runner.run = lambda batch: (time.sleep(seconds), real(batch))[1]
        return real

    real = asyncio.run(engine.call(slow_down))[0]
    return lambda: asyncio.run(engine.call(lambda eng: setattr(eng.runner, "run", real)))


def test_cancelling_the_call_frees_its_blocks_within_one_step(served):
    """Steps take >= 50 ms here, so the client's cancel reaches the server well within one."""
    restore = slowed(served.engine, 0.05)
    try:
        async def main():
            async with grpc.aio.insecure_channel(served.target) as ch:
                stub = pb_grpc.GenerationStub(ch)
                call = stub.Generate(pb.GenerateRequest(request_id="to-cancel", text=PROMPTS[0],
                                                        sampling_params=greedy(100)), metadata=AUTH)
                for _ in range(3):
                    await call.read()
                held = (await served.engine.call(lambda eng: "to-cancel" in eng.block_manager.req_blocks))[0]
                call.cancel()
                steps_at_cancel = served.engine.stats().num_steps
                while True:
                    gone, steps = (await served.engine.call(
                        lambda eng: ("to-cancel" not in eng.block_manager.req_blocks, eng.stats().num_steps)))[0]
                    if gone:
                        return held, steps - steps_at_cancel
                    await asyncio.sleep(0.005)

        held, steps = asyncio.run(main())
    finally:
        restore()
    assert held
    # stats() is published after each step, so steps_at_cancel may lag the engine by one
    assert steps <= 2, steps
    assert owned(served.engine) == {}


def test_abort_ends_the_stream_with_finish_reason_abort(served):
    async def main():
        async with grpc.aio.insecure_channel(served.target) as ch:
            stub = pb_grpc.GenerationStub(ch)
            call = stub.Generate(pb.GenerateRequest(request_id="to-abort", text=PROMPTS[1],
                                                    sampling_params=greedy(100)), metadata=AUTH)
            first = await call.read()
            found = await stub.Abort(pb.AbortRequest(request_id="to-abort"), metadata=AUTH)
            rest = []
            while (m := await call.read()) is not grpc.aio.EOF:
                rest.append(m)
            missing = await stub.Abort(pb.AbortRequest(request_id="to-abort"), metadata=AUTH)
            return [first, *rest], found.found, missing.found

    msgs, found, missing = asyncio.run(main())
    assert found and not missing
    assert msgs[-1].finished and [o.finish_reason for o in msgs[-1].outputs] == ["abort"]
    assert msgs[-1].usage.completion_tokens == len(tokens(msgs)) < 100
    assert owned(served.engine) == {}


def test_abort_while_admitting_or_waiting_still_ends_every_sample(served):
    """Abort of a request still being admitted (the engine thread is held), and of one waiting for
    a place in the batch (it has no output yet): each stream ends with finish_reason "abort" on
    every one of its n samples, its prompt counted in usage."""
    gate = threading.Event()

    async def admitting(stub):
        held = asyncio.ensure_future(served.engine.call(lambda eng: gate.wait(30)))
        call = stub.Generate(pb.GenerateRequest(request_id="early", token_ids=pb.TokenIds(ids=[5, 6, 7]),
                                                sampling_params=pb.SamplingParams(n=3, max_tokens=50)), metadata=AUTH)
        while served.engine.num_queued < 1:  # admitted on the asyncio side, not yet by the engine
            await asyncio.sleep(0.01)
        found = await stub.Abort(pb.AbortRequest(request_id="early"), metadata=AUTH)
        gate.set()
        await held
        return [m async for m in call], found.found

    async def waiting(stub):
        # eight samples take every place in the batch (max_num_seqs 8); the next request waits
        busy = stub.Generate(pb.GenerateRequest(text=PROMPTS[0], sampling_params=greedy(60, n=8)), metadata=AUTH)
        await busy.read()
        call = stub.Generate(pb.GenerateRequest(request_id="waits", token_ids=pb.TokenIds(ids=[5, 6, 7, 8]),
                                                sampling_params=pb.SamplingParams(n=3, max_tokens=50)), metadata=AUTH)
        while served.engine.stats().num_requests_waiting < 1:
            await asyncio.sleep(0.005)
        found = await stub.Abort(pb.AbortRequest(request_id="waits"), metadata=AUTH)
        msgs = [m async for m in call]
        busy.cancel()
        return msgs, found.found

    async def main():
        async with grpc.aio.insecure_channel(served.target) as ch:
            stub = pb_grpc.GenerationStub(ch)
            return await admitting(stub), await waiting(stub)

    restore = slowed(served.engine, 0.02)
    try:
        (early, found_early), (waits, found_waiting) = asyncio.run(main())
    finally:
        gate.set()
        restore()
    for msgs, found, prompt_len in ((early, found_early, 3), (waits, found_waiting, 4)):
        assert found and msgs[-1].finished
        ends = sorted((o.index, o.finish_reason) for m in msgs for o in m.outputs if o.finish_reason)
        assert ends == [(0, "abort"), (1, "abort"), (2, "abort")]
        assert msgs[-1].usage.prompt_tokens == prompt_len
        assert msgs[-1].usage.completion_tokens == len(tokens(msgs)) < 150
    assert len(waits) == 1 and tokens(waits) == []  # it never ran
    assert owned(served.engine) == {}


def test_64_grpc_and_64_http_streams_at_once_all_complete(served):
    async def over_grpc(stub, i):
        msgs = [m async for m in stub.Generate(pb.GenerateRequest(text=PROMPTS[i % 4], sampling_params=greedy()),
                                               metadata=AUTH)]
        return tokens(msgs), msgs[-1].finished

    async def over_http(client, i):
        text, done = "", False
        async with client.stream("POST", "/v1/completions", json={
                "model": "tiny", "prompt": PROMPTS[i % 4], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text += httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
        return text, done

    async def main():
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with grpc.aio.insecure_channel(served.target) as ch, httpx.AsyncClient(
                base_url=served.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300, limits=limits) as client:
            stub = pb_grpc.GenerationStub(ch)
            return await asyncio.gather(asyncio.gather(*(over_grpc(stub, i) for i in range(64))),
                                        asyncio.gather(*(over_http(client, i) for i in range(64))))

    by_grpc, by_http = asyncio.run(main())
    assert [r for r in by_grpc] == [(served.refs["ids"][i % 4], True) for i in range(64)]
    assert [r for r in by_http] == [(served.refs["texts"][i % 4], True) for i in range(64)]
    assert owned(served.engine) == {}


def test_a_full_queue_is_resource_exhausted(llama_dir):
    engine = AsyncEngine(LLM(llama_dir, **ENGINE, max_num_queued_requests=1).llm_engine)
    app = build_app(engine, served_model_name="tiny")
    front = GrpcFrontEnd(app, 0)
    gate = threading.Event()

    async def main():
        # hold the engine thread, so that the first request stays queued while the second arrives
        held = asyncio.ensure_future(engine.call(lambda eng: gate.wait(30)))
        async with grpc.aio.insecure_channel(front.target) as ch:
            stub = pb_grpc.GenerationStub(ch)
            first = stub.Generate(pb.GenerateRequest(text=PROMPTS[0], sampling_params=greedy()))
            while engine.num_queued < 1:
                await asyncio.sleep(0.01)
            second = stub.Generate(pb.GenerateRequest(text=PROMPTS[0], sampling_params=greedy()))
            try:
                [m async for m in second]
                err = None
            except grpc.aio.AioRpcError as e:
                err = e
            gate.set()
            await held
            return [m async for m in first], err

    try:
        with uvicorn_thread(app, engine, (front,)):
            msgs, err = asyncio.run(main())
    finally:
        gate.set()
        engine.shutdown()
    assert msgs[-1].finished and len(tokens(msgs)) == 12
    assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_num_queued_requests is 1" in err.details()


def test_an_abort_while_a_call_and_its_duplicate_are_admitted_is_never_lost(served, monkeypatch):
    """Abort(X) while Generate(X) and a duplicate Generate(X) are both being admitted: the first
    one is admitted, the duplicate fails afterwards; the abort still ends the first one's stream."""
    s = served.app.state.server
    inputs = s.completion_inputs

    async def slow_inputs(req, client=""):
        await asyncio.sleep(1.2 if req.prompt == "dup" else 0.6)  # the duplicate is admitted last
        return await inputs(req, client)

    monkeypatch.setattr(s, "completion_inputs", slow_inputs)
    core = served.engine.engine.client.local_cores[0]
    collect = core.runner.collect
    monkeypatch.setattr(core.runner, "collect", lambda step: (time.sleep(0.03), collect(step))[1])  # >= 3 s

    async def main():
        async with grpc.aio.insecure_channel(served.target) as ch:
            stub = pb_grpc.GenerationStub(ch)
            first = stub.Generate(pb.GenerateRequest(request_id="race", text=PROMPTS[0],
                                                     sampling_params=greedy(100)), metadata=AUTH)
            second = stub.Generate(pb.GenerateRequest(request_id="race", text="dup", sampling_params=greedy()),
                                   metadata=AUTH)
            await asyncio.sleep(0.2)  # both admitting
            found = await stub.Abort(pb.AbortRequest(request_id="race"), metadata=AUTH)
            msgs = []
            while (m := await first.read()) is not grpc.aio.EOF:
                msgs.append(m)
            try:
                await second.read()
                dup = None
            except grpc.aio.AioRpcError as e:
                dup = e.code()
            return found.found, msgs, dup

    found, msgs, dup = asyncio.run(main())
    assert found and dup == grpc.StatusCode.INVALID_ARGUMENT
    assert msgs[-1].finished and [o.finish_reason for o in msgs[-1].outputs] == ["abort"]
    assert owned(served.engine) == {}


def test_health_watch_streams_are_capped(served, monkeypatch):
    from serving.grpc_server import HealthService

    monkeypatch.setattr(HealthService, "MAX_WATCHERS", 3)

    async def main():
        async with grpc.aio.insecure_channel(served.target) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            watches = [health.Watch(health_pb2.HealthCheckRequest(service="")) for _ in range(3)]
            for w in watches:
                assert (await w.read()).status == health_pb2.HealthCheckResponse.SERVING
            extra = health.Watch(health_pb2.HealthCheckRequest(service=""))
            try:
                await extra.read()
                code = None
            except grpc.aio.AioRpcError as e:
                code = e.code()
            for w in watches:
                w.cancel()
            return code

    assert asyncio.run(main()) == grpc.StatusCode.RESOURCE_EXHAUSTED
