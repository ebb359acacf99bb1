"""data_parallel_size: cores on disjoint device groups, each with its own loop, behind one client.

Everything that needs several devices runs in ONE subprocess with 4 simulated CPU devices
(XLA_FLAGS must be set before jax starts, and each engine costs seconds of compilation): a
single-device LLM, data_parallel_size 2 x tensor_parallel_size 2 and 2 x 1 on a mixed greedy batch
(chunked prefills, decodes, preemptions), a step failing on one core, aborts, prefix-aware routing,
an AsyncEngine over the cores, and two cores with stub runners whose steps sleep (one in a long
prefill, the other decoding). The subprocess prints one JSON line; the tests here read it.
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
    from jaxsched.bench.stub_runner import SleepingRunner
    from jaxsched.parallel.data_parallel import DataParallelClient
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

    def drain(eng):
        """Step until nothing is in flight: {request id: final output}; a StepFailedError's outputs kept."""
        done, failures = {}, []
        while eng.has_unfinished_requests():
            try:
                outs = eng.step()
            except StepFailedError as e:
                outs = e.outputs
                failures.append(str(e))
            done.update((o.request_id, o) for o in outs if o.finished)
        return done, failures

    res["base"] = ids(base.generate(prompts, params, use_tqdm=False))
    res["base_preemptions"] = base.llm_engine.stats().num_preemptions
    res["t_base"] = time.perf_counter() - t0

    for tp in (2, 1):
        t = time.perf_counter()
        llm = LLM(model, **ENGINE, data_parallel_size=2, tensor_parallel_size=tp)
        eng = llm.llm_engine
        client = eng.client
        routed = []
        route = client.route
        client.route = lambda req, _route=route: routed.append((req.request_id, _route(req))) or routed[-1][1]
        out = {"type": type(client).__name__, "devices": [[d.id for d in c.devices] for c in client.local_cores],
               "tokens": ids(llm.generate(prompts, params, use_tqdm=False)), "routed": routed}
        client.route = route
        st = eng.stats()
        each = [c.stats() for c in client.local_cores]
        out["stats_ok"] = (st.num_preemptions == sum(s.num_preemptions for s in each)
                           and st.num_scheduled_tokens == sum(s.num_scheduled_tokens for s in each)
                           and st.num_requests_running == 0 and st.kv_cache_usage_perc == 0.0)
        out["preempted_each"] = [s.num_preemptions for s in each]
        out["idle"] = not eng.has_unfinished_requests() and client.load() == [0, 0]
        out["t"] = time.perf_counter() - t
        res[f"dp2_tp{tp}"] = out

    # eng: the 2 x 1 engine. A step that fails on core 1 ends core 1's requests of that step; core 0's
    # requests go on untouched
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    core1 = client.local_cores[1]
    run = core1.runner.run
    def on_fire(*a, **k):
        core1.runner.run = run
        raise RuntimeError("device on fire")
    core1.runner.run = on_fire
    for i in range(4):
        eng.add_request(f"f{i}", prompts[i], greedy)
    where = {f"f{i}": client.core_of(f"f{i}") for i in range(4)}
    done, failures = drain(eng)
    res["failed"] = {"where": where, "failures": failures,
                     "errors": sorted(r for r, o in done.items() if o.error),
                     "ok": sorted(r for r, o in done.items() if not o.error),
                     "tokens_ok": all(list(o.outputs[0].token_ids) == res["base"][int(r[1])][:6]
                                      for r, o in done.items() if not o.error),
                     "load": client.load()}

    # aborts go to the core holding the request, by the request's id or a sample's (the whole
    # request); ids are unique across cores
    eng.add_request("solo", prompts[0], greedy)
    eng.add_request("pair", prompts[1], SamplingParams(n=2, temperature=0.0, max_tokens=6))
    eng.add_request("trio", prompts[2], SamplingParams(n=3, temperature=0.0, max_tokens=6))
    where = {r: client.core_of(r) for r in ("solo", "pair", "0_pair", "trio", "2_trio")}
    load = client.load()
    dup = None
    try:
        eng.add_request("solo", prompts[0], greedy)
    except ValueError as e:
        dup = str(e)
    eng.abort_request("pair")
    eng.abort_request(["2_trio", "nobody"])
    res["aborts"] = {"where": where, "load": load, "dup": dup, "load_after": client.load(),
                     "idle_after": (eng.abort_request("solo"), not eng.has_unfinished_requests())[1]}
    drain(eng)

    # prefix-aware routing: six requests sharing a four-block prefix go to one core until it has no
    # free seat (max_num_seqs 4) while the other has; one with another prefix goes to the least loaded
    prefix = tok.encode(" ".join(words * 2))[:32]
    assert len(prefix) == 32
    long = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i in range(6):
        eng.add_request(f"p{i}", {"prompt_token_ids": prefix + [10 + i, 11 + i]}, long)
    eng.add_request("other", {"prompt_token_ids": [7, 8, 9] * 11}, long)
    res["prefix"] = {"where": [client.core_of(f"p{i}") for i in range(6)], "other": client.core_of("other"),
                     "load": client.load()}
    drain(eng)

    # the server side: an AsyncEngine over the data-parallel cores, concurrent requests
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

    # independence: core 0 in a long prefill (a stub runner: 1.5 s prefills, 20 ms decodes) does not
    # hold core 1's decodes
    llm = LLM(model, **ENGINE, data_parallel_size=2, async_scheduling=False)
    eng = llm.llm_engine
    for core in eng.client.local_cores:
        core.runner = SleepingRunner(core.runner, prefill_s=1.5, decode_s=0.02)
    eng.add_request("decode", {"prompt_token_ids": [3]}, SamplingParams(max_tokens=60, ignore_eos=True))
    eng.add_request("prefill", {"prompt_token_ids": list(range(20, 36))}, SamplingParams(max_tokens=2, ignore_eos=True))
    res["stub_where"] = [eng.client.core_of("decode"), eng.client.core_of("prefill")]
    arrivals = {"decode": [], "prefill": []}
    while eng.has_unfinished_requests():
        for o in eng.step():
            arrivals[o.request_id].append(time.perf_counter())
    first_prefill_token = arrivals["prefill"][0]
    res["stub_decodes_before_prefill_token"] = sum(t < first_prefill_token for t in arrivals["decode"])
    eng.shutdown()

    # too many devices asked: refused before any core loads
    t = time.perf_counter()
    try:
        LLM(model, **ENGINE, data_parallel_size=3, tensor_parallel_size=2)
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
        assert out["type"] == "DataParallelClient"
        assert out["tokens"] == result["base"], key
        assert out["stats_ok"] and out["idle"], key  # summed stats, all finished, no seat counted


