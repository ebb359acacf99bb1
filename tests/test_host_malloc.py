"""jaxsched/host_malloc.py: on a CPU backend, freed host memory stays in the process, so a program
with a large temporary buffer does not fault its pages in again at every run."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from jaxsched import host_malloc

_PROBE = """
import resource, statistics, jaxsched, jax, jax.numpy as jnp
from jaxsched import host_malloc
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
print(host_malloc.applied, int(statistics.median(faults)))
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
    assert host_malloc.cpu_backend_expected({"JAX_PLATFORMS": "cpu"})
    assert host_malloc.cpu_backend_expected({"JAX_PLATFORMS": "CPU,cuda"})
    assert not host_malloc.cpu_backend_expected({"JAX_PLATFORMS": "cuda,cpu"})
    assert not host_malloc.cpu_backend_expected({"JAX_PLATFORM_NAME": "gpu"})


def test_system_leaves_malloc_alone_and_a_bad_choice_says_what_to_write():
    assert host_malloc.keep_freed_memory({host_malloc.ENV: "system", "JAX_PLATFORMS": "cpu"}) is False
    assert host_malloc.keep_freed_memory({host_malloc.ENV: "auto", "JAX_PLATFORMS": "cuda"}) is False
    with pytest.raises(ValueError, match="JAXSCHED_HOST_MALLOC='tcmalloc' is not one of auto, keep, system"):
        host_malloc.keep_freed_memory({host_malloc.ENV: "tcmalloc"})
