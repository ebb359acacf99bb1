"""data_parallel_size: replicas on disjoint device groups give the outputs of one engine.

Everything that needs several devices runs in ONE subprocess with 4 simulated CPU devices
(XLA_FLAGS must be set before jax starts, and each engine costs seconds of compilation): a
single-device LLM, data_parallel_size 2 x tensor_parallel_size 2 and 2 x 1 on a mixed greedy batch
(chunked prefills, decodes, preemptions), a step failing on one replica, aborts, and an AsyncEngine
over the data-parallel engine. The subprocess prints one JSON line; the tests here read it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(r'''
    import asyncio, json, sys, time
    import jax
    from jaxsched import LLM, SamplingParams
    from jaxsched.data_parallel import DataParallelEngine
    from jaxsched.errors import StepFailedError
    from serving.async_engine import AsyncEngine

    model = sys.argv[1]
    ENGINE = dict(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=16, block_size=8,
                  num_gpu_blocks_override=10, enable_prefix_caching=False,
                  preemption_mode="recompute")
    res = {"num_devices": len(jax.devices())}
    t0 = time.perf_counter()

    base = LLM(model, **ENGINE)
    tok = base.get_tokenizer()
    words = "the cat sat on a mat while one dog ran far away from the old red barn and two birds sang".split()
    prompts = [{"prompt_token_ids": tok.encode(" ".join(words[i % 5:]))[: 3 + (7 * i) % 19]} for i in range(8)]
    params = [SamplingParams(temperature=0.0, max_tokens=10 + (5 * i) % 17, ignore_eos=True) for i in range(8)]

    def ids(outs):
        return [list(o.outputs[0].token_ids) for o in outs]

    res["base"] = ids(base.generate(prompts, params, use_tqdm=False))
    res["base_preemptions"] = base.llm_engine.stats().num_preemptions
    res["t_base"] = time.perf_counter() - t0

    def dealt(eng):
        """Wrap each replica's add_request_obj to record which requests it was dealt."""
        got = [[] for _ in eng.replicas]
        for i, rep in enumerate(eng.replicas):
            def add(req, _add=rep.add_request_obj, _i=i):
                got[_i].append(req.request_id)
                _add(req)
            rep.add_request_obj = add
        return got

    for tp in (2, 1):
        t = time.perf_counter()
        llm = LLM(model, **ENGINE, data_parallel_size=2, tensor_parallel_size=tp)
        eng = llm.llm_engine
        got = dealt(eng)
        out = {"type": type(eng).__name__, "devices": [[d.id for d in r.devices] for r in eng.replicas],
               "tokens": ids(llm.generate(prompts, params, use_tqdm=False)), "dealt": [list(g) for g in got]}
        st = eng.stats()
        each = [r.stats() for r in eng.replicas]
        out["stats_ok"] = (st.num_preemptions == sum(s.num_preemptions for s in each) > 0
                           and st.num_scheduled_tokens == sum(s.num_scheduled_tokens for s in each)
                           and st.num_requests_running == 0 and st.kv_cache_usage_perc == 0.0)
        out["idle"] = not eng.has_unfinished_requests()
        out["t"] = time.perf_counter() - t
        res[f"dp2_tp{tp}"] = out

    # eng: the 2 x 1 engine. A step that fails on replica 1 keeps replica 0's outputs of that step.
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i in range(4):
        eng.add_request(f"f{i}", prompts[i], greedy)
    load = eng.load()
    eng.step()
    rep1 = eng.replicas[1]
    run = rep1.runner.run
    def on_fire(*a, **k):
        raise RuntimeError("device on fire")
    rep1.runner.run = on_fire
    try:
        eng.step()
        res["failed"] = None
    except StepFailedError as e:
        res["failed"] = {"ids": sorted(e.request_ids), "all": sorted(o.request_id for o in e.outputs),
                         "msg": str(e)}
    rep1.runner.run = run
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
    res["after_failure"] = {"load": load, "finished": sorted(done),
                            "tokens_ok": all(done[r] == res["base"][int(r[1])][:6] for r in done)}

    # aborts go to the replica holding the request, by the parent id or a sample's id; ids are
    # unique across replicas
    eng.add_request("solo", prompts[0], greedy)
    eng.add_request("pair", prompts[1], SamplingParams(n=2, temperature=0.0, max_tokens=6))
    eng.add_request("trio", prompts[2], SamplingParams(n=3, temperature=0.0, max_tokens=6))
    where = {r: eng.replica_of(r) for r in ("solo", "pair", "0_pair", "trio", "2_trio")}
    dup = None
    try:
        eng.add_request("solo", prompts[0], greedy)
    except ValueError as e:
        dup = str(e)
    eng.step()
    eng.abort_request("pair")
    eng.abort_request(["2_trio", "nobody"])
    res["aborts"] = {"where": where, "dup": dup, "load": eng.load(),
                     "idle_after": (eng.abort_request("solo"), not eng.has_unfinished_requests())[1]}

    # the server side: an AsyncEngine over the data-parallel engine, concurrent requests
    async def serve():
        a = AsyncEngine(eng)
        try:
            async def one(i):
                last = None
                async for o in a.generate(prompts[i], params[i], request_id=f"s{i}"):
                    last = o
                return list(last.outputs[0].token_ids)
            return await asyncio.gather(*(one(i) for i in range(8)))
        finally:
            a.shutdown()
    res["async"] = asyncio.run(serve())

    # too many devices asked: refused before any replica loads
    t = time.perf_counter()
    try:
        DataParallelEngine(model=model, **ENGINE, data_parallel_size=3, tensor_parallel_size=2)
        res["too_many"] = None
    except ValueError as e:
        res["too_many"] = str(e)
    res["too_many_s"] = time.perf_counter() - t
    res["total_s"] = time.perf_counter() - t0
    print("RESULT " + json.dumps(res))