def test_cores_run_on_disjoint_devices_and_share_the_requests(result):
    assert result["dp2_tp2"]["devices"] == [[0, 1], [2, 3]]
    assert result["dp2_tp1"]["devices"] == [[0], [1]]
    for key in ("dp2_tp2", "dp2_tp1"):
        routed = result[key]["routed"]
        # distinct prompts, all added before any step: least loaded first, ties to the lowest index
        assert [core for _, core in routed] == [0, 1] * 4, routed


def test_a_step_failing_on_one_core_leaves_the_other_cores_requests_alone(result):
    failed = result["failed"]
    on1 = sorted(r for r, core in failed["where"].items() if core == 1)
    on0 = sorted(r for r, core in failed["where"].items() if core == 0)
    assert on1 and on0, failed["where"]
    assert failed["failures"] and all("device on fire" in f for f in failed["failures"])
    assert failed["errors"] == on1  # core 1's requests ended with an error ...
    assert failed["ok"] == on0 and failed["tokens_ok"]  # ... core 0's finished as one engine gives them
    assert failed["load"] == [0, 0]


def test_aborts_and_ids_across_cores(result):
    ab = result["aborts"]
    # solo (1 sample) -> core 0; pair (2 samples) -> core 1; trio -> core 0 (1 < 2)
    assert ab["where"] == {"solo": 0, "pair": 1, "0_pair": 1, "trio": 0, "2_trio": 0}
    assert ab["load"] == [4, 2]
    assert ab["dup"] is not None and "already in flight" in ab["dup"]
    assert ab["load_after"] == [1, 0]  # pair aborted by its id, trio by a sample's id: solo remains
    assert ab["idle_after"]


def test_requests_sharing_a_prefix_land_on_one_core_until_it_is_full(result):
    pre = result["prefix"]
    first = pre["where"][0]
    assert pre["where"] == [first] * 4 + [1 - first] * 2  # max_num_seqs 4: the fifth would wait there
    assert pre["other"] == 1 - first
    assert pre["load"] == ([4, 3] if first == 0 else [3, 4])


def test_async_engine_over_data_parallel_cores(result):
    assert result["async"] == result["base"]


def test_a_core_in_a_long_prefill_does_not_hold_the_others_decodes(result):
    """Stub runners (steps sleep: 1.5 s prefill, 20 ms decode): the decode on core 0 keeps coming
    while core 1 sits in its prefill (lockstep cores would give it no token in that time)."""
    assert result["stub_where"] == [0, 1]
    assert result["stub_decodes_before_prefill_token"] >= 20


def test_more_devices_than_present_is_refused_before_loading(result):
    msg = result["too_many"]
    assert msg is not None
    assert "tensor_parallel_size=2" in msg and "data_parallel_size=3" in msg and "4 cpu device(s)" in msg
    assert "xla_force_host_platform_device_count" in msg
    assert result["too_many_s"] < 1.0
