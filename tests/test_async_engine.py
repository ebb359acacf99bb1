"""AsyncEngine: the step loop on its own thread, driven from asyncio (no HTTP)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxsched import LLM, EngineArgs, SamplingParams
from jaxsched.core.request import RequestOutputKind
from jaxsched.engine.outputs import CompletionOutput, Logprob, RequestOutput
from jaxsched.errors import QueueFullError
from serving.async_engine import AsyncEngine, EngineDeadError, EngineStepError, merge_delta

ENGINE = {"max_model_len": 96, "max_num_seqs": 8, "max_num_batched_tokens": 32, "block_size": 8}
PROMPTS = ["the capital of france is", "hello world , how are you", "one two three", "what is a cat ?"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(llama_dir):
    llm = LLM(llama_dir, **ENGINE)
    reference = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # before the engine thread owns the engine
    engine = AsyncEngine(llm.llm_engine)
    yield engine, reference
    engine.shutdown()


def owned_blocks(engine: AsyncEngine) -> dict:
    return asyncio.run(engine.call(lambda eng: dict(eng.block_manager.req_blocks)))[0]


def test_generate_streams_cumulative_outputs_equal_to_offline(setup):
    engine, reference = setup

    async def one(i):
        seen = []
        async for out in engine.generate(PROMPTS[i], GREEDY, request_id=f"gen-{i}"):
            seen.append(out)
        return seen

    async def main():
        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))

    for seen, ref in zip(asyncio.run(main()), reference):
        final = seen[-1]
        assert final.finished and all(not o.finished for o in seen[:-1])
        assert final.outputs[0].token_ids == ref.outputs[0].token_ids
        assert final.outputs[0].text == ref.outputs[0].text
        lengths = [len(o.outputs[0].token_ids) for o in seen]
        assert lengths == sorted(lengths)  # cumulative, never shrinking (possibly coalesced)
    assert owned_blocks(engine) == {}


def test_bad_input_raises_and_the_loop_goes_on(setup):
    engine, reference = setup

    async def main():
        with pytest.raises(ValueError, match="prompt is empty"):
            await engine.add_request("", GREEDY)
        with pytest.raises(ValueError, match="max_model_len is 96"):
            await engine.add_request({"prompt_token_ids": [5] * 200}, GREEDY)
        stream = await engine.add_request(PROMPTS[0], GREEDY, request_id="dup")
        with pytest.raises(ValueError, match="already in flight"):
            await engine.add_request(PROMPTS[0], GREEDY, request_id="dup")
        outs = [o async for o in stream]
        return outs[-1]

    final = asyncio.run(main())
    assert final.outputs[0].token_ids == reference[0].outputs[0].token_ids


def test_abort_and_early_close_free_the_blocks(setup):
    engine, _ = setup
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)

    async def main():
        stream = await engine.add_request(PROMPTS[1], long, request_id="to-abort")
        first = await stream.__anext__()
        await engine.abort("to-abort")
        rest = [o async for o in stream]
        # leaving a generate() loop early aborts too
        agen = engine.generate(PROMPTS[2], long, request_id="to-close")
        async for out in agen:
            break
        await agen.aclose()
        # and so does leaving an `async with` block of a stream
        async with await engine.add_request(PROMPTS[3], long, request_id="to-exit") as stream:
            await stream.__anext__()
        assert stream.finished
        return first, rest, out

    first, rest, out = asyncio.run(main())
    assert not first.finished and rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert len(rest[-1].outputs[0].token_ids) < 60 and not out.finished
    assert owned_blocks(engine) == {}


def test_a_failing_step_fails_its_requests_not_the_loop(setup):
    engine, reference = setup

    def break_next_step(eng):
        real = eng.runner.run

        def run(batch):
            eng.runner.run = real
            raise RuntimeError("device on fire")

        eng.runner.run = run

    async def main():
        await engine.call(break_next_step)
        with pytest.raises(EngineStepError, match="device on fire"):
            async for _ in engine.generate(PROMPTS[0], GREEDY):
                pass
        return [o async for o in engine.generate(PROMPTS[0], GREEDY)][-1]

    final = asyncio.run(main())
    assert final.outputs[0].token_ids == reference[0].outputs[0].token_ids
    assert owned_blocks(engine) == {}


def test_a_host_side_step_failure_fails_every_request_in_flight_and_the_loop_goes_on(setup):
    engine, reference = setup
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)

    def break_next_update(eng):  # a bug on the host, after the device step: no request can be trusted
        real = eng.scheduler.update

        def update(*args):
            eng.scheduler.update = real
            raise RuntimeError("bookkeeping bug")

        eng.scheduler.update = update

    async def drain(stream):
        async for _ in stream:
            pass

    async def main():
        streams = [await engine.add_request(p, long) for p in PROMPTS[:2]]
        await streams[0].__anext__()  # both are in the running batch
        await engine.call(break_next_update)
        results = await asyncio.gather(*(drain(s) for s in streams), return_exceptions=True)
        return results, [o async for o in engine.generate(PROMPTS[0], GREEDY)][-1]

    results, final = asyncio.run(main())
    assert all(isinstance(e, EngineStepError) and "bookkeeping bug" in str(e) for e in results), results
    assert final.outputs[0].token_ids == reference[0].outputs[0].token_ids
    assert owned_blocks(engine) == {}


def test_idle_engine_sleeps_instead_of_spinning(setup):
    engine, _ = setup
    steps = []

    def count_steps(eng):
        real = eng.step

        def step():
            steps.append(1)
            return real()

        eng.step = step
        return real

    real = asyncio.run(engine.call(count_steps))[0]
    # the core's loop thread and the output thread: each waits on its queue
    clocks = [time.pthread_getcpuclockid(t.ident) for t in (engine.engine.client._thread, engine._thread)]
    cpu0 = [time.clock_gettime(c) for c in clocks]
    time.sleep(0.3)
    try:
        assert steps == [] and engine.is_running
        assert all(time.clock_gettime(c) - t0 < 0.03 for c, t0 in zip(clocks, cpu0))
    finally:
        asyncio.run(engine.call(lambda eng: setattr(eng, "step", real)))


@pytest.fixture
def limited(llama_dir):
    """An engine whose EngineArgs allow two queued requests (built as vLLM users build one)."""
    engine = AsyncEngine.from_engine_args(EngineArgs(model=llama_dir, **ENGINE, max_num_queued_requests=2))
    yield engine
    engine.shutdown()


def test_queue_limit_and_stats(limited):
    engine = limited
    m = engine.metrics

    async def main():
        # Hold the engine thread while the six arrive, so that none starts running (which would free
        # a queue place) before all six have been counted: the limit is then exact, however loaded
        # the machine is.
        gate = threading.Event()
        held = asyncio.ensure_future(engine.call(lambda eng: gate.wait(30)))
        await asyncio.sleep(0.05)
        adds = [asyncio.ensure_future(engine.add_request(PROMPTS[0], GREEDY)) for _ in range(6)]
        await asyncio.sleep(0)  # each add checks the limit before its first await
        gate.set()
        res = await asyncio.gather(*adds, return_exceptions=True)
        await held
        streams = [r for r in res if not isinstance(r, BaseException)]
        errors = [r for r in res if isinstance(r, BaseException)]
        for s in streams:
            async for _ in s:
                pass
        return streams, errors

    streams, errors = asyncio.run(main())
    assert len(streams) == 2 and len(errors) == 4
    assert all(isinstance(e, QueueFullError) and "max_num_queued_requests is 2" in str(e) for e in errors)
    assert m.value("request_success_total", finished_reason="length") == 2
    assert m.value("generation_tokens_total") == 24
    assert m.value("time_to_first_token_seconds_count") == 2 and m.value("inter_token_latency_seconds_count") >= 22
    stats = engine.stats()  # the engine's EngineStats, as of its last step
    assert stats.num_requests_running == stats.num_requests_waiting == 0 and stats.kv_cache_usage_perc == 0.0
    assert stats.num_steps > 0 and stats.num_scheduled_tokens > 0
    families = {f.name: f for f in text_string_to_metric_families(engine.metrics.render(model_name="tiny").decode())}
    assert families["jaxsched:time_to_first_token_seconds"].type == "histogram"
    [success] = families["jaxsched:request_success"].samples
    assert success.labels == {"model_name": "tiny", "finished_reason": "length"} and success.value == 2


def test_a_finished_request_nobody_reads_gives_back_its_queue_place(setup):
    """The admission count follows the engine, not the reader: a client that stopped reading must
    not hold a place in max_num_queued_requests once its request is done."""
    engine, _ = setup

    async def main():
        stream = await engine.add_request(PROMPTS[0], GREEDY)  # never read
        while (await engine.call(lambda eng: eng.has_unfinished_requests()))[0]:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the final output reaches this loop
        queued = engine.num_queued
        outs = [o async for o in stream]  # still all there for a late reader
        return queued, outs

    queued, outs = asyncio.run(main())
    assert queued == 0
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 12


def test_merge_delta_appends_in_place():
    """A DELTA output nobody read yet takes the next ones in: text and lists appended, the latest
    finish and metrics, samples of an n > 1 request by index."""
    lp = [{5: Logprob(-0.1, 1)}]
    into = RequestOutput("r", None, [1], [CompletionOutput(0, "he", [5], logprobs=list(lp))], False)
    new = RequestOutput("r", None, [1], [CompletionOutput(0, "llo", [6, 7], logprobs=lp * 2, finish_reason="stop",
                                                          stop_reason="x"),
                                         CompletionOutput(1, "a", [9])], True)
    merge_delta(into, new)
    c0, c1 = into.outputs
    assert (c0.text, c0.token_ids, len(c0.logprobs), c0.finish_reason, c0.stop_reason) == ("hello", [5, 6, 7], 3,
                                                                                           "stop", "x")
    assert (c1.index, c1.text, c1.token_ids) == (1, "a", [9]) and into.finished


def test_delta_stream_read_slowly_merges_and_loses_nothing(setup):
    """A DELTA stream whose reader sleeps between reads gets fewer, merged outputs whose texts and
    tokens add up to the offline output, with no text a stop string could still remove sent early."""
    engine, reference = setup
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def main():
        outs = []
        async for out in engine.generate(PROMPTS[1], params):
            outs.append(out)
            await asyncio.sleep(0.05)
        return outs

    outs = asyncio.run(main())
    ref = reference[1].outputs[0]
    assert "".join(o.outputs[0].text for o in outs) == ref.text
    assert [t for o in outs for t in o.outputs[0].token_ids] == ref.token_ids
    assert outs[-1].finished and all(not o.finished for o in outs[:-1]) and len(outs) < 12
    stop = ref.text[4:6]  # a stop string the output reaches: what precedes it only
    params = dataclasses.replace(params, stop=[stop])
    texts = asyncio.run(_collect(engine, PROMPTS[1], params))
    assert "".join(texts) == ref.text[:ref.text.index(stop)]


async def _collect(engine, prompt, params):
    return [o.outputs[0].text async for o in engine.generate(prompt, params)]


def test_an_engine_not_running_refuses_requests(setup):
    stopped = AsyncEngine(setup[0].engine, start=False)

    async def main():
        with pytest.raises(EngineDeadError, match="not running"):
            await stopped.add_request("hello", GREEDY)

    asyncio.run(main())
