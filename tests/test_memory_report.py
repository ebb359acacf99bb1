"""The start-up memory report (jaxsched/runner/memory_report.py): its figures are the engine's own
arrays, the front end and /metrics have them, and a start that cannot fit says what to change."""

from __future__ import annotations

import jax
import pytest

from jaxsched import LLM
from jaxsched.runner.model_runner import largest_temporary_bytes


def test_each_figure_is_the_arrays_it_names(llama_dir, caplog):
    caplog.set_level("INFO", logger="jaxsched.engine.core")
    llm = LLM(llama_dir, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, block_size=16,
              swap_space=0.001, preemption_mode="swap")
    eng = llm.llm_engine
    report, core = eng.memory_report(), eng.core
    r = core.runner
    assert report.weights == sum(x.nbytes for x in jax.tree.leaves(r._state_leaves)) > 0
    assert report.kv_pool == sum(x.nbytes for x in r.kv) == eng.kv_bytes_per_device()
    assert report.swap == sum(x.nbytes for x in r.host_kv) > 0
    assert report.workspace == largest_temporary_bytes(r.step_programs()) > 0
    assert report.kv_blocks == core.config.cache.num_usable_blocks
    assert report.kv_tokens == report.kv_blocks * 16
    # the compiled programs: on a CPU, the host memory the warm-up's compilations kept (measured)
    assert report.programs == core._warm_up_kept > 0
    assert report.left == report.budget - report.weights - report.kv_pool - report.workspace - report.programs
    assert 0 < report.left < report.budget
    assert any(m.startswith("memory on one device: weights") for m in caplog.messages)
    from serving.metrics import EngineMetrics

    m = EngineMetrics()
    m.describe_memory(report)
    for kind, value in report.bytes_by_kind().items():
        assert m.registry.get_sample_value("jaxsched:memory_bytes", {"kind": kind}) == value, kind


def test_a_pool_that_cannot_fit_says_what_to_change(llama_dir, monkeypatch):
    from jaxsched.engine import core

    monkeypatch.setattr(core, "device_memory", lambda *a, **k: (2**16, 2**16))  # a 64 KiB device
    with pytest.raises(ValueError, match=r"no memory left for the KV pool.*weights.*activations.*max_num_seqs.*"
                                         r"quantization='int8'.*kv_cache_dtype='fp8'"):
        LLM(llama_dir, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, block_size=16)
