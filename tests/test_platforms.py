"""The platform records (jaxsched/platforms): what differs on a CPU and a GPU is decided there and
nowhere else, and importing the engine changes nothing in the process."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxsched import platforms
from jaxsched.config import EngineArgs, resolve
from jaxsched.models.model_config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]

# a platform name compared: == "cpu", != 'gpu', "cuda" == x, x in ("gpu", "cpu"), .platform == ...
_CHECK = re.compile(r"""(?:==|!=)\s*["'](?:cpu|gpu|cuda|rocm|tpu)["']|["'](?:cpu|gpu|cuda|rocm|tpu)["']\s*(?:==|!=)"""
                    r"""|\bin\s*[(\[{]\s*["'](?:cpu|gpu|cuda|rocm|tpu)["']""")


def test_platform_checks_live_in_the_platform_records():
    """Every "is this a CPU?" is a read of a record: no other module compares platform names."""
    home = ROOT / "jaxsched" / "platforms"
    found = []
    for pkg in ("jaxsched", "serving", "pallas_kernels", "scripts"):
        for path in (ROOT / pkg).rglob("*.py"):
            if path.is_relative_to(home):
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if _CHECK.search(code):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_check_finds_a_platform_comparison():
    for code in ('if dev.platform == "cpu":', "x = p != 'gpu'", 'if platform not in ("gpu", "cpu"):',
                 '"cuda" == name'):
        assert _CHECK.search(code), code
    assert not _CHECK.search('jax.ffi.register_ffi_target(name, capsule, platform="cpu")')


_IMPORT_PROBE = r"""
import ctypes, json, os, resource
import jax, numba  # noqa: F401 (their own imports set variables of theirs: TF_CPP_MIN_LOG_LEVEL, ...)
before = {"env": dict(os.environ), "cpus": sorted(os.sched_getaffinity(0))}
import jaxsched, jaxsched.engine.llm, jaxsched.engine.core, serving.app  # noqa: F401
from jaxsched import LLM  # noqa: F401 (the lazy names resolve)
from jaxsched.platforms import host_malloc
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
n = 48 << 20
faults = []
for _ in range(4):  # glibc's own malloc maps a 48 MiB block afresh each time: every page faults in
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(n)
    libc.memset(p, 1, n)
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps({"env_same": dict(os.environ) == before["env"], "cpus_same": sorted(os.sched_getaffinity(0)) ==
                  before["cpus"], "decided": host_malloc.state is not None, "faults": faults[1:]}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="mallopt's switches are glibc's")
def test_importing_the_engine_leaves_the_process_as_it_was():
    """Nothing changes process state at import: environment, thread affinity and glibc's malloc
    (a 48 MiB block is still mapped afresh at every malloc, as glibc does unless told otherwise)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("JAXSCHED_HOST_MALLOC", None)
    out = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], check=False, env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["env_same"] and res["cpus_same"] and not res["decided"], res
    assert min(res["faults"]) > 10000, res  # 12288 pages of 4 KiB each time: nothing kept


_ENGINE_PROBE = r"""
import json, resource, ctypes
from jaxsched.platforms import host_malloc
host_malloc.apply_once()  # what an engine core does first
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
n = 48 << 20
faults = []
for _ in range(4):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(n)
    libc.memset(p, 1, n)
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps({"applied": host_malloc.applied(), "faults": faults[1:]}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="mallopt's switches are glibc's")
@pytest.mark.parametrize("choice", ["auto", "system"])
def test_the_engine_applies_the_platforms_malloc_when_it_starts_unless_told_not_to(choice):
    """The probe above can fail: once applied (the engine's start, on a CPU), the same block is kept;
    JAXSCHED_HOST_MALLOC=system is an embedding application's opt-out."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXSCHED_HOST_MALLOC": choice}
    out = subprocess.run([sys.executable, "-c", _ENGINE_PROBE], check=False, env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    if choice == "auto":
        assert res["applied"] and max(res["faults"]) < 1000, res
    else:
        assert not res["applied"] and min(res["faults"]) > 10000, res


TINY = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
                   rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=False, dtype="bfloat16")



@pytest.mark.parametrize("record", [platforms.CPU, platforms.GPU])
def test_resolve_takes_every_auto_from_the_record(record):
    cfg = resolve(EngineArgs(max_num_seqs=8, num_gpu_blocks_override=64, attention_backend="xla"), TINY, "m",
                  record.name, weights_bytes=lambda m, d: 0, memory=lambda: (1 << 30, 1 << 30), reserved=0)
    assert cfg.layer_weights == record.layer_weights
    assert cfg.sampler_branches == record.sampler_branches
    assert cfg.dtype == (record.dtype or "bfloat16")
    assert cfg.async_scheduling  # the tiny model leaves a CPU's cores idle; on a GPU the host works beside it


@pytest.mark.parametrize("checkpoint", ["float32", "float16", "bfloat16"])
def test_a_gpu_runs_any_checkpoint_in_bfloat16_unless_dtype_says_otherwise(checkpoint):
    """As vLLM: a float32 checkpoint is served in 16 bits on a GPU; --dtype float32 keeps it; the CPU
    keeps float32."""
    import dataclasses

    model = dataclasses.replace(TINY, dtype=checkpoint)
    kw = {"max_num_seqs": 8, "num_gpu_blocks_override": 64, "attention_backend": "xla"}
    mem = {"weights_bytes": lambda m, d: 0, "memory": lambda: (1 << 30, 1 << 30), "reserved": 0}
    assert resolve(EngineArgs(**kw), model, "m", "gpu", **mem).dtype == "bfloat16"
    assert resolve(EngineArgs(dtype="float32", **kw), model, "m", "gpu", **mem).dtype == "float32"
    assert resolve(EngineArgs(**kw), model, "m", "cpu", **mem).dtype == "float32"


def test_another_accelerator_gets_the_gpus_choices_under_its_name():
    tpu = platforms.of("tpu")
    assert tpu.name == "tpu" and not tpu.host_runs_model and tpu.layer_weights == platforms.GPU.layer_weights
    assert platforms.of("cpu") is platforms.CPU and platforms.of("gpu") is platforms.GPU


def test_a_counted_reserve_is_dropped_off_the_host_and_several_hosts_recompute():
    kw = {"max_num_seqs": 8, "num_gpu_blocks_override": 64, "attention_backend": "xla"}
    mem = {"weights_bytes": lambda m, d: 0, "memory": lambda: (1 << 30, 1 << 30)}
    gpu = resolve(EngineArgs(cpu_reserved_cores="auto", **kw), TINY, "m", "gpu", reserved=1, **mem)
    assert gpu.cpu_reserved_cores == 0
    with pytest.raises(ValueError, match="cpu_reserved_cores=1 applies to the CPU platform only"):
        resolve(EngineArgs(cpu_reserved_cores=1, **kw), TINY, "m", "gpu", **mem)
    multi = resolve(EngineArgs(distributed_coordinator="auto", swap_space=4, **kw), TINY, "m", "gpu",
                    reserved=0, **mem)
    assert multi.scheduler.preemption_mode == "recompute" and multi.scheduler.num_host_blocks == 0
    with pytest.raises(ValueError, match="preemption_mode='swap' is not available with several hosts"):
        resolve(EngineArgs(distributed_coordinator="auto", preemption_mode="swap", **kw), TINY, "m", "gpu",
                reserved=0, **mem)
