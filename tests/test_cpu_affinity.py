"""cpu_reserved_cores: the host's Python threads on their own core(s), the model's threads on the
rest, numba's regions limited to those (jaxsched/cpu_affinity.py, pallas_kernels/numba_threads.py).

Placing threads is process-wide, so the engines run in a subprocess; it prints one JSON line.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from jaxsched.config import EngineArgs, reserved_cores
from jaxsched.cpu_affinity import available_cores, check

ROOT = pathlib.Path(__file__).parents[1]

SCRIPT = textwrap.dedent('''
    import json, logging, os, sys, threading
    from jaxsched import LLM, SamplingParams
    from jaxsched.cpu_affinity import available_cores, pool_threads
    from pallas_kernels import numba_threads

    model = sys.argv[1]
    first = sys.argv[2] == "reserved-first"  # the reserving engine starts jax (else one without does)
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("jaxsched.cpu_affinity").addHandler(handler)
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
    if first:
        b = LLM(model, cpu_reserved_cores=1, **kw)
        res.update(pool=pool_threads(), reserved=run(b), warnings=warnings)
        print("RESULT " + json.dumps(res))
        sys.exit(0)
    a = LLM(model, cpu_reserved_cores=0, **kw)
    res["limit_before"] = numba_threads.limit()
    res["base"] = run(a)
    res["preemptions_base"] = a.llm_engine.stats().num_preemptions
    del a
    b = LLM(model, cpu_reserved_cores=1, **kw)
    res["reserved"] = run(b)
    res["pool"] = pool_threads()
    res["warnings"] = list(warnings)
    res["limit"] = numba_threads.limit()
    python = {t.native_id for t in threading.enumerate()}
    placed = {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
    res["python"] = sorted({tuple(c) for t, c in placed.items() if t in python})
    res["others"] = sorted({tuple(c) for t, c in placed.items() if t not in python})
    late = []
    t = threading.Thread(target=lambda: late.append(sorted(os.sched_getaffinity(0))))
    t.start(); t.join()
    res["late_python_thread"] = late[0]
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


def test_xla_pools_sized_to_the_device_cores_when_the_engine_starts_jax(llama_dir, result):
    """A reserving engine built before anything starts jax sizes XLA's CPU pools to the cores left
    for the device (two pool threads on one core take turns at every loop); built after, it leaves
    them and warns, saying what to do."""
    first = _run(llama_dir, "reserved-first")
    device = len(first["cores"]) - 1
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
    host, device = cores[-1:], cores[:-1]
    assert result["python"] == [host]  # the main thread and any other Python thread
    assert result["late_python_thread"] == host  # a thread started later inherits its creator's core
    assert result["others"] == [device]  # XLA's and numba's threads: on the model's cores only
    assert result["limit_before"] == 0  # an engine without reserved cores leaves numba alone
    assert result["limit"] == min(len(device), os.cpu_count() or 1)


def test_zero_after_a_reserve_puts_every_thread_back(result):
    assert result["after_zero"] == [result["cores"]]
    assert result["limit_after_zero"] == 0
    assert result["after_zero_tokens"] == result["base"]


def test_reserving_every_core_is_refused(result):
    msg = result["too_many"]
    assert msg is not None and "leaves no core for the model" in msg and f"at most {len(result['cores']) - 1}" in msg


@pytest.mark.parametrize("bad", [-1, True, 1.5, "1"])
def test_bad_values_are_refused(bad):
    with pytest.raises(ValueError, match="cpu_reserved_cores must be a whole number >= 0"):
        EngineArgs(cpu_reserved_cores=bad)


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
