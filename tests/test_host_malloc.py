"""jaxsched/platforms/host_malloc.py: on a CPU backend, freed host memory stays in the process, so a program
with a large temporary buffer does not fault its pages in again at every run."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from jaxsched.platforms import host_malloc

_PROBE = """
import resource, statistics
from jaxsched.platforms import host_malloc
host_malloc.apply_once()  # as an engine does when it starts, before jax
import jax, jax.numpy as jnp
# intermediates of 48 MiB each, which XLA keeps in the executable's temporary buffer
f = jax.jit(lambda x: jnp.cumsum(x * 2.0, axis=0).sum())
x = jnp.ones((1024, 12288), jnp.float32)
for _ in range(5):
    f(x).block_until_ready()
faults = []
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
# the median run: a kept heap may still grow once or twice (two runs' buffers alive at once)
print(host_malloc.applied(), int(statistics.median(faults)))
"""


def _median_faults_per_run(choice: str) -> tuple[bool, int]:
    env = {**os.environ, host_malloc.ENV: choice, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", _PROBE], check=False, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    applied, faults = out.stdout.split()[-2:]
    return applied == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="mallopt's switches are glibc's")
def test_a_large_temporary_buffer_is_not_faulted_in_at_every_run():
    kept, kept_faults = _median_faults_per_run("auto")
    system, system_faults = _median_faults_per_run("system")
    assert kept and not system
    # 48 MiB is 12288 pages of 4 KiB: glibc's mmap of each run faults every one of them in
    assert system_faults > 5000, system_faults
    assert kept_faults < system_faults / 20, (kept_faults, system_faults)


def test_the_cpu_is_told_apart_without_starting_jax():
    from jaxsched import platforms

    assert platforms.expected({"JAX_PLATFORMS": "cpu"}) is platforms.CPU
    assert platforms.expected({"JAX_PLATFORMS": "CPU,cuda"}) is platforms.CPU
    assert platforms.expected({"JAX_PLATFORMS": "cuda,cpu"}) is platforms.GPU
    assert platforms.expected({"JAX_PLATFORM_NAME": "gpu"}) is platforms.GPU


def test_system_leaves_malloc_alone_and_a_bad_choice_says_what_to_write():
    assert host_malloc.keep_freed_memory({host_malloc.ENV: "system", "JAX_PLATFORMS": "cpu"}) is False
    assert host_malloc.keep_freed_memory({host_malloc.ENV: "auto", "JAX_PLATFORMS": "cuda"}) is False
    with pytest.raises(ValueError, match="JAXSCHED_HOST_MALLOC='tcmalloc' is not one of auto, keep, system"):
        host_malloc.keep_freed_memory({host_malloc.ENV: "tcmalloc"})


_ENGINE_PROBE = """
import json, sys
from jaxsched import LLM, SamplingParams
from jaxsched.platforms import host_malloc
from jaxsched.runner.model_runner import largest_temporary_bytes
kw = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
res = {"arenas_before": host_malloc.arena_count()}
bounds, largest = [], []
for backend in ("numba", "xla"):  # XLA's attention keeps its scores in the temporary buffer
    llm = LLM(sys.argv[1], attention_backend=backend, **kw)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=4, temperature=1.0, seed=3),
                       use_tqdm=False)
    bounds.append(llm.llm_engine.core.temporary_bound)
    largest.append(largest_temporary_bytes(llm.llm_engine.core.runner.step_programs()))
res.update(thread_arenas=host_malloc.state == "threads", arenas=host_malloc.arena_count(), bounds=bounds, largest=largest,
           tokens=list(out[0].outputs[0].token_ids))
print("RESULT " + json.dumps(res))
"""


def _engine_probe(llama_dir: str, choice: str) -> dict:
    env = {**os.environ, host_malloc.ENV: choice, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", _ENGINE_PROBE, llama_dir], check=False, env=env, capture_output=True,
                         text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.slow  # ~49 s: two engines, each in a fresh process
@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="mallopt's switches are glibc's")
def test_an_engine_with_small_programs_gives_threads_their_own_arenas(llama_dir):
    """Built before jax starts, a small model's engine lets jax's threads allocate from arenas of
    their own (the device's and the host's allocations no longer share one lock); `keep` keeps one
    arena; the bound the choice is made from is not below any program's own temporary buffer."""
    auto = _engine_probe(llama_dir, "auto")
    keep = _engine_probe(llama_dir, "keep")
    assert auto["arenas_before"] == 1 and keep["arenas_before"] == 1  # `import jaxsched` set one arena
    assert auto["thread_arenas"] and auto["arenas"] > 1
    assert not keep["thread_arenas"] and keep["arenas"] == 1
    assert all(0 < got <= bound for got, bound in zip(auto["largest"], auto["bounds"], strict=True)), auto
    assert auto["largest"][1] > auto["largest"][0]  # the XLA attention's scores are counted: the check can fail
    assert auto["tokens"] == keep["tokens"]  # same seed, same draws, whichever arenas


def test_a_program_too_large_for_a_thread_heap_keeps_one_arena():
    """The demo model's default run (V = 49152, 128 rows): its sampled sampler's temporary buffer
    does not fit a thread arena's heap, so the one arena stays (the page faults of "Decisions in the code")."""
    from jaxsched.models.model_config import ModelConfig
    from jaxsched.runner.model_runner import temporary_bytes_bound

    demo = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
                       rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=True)
    bound = temporary_bytes_bound(demo, 128, 2048, 1024)
    assert bound > 5 * 128 * 49152 * 4  # at least the five [S, V] float32 arrays the sampled sampler holds
    assert bound > host_malloc.THREAD_HEAP_BYTES // 2


def test_thread_arenas_only_under_auto_with_small_programs_before_jax_starts(monkeypatch):
    """The gate in front of mallopt: the choice must be `auto` and applied, the block small enough,
    and jax not started (its threads would already hold the one arena). Each case returns before
    mallopt, so this process's malloc is left as it is."""
    monkeypatch.setattr(host_malloc, "state", "keep")
    assert host_malloc.allow_thread_arenas(1 << 20) is False  # keep: one arena whatever the engine
    monkeypatch.setattr(host_malloc, "state", "auto")
    assert host_malloc.allow_thread_arenas(host_malloc.THREAD_HEAP_BYTES // 2 + 1) is False  # too large
    import jax

    jax.devices()  # started: the threads have their arena
    assert host_malloc.allow_thread_arenas(1 << 20) is False
    assert host_malloc.state == "auto"  # and nothing moved
    monkeypatch.setattr(host_malloc, "state", "system")
    assert host_malloc.allow_thread_arenas(1 << 20) is False  # nothing was set