''')


@pytest.fixture(scope="module")
def result(tokenizer_dir, tmp_path_factory):
    model = tiny.build_model(str(tmp_path_factory.mktemp("dp") / "llama"), "llama", tokenizer_dir)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, model], capture_output=True, text=True, timeout=600, check=False,
                          env=env, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


pytestmark = pytest.mark.slow


def test_data_parallel_outputs_equal_one_engine(result):
    assert result["num_devices"] == 4
    assert result["base_preemptions"] > 0  # the batch is mixed: chunked prefills, decodes, preemption
    for key in ("dp2_tp2", "dp2_tp1"):
        out = result[key]
        assert out["type"] == "DataParallelEngine"
        assert out["tokens"] == result["base"], key
        assert out["stats_ok"] and out["idle"], key  # summed stats: both replicas preempted, all finished


def test_replicas_run_on_disjoint_devices_and_share_the_requests(result):
    assert result["dp2_tp2"]["devices"] == [[0, 1], [2, 3]]
    assert result["dp2_tp1"]["devices"] == [[0], [1]]
    for key in ("dp2_tp2", "dp2_tp1"):
        dealt = result[key]["dealt"]
        # least loaded first, ties to the lowest index: all eight are added before any step
        assert [len(d) for d in dealt] == [4, 4], dealt
        assert set(dealt[0]).isdisjoint(dealt[1]) and len(set(dealt[0] + dealt[1])) == 8


def test_a_step_failing_on_one_replica_keeps_the_others_outputs(result):
    failed = result["failed"]
    assert failed is not None and "device on fire" in failed["msg"]
    assert failed["ids"] == ["f1", "f3"]  # replica 1's requests ended with an error...
    # ...and replica 0's outputs of the step came with them (f0's token; f2's prompt is chunked, and
    # with overlapped scheduling a step returns the tokens of the step before it)
    assert set(failed["all"]) > set(failed["ids"]) and "f0" in failed["all"]
    after = result["after_failure"]
    assert after["load"] == [2, 2]
    assert after["finished"] == ["f0", "f2"] and after["tokens_ok"]


def test_aborts_and_ids_across_replicas(result):
    ab = result["aborts"]
    # solo (1 sample) -> replica 0; pair (2 samples) -> replica 1; trio -> replica 0 (1 < 2)
    assert ab["where"] == {"solo": 0, "pair": 1, "0_pair": 1, "trio": 0, "2_trio": 0}
    assert ab["dup"] is not None and "already in flight" in ab["dup"]
    assert ab["load"] == [1, 0]  # pair aborted by its id, trio by a sample's id: solo remains
    assert ab["idle_after"]


def test_async_engine_over_data_parallel_replicas(result):
    assert result["async"] == result["base"]


def test_more_devices_than_present_is_refused_before_loading(result):
    msg = result["too_many"]
    assert msg is not None
    assert "tensor_parallel_size=2" in msg and "data_parallel_size=3" in msg and "4 cpu device(s)" in msg
    assert "xla_force_host_platform_device_count" in msg
    assert result["too_many_s"] < 1.0
