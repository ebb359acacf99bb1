"""cpu_reserved_cores: the host's Python threads on their own core(s), the model's threads on the
rest, numba's regions limited to those (jaxsched/platforms/cpu_affinity.py, pallas_kernels/numba_threads.py).

Placing threads is process-wide, so the engines run in a subprocess; it prints one JSON line.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from jaxsched.config import EngineArgs, ModelConfig, reserved_cores
from jaxsched.platforms import cpu_affinity
from jaxsched.platforms.cpu_affinity import available_cores, check

ROOT = pathlib.Path(__file__).parents[1]

SCRIPT = textwrap.dedent('''
    import json, logging, os, sys, threading
    from jaxsched import LLM, SamplingParams
    from jaxsched.platforms.cpu_affinity import available_cores, pool_threads
    from pallas_kernels import numba_threads

    model = sys.argv[1]
    first = sys.argv[2] == "reserved-first"  # the reserving engine starts jax (else one without does)
    warnings, decisions = [], []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("jaxsched.platforms.cpu_affinity").addHandler(handler)
    info = logging.Handler(logging.INFO)
    info.emit = lambda record: decisions.append(record.getMessage())
    logging.getLogger("jaxsched.engine.core").addHandler(info)
    logging.getLogger("jaxsched.engine.core").setLevel(logging.INFO)
    cores = available_cores()
    kw = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, num_gpu_blocks_override=12,
              block_size=16)
    # prompts of several lengths, outputs of several lengths: chunked prefills beside decodes, rows
    # ending at different steps, and preemption in a small pool
    prompts = [{"prompt_token_ids": [(7 * i + j) % 90 + 3 for j in range(5 + 9 * i)]} for i in range(10)]
    params = [SamplingParams(max_tokens=12 + 5 * (i % 4), temperature=0.0, ignore_eos=True) for i in range(10)]

    def run(llm):
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    res = {"cores": list(cores)}
    def placement():
        python = {t.native_id for t in threading.enumerate()}
        placed = {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
        return (sorted({tuple(c) for t, c in placed.items() if t in python}),
                sorted({tuple(c) for t, c in placed.items() if t not in python}))

    if first:  # an engine with "auto" first: it decides, and reserves, before anything starts jax
        b = LLM(model, cpu_reserved_cores="auto", **kw)
        res.update(pool=pool_threads(), reserved=run(b), warnings=warnings,
                   auto=[d for d in decisions if d.startswith("cpu_reserved_cores=auto")])
        res["python"], res["others"] = placement()
        print("RESULT " + json.dumps(res))
        sys.exit(0)
    a = LLM(model, **kw)  # the library's default: no reserve
    res["default_placement"] = placement()
    res["limit_before"] = numba_threads.limit()
    res["base"] = run(a)
    res["preemptions_base"] = a.llm_engine.stats().num_preemptions
    del a
    b = LLM(model, cpu_reserved_cores=1, **kw)
    res["reserved"] = run(b)
    res["pool"] = pool_threads()
    res["warnings"] = list(warnings)
    res["limit"] = numba_threads.limit()
    res["python"], res["others"] = placement()
    late = []
    t = threading.Thread(target=lambda: late.append(sorted(os.sched_getaffinity(0))))
    t.start(); t.join()
    res["late_python_thread"] = late[0]
    del b
    decisions.clear()
    d = LLM(model, cpu_reserved_cores="auto", **kw)  # a later engine keeps the process's split
    res["auto_after_reserve"] = [x for x in decisions if x.startswith("cpu_reserved_cores=auto")]
    res["auto_after_reserve_placement"] = placement()
    del d
    # an engine without reserved cores after one with: every thread back on every core, no limit
    c = LLM(model, cpu_reserved_cores=0, **kw)
    res["after_zero"] = sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")})
    res["limit_after_zero"] = numba_threads.limit()
    res["after_zero_tokens"] = run(c)
    try:
        LLM(model, cpu_reserved_cores=len(cores), **kw)
        res["too_many"] = None
    except ValueError as e:
        res["too_many"] = str(e)
    print("RESULT " + json.dumps(res))
''')


def _run(llama_dir: str, order: str) -> dict:
    if len(available_cores()) < 2:
        pytest.skip("reserving a core for the host needs a process with 2 cores or more")
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, llama_dir, order], capture_output=True, text=True,
                          timeout=600, check=False, env={**env, "JAX_PLATFORMS": "cpu"}, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def result(llama_dir):
    return _run(llama_dir, "unreserved-first")


def test_auto_reserves_a_core_for_a_small_model_and_sizes_xla_pools(llama_dir, result):
    """cpu_reserved_cores="auto" reserves one core for the tiny model (a step far below the FLOPs
    that want every core), and, built before anything starts jax, sizes XLA's CPU pools to the
    cores left for the device (two pool threads on one core take turns at every loop); a reserving
    engine built after leaves them and warns, saying what to do."""
    first = _run(llama_dir, "reserved-first")
    device = len(first["cores"]) - 1
    assert len(first["auto"]) == 1 and first["auto"][0].startswith("cpu_reserved_cores=auto: 1 ("), first["auto"]
    assert first["python"] == [first["cores"][-1:]] and first["others"] == [first["cores"][:-1]]
    assert first["pool"] == device and not first["warnings"]
    assert first["reserved"] == result["base"]  # the same greedy tokens as every thread on every core
    assert result["pool"] >= len(result["cores"])  # jax was started by the unreserved engine, sized to every core
    assert any(f"PJRT_NPROC={device}" in w and "Build the engine before using jax" in w
               for w in result["warnings"]), result["warnings"]


def test_outputs_equal_with_a_reserved_core(result):
    assert result["preemptions_base"] > 0  # the workload preempts: the comparison covers it
    assert result["reserved"] == result["base"]
    assert all(len(t) >= 12 for t in result["base"])


def test_python_threads_on_the_reserved_core_and_the_rest_elsewhere(result):
    cores = result["cores"]
    assert result["default_placement"] == [[cores], [cores]]  # the library's default placed nothing
    host, device = cores[-1:], cores[:-1]
    assert result["python"] == [host]  # the main thread and any other Python thread
    assert result["late_python_thread"] == host  # a thread started later inherits its creator's core
    assert result["others"] == [device]  # XLA's and numba's threads: on the model's cores only
    assert result["limit_before"] == 0  # an engine without reserved cores leaves numba alone
    assert result["limit"] == min(len(device), os.cpu_count() or 1)


def test_auto_after_a_reserve_keeps_the_split(result):
    cores = result["cores"]
    assert len(result["auto_after_reserve"]) == 1, result["auto_after_reserve"]
    assert result["auto_after_reserve"][0].startswith("cpu_reserved_cores=auto: 1 (an earlier engine")
    assert result["auto_after_reserve_placement"] == [[cores[-1:]], [cores[:-1]]]


def test_zero_after_a_reserve_puts_every_thread_back(result):
    assert result["after_zero"] == [result["cores"]]
    assert result["limit_after_zero"] == 0
    assert result["after_zero_tokens"] == result["base"]


def test_reserving_every_core_is_refused(result):
    msg = result["too_many"]
    assert msg is not None and "leaves no core for the model" in msg and f"at most {len(result['cores']) - 1}" in msg


@pytest.mark.parametrize("bad", [-1, True, 1.5, "1", "Auto"])
def test_bad_values_are_refused(bad):
    with pytest.raises(ValueError, match="cpu_reserved_cores must be a whole number >= 0 or 'auto'"):
        EngineArgs(cpu_reserved_cores=bad)


def _llama(D: int, F: int, L: int, N: int, K: int, V: int) -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", vocab_size=V, hidden_size=D, intermediate_size=F, num_layers=L,
                       num_heads=N, num_kv_heads=K, head_dim=D // N, rms_norm_eps=1e-5, rope_theta=1e4,
                       rope_scaling=None, max_position_embeddings=1024, tie_word_embeddings=False)


TINY = _llama(64, 128, 2, 4, 4, 300)
DEMO = _llama(576, 1536, 30, 9, 3, 49152)  # SmolLM2-135M's shapes
# the ladder of docs/PERFORMANCE.md's "Decisions in the code": 8.9 MFLOP a token gained from a
# reserved core on 2 cores, 17.9 lost
GAINED, LOST = _llama(256, 512, 6, 4, 4, 2048), _llama(320, 896, 6, 5, 5, 4096)
CLEAR = {"cpu": True, "jax_started": False, "own_devices": True, "async_scheduling": True}


def test_model_flops_per_token():
    """token_flops: layer_params (q, k, v, o and the MLP's three matrices) and the lm_head, twice, as
    the ladder's figures count them."""
    assert TINY.token_flops == pytest.approx(0.20e6, rel=0.02)
    assert GAINED.token_flops == pytest.approx(8.91e6, rel=1e-3)
    assert LOST.token_flops == pytest.approx(17.86e6, rel=1e-3)


@pytest.mark.parametrize("cores", [(0, 1), (0, 1, 2, 3)])
def test_auto_reserves_one_core_for_small_models_only(monkeypatch, cores):
    monkeypatch.setattr(cpu_affinity, "available_cores", lambda: cores)
    assert cpu_affinity.auto_reserved_cores(TINY, **CLEAR)[0] == 1
    n, why = cpu_affinity.auto_reserved_cores(DEMO, **CLEAR)
    assert n == 0 and "wants every core" in why
    # the ladder's two models either side of the line, on the 2 cores they were measured on
    if len(cores) == 2:
        assert cpu_affinity.auto_reserved_cores(GAINED, **CLEAR)[0] == 1
        assert cpu_affinity.auto_reserved_cores(LOST, **CLEAR)[0] == 0
    else:  # twice the cores: the larger model's step is as short per core as the smaller's on 2
        assert cpu_affinity.auto_reserved_cores(LOST, **CLEAR)[0] == 1


@pytest.mark.parametrize("case, reason", [
    ({"cpu": False}, "does not run on the host's cores"),
    ({"jax_started": True}, "jax started before the engine"),
    ({"own_devices": False}, "other replicas or hosts"),
])
def test_auto_reserves_nothing_where_it_is_not_the_engines_to_make_or_would_not_pay(monkeypatch, case, reason):
    monkeypatch.setattr(cpu_affinity, "available_cores", lambda: (0, 1))
    n, why = cpu_affinity.auto_reserved_cores(TINY, **{**CLEAR, **case})
    assert n == 0 and reason in why
    monkeypatch.setattr(cpu_affinity, "available_cores", lambda: (0,))
    assert cpu_affinity.auto_reserved_cores(TINY, **CLEAR) == (0, "this process may use one core")


def test_auto_draws_a_lower_line_without_overlap(monkeypatch):
    """A synchronous engine: on 2 cores 5.7 MFLOP a token (m192) gained 3-10 % from a reserved core
    and 8.9 (m256, GAINED with overlap) lost 6 %."""
    monkeypatch.setattr(cpu_affinity, "available_cores", lambda: (0, 1))
    sync = {**CLEAR, "async_scheduling": False}
    m192 = _llama(192, 512, 6, 3, 3, 1024)
    assert cpu_affinity.auto_reserved_cores(TINY, **sync)[0] == 1
    assert cpu_affinity.auto_reserved_cores(m192, **sync)[0] == 1
    n, why = cpu_affinity.auto_reserved_cores(GAINED, **sync)
    assert n == 0 and "below 3.5, without overlapped scheduling" in why
    assert cpu_affinity.auto_reserved_cores(GAINED, **CLEAR)[0] == 1  # the same model with overlap


@pytest.mark.parametrize("cores", [(0, 1), (0, 1, 2, 3)])
def test_auto_overlap_on_a_cpu_only_where_the_host_has_a_core_or_the_steps_are_short(monkeypatch, cores):
    """async_scheduling=None: on 2 cores without a reserve, 0.7 MFLOP a token per core (m128) ran
    faster overlapped, 2.85 (m192) level to slower, and larger models slower; a reserved core, an
    accelerator or several hosts keep it on."""
    monkeypatch.setattr(cpu_affinity, "available_cores", lambda: cores)
    m128, m192 = _llama(128, 256, 4, 2, 2, 300), _llama(192, 512, 6, 3, 3, 1024)
    clear = {"cpu": True, "reserved": 0, "multi_host": False}
    assert cpu_affinity.auto_async_scheduling(TINY, **clear)[0]
    assert cpu_affinity.auto_async_scheduling(m128, **clear)[0]
    for model in (GAINED, LOST, DEMO):
        on, why = cpu_affinity.auto_async_scheduling(model, **clear)
        assert not on and "no core is reserved for the host" in why and f"(of {len(cores)})" in why
    # twice the cores: m192's step is as short per core as m128's on 2
    assert cpu_affinity.auto_async_scheduling(m192, **clear)[0] is (len(cores) == 4)
    assert cpu_affinity.auto_async_scheduling(DEMO, **{**clear, "reserved": 1}) == (
        True, "the host has 1 core(s) of its own")
    assert cpu_affinity.auto_async_scheduling(DEMO, **{**clear, "cpu": False})[0]
    assert cpu_affinity.auto_async_scheduling(DEMO, **{**clear, "multi_host": True})[0]


def test_auto_keeps_an_earlier_engines_reserve():
    """A later engine of the process keeps the split an earlier one made (the pools were sized for
    it), whatever its own model or jax's state; off the CPU it reserves nothing."""
    for model in (TINY, DEMO):
        n, why = cpu_affinity.auto_reserved_cores(model, **{**CLEAR, "jax_started": True}, reserved=1)
        assert n == 1 and "an earlier engine of this process reserved 1" in why
    assert cpu_affinity.auto_reserved_cores(TINY, **{**CLEAR, "cpu": False}, reserved=1)[0] == 0


def test_reserve_count_in_a_process_where_jax_started(caplog):
    """The library's default (None) is 0; "auto" after jax started (as in this test process) is 0,
    logged with why; a count passes through; resolve() refuses an undecided "auto"."""
    import jax
    import numpy as np

    from jaxsched.engine.core import reserve_count

    jax.devices()
    assert reserve_count(EngineArgs(), TINY, None) == 0
    assert reserve_count(EngineArgs(cpu_reserved_cores=1), TINY, None) == 1
    with caplog.at_level(logging.INFO, logger="jaxsched.engine.core"):
        assert reserve_count(EngineArgs(cpu_reserved_cores="auto"), TINY, None) == 0
        # given its devices (a data-parallel replica's group, as a list or a numpy array of them)
        for given in (jax.devices()[:1], np.array(jax.devices()[:1])):
            assert reserve_count(EngineArgs(cpu_reserved_cores="auto"), TINY, given) == 0
    why = ("jax started before the engine" if jax.default_backend() == "cpu"
           else "does not run on the host's cores")
    assert f"cpu_reserved_cores=auto: 0 ({why}" in caplog.text
    with pytest.raises(ValueError, match="is counted before jax starts"):
        reserved_cores("auto", "cpu")


def test_the_commands_default_to_auto_and_take_a_count_or_auto():
    """`jaxsched serve` / generate / run-batch / bench own their process: no flag means "auto";
    the flag takes a count or "auto", and anything else gets EngineArgs' message."""
    import argparse

    from jaxsched.engine_flags import add_engine_flags, engine_args_from

    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert "default: auto" in next(a.help for a in p._actions if a.dest == "cpu_reserved_cores")
    assert engine_args_from(p.parse_args([])).cpu_reserved_cores == "auto"
    assert engine_args_from(p.parse_args(["--cpu-reserved-cores", "0"])).cpu_reserved_cores == 0
    assert engine_args_from(p.parse_args(["--cpu-reserved-cores", "2"])).cpu_reserved_cores == 2
    assert engine_args_from(p.parse_args(["--cpu-reserved-cores", "auto"])).cpu_reserved_cores == "auto"
    with pytest.raises(ValueError, match="whole number >= 0 or 'auto', got 'two'"):
        engine_args_from(p.parse_args(["--cpu-reserved-cores", "two"]))


def test_only_on_the_cpu_platform():
    with pytest.raises(ValueError, match="CPU platform only"):
        reserved_cores(1, "gpu")
    assert reserved_cores(0, "gpu") == 0


def test_check_counts_this_process_cores():
    n = len(available_cores())
    with pytest.raises(ValueError, match=f"reserve at most {n - 1}"):
        check(n)
    check(n - 1)  # leaves one: allowed


def test_the_numba_limit_sets_the_calling_thread_count():
    """apply_limit(), as every kernel handler calls it, sets numba's count for regions launched
    from the calling thread, read through the C symbol at run time."""
    import numba
    from numba import njit

    from pallas_kernels import numba_threads

    pool = numba.config.NUMBA_NUM_THREADS
    if pool < 2:
        pytest.skip("numba's pool has one thread here: no limit below it to see")

    @njit
    def probe():
        numba_threads.apply_limit()
        return numba.get_num_threads()

    before = numba.get_num_threads()
    try:
        numba_threads.set_limit(0)
        assert probe() == before  # no limit: the thread's count is left alone
        numba_threads.set_limit(1)
        assert probe() == 1
        numba_threads.set_limit(0)  # lifted: the handlers set the pool's size back
        assert probe() == pool and numba_threads.limit() == 0
        numba_threads.set_limit(1)
        numba_threads.set_limit(pool + 5)  # clamped to the pool
        assert numba_threads.limit() == pool and probe() == pool
        with pytest.raises(ValueError, match="0 \\(none\\) or positive"):
            numba_threads.set_limit(-1)
    finally:
        numba_threads.set_limit(0)
        numba.set_num_threads(before)
