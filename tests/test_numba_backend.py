"""The "numba" attention backend inside the engine: chosen by "auto" on a CPU, same greedy tokens as
the "xla" backend, and a clear way out where numba cannot run."""

from __future__ import annotations

import logging
import re
import sys

import pytest

from jaxsched import LLM, SamplingParams

ENGINE = {"max_model_len": 96, "max_num_seqs": 4, "max_num_batched_tokens": 32, "block_size": 8}
PROMPTS = [[5, 17, 33, 2, 9, 41, 8, 100, 7, 3, 11, 12, 13], [40, 41], [7] * 45, [99]]


def _greedy(llm):
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def test_auto_picks_numba_on_cpu_and_matches_xla(llama_dir):
    """Chunked prefill (a 45-token prompt through 32-token steps) and decode rows of different
    lengths side by side: the numba kernel's tokens and logprobs equal the XLA path's."""
    auto = LLM(llama_dir, **ENGINE)
    assert auto.llm_engine.config.attention_backend == "numba"
    got, got_lp = _greedy(auto)
    del auto
    want, want_lp = _greedy(LLM(llama_dir, attention_backend="xla", **ENGINE))
    assert all(len(t) == 14 for t in got)
    assert got == want
    for a, b in zip(got_lp, want_lp):
        for step_a, step_b in zip(a, b):
            for tok in step_a:
                assert step_a[tok].logprob == pytest.approx(step_b[tok].logprob, abs=1e-4)


def test_without_numba_auto_falls_back_and_explicit_numba_says_why(llama_dir, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "numba", None)  # what `import numba` sees where it is not installed
    with caplog.at_level(logging.WARNING, logger="jaxsched.engine.core"):
        llm = LLM(llama_dir, **ENGINE)
    assert llm.llm_engine.config.attention_backend == "xla"
    assert "using 'xla' because numba is not importable" in caplog.text
    del llm
    with pytest.raises(ValueError, match="attention_backend='numba' cannot run here: numba is not importable.*"
                                         "use attention_backend='xla'"):
        LLM(llama_dir, attention_backend="numba", **ENGINE)


def test_importing_the_kernels_compiles_no_attention_handler():
    """numba_matmul.py imports numba_kernels; the attention handlers are compiled (cold, tens of
    seconds each) only when an engine asks for its pool storage's, once per process."""
    from numba.core.ccallback import CFunc

    from pallas_kernels import numba_kernels

    assert [name for name, v in vars(numba_kernels).items() if isinstance(v, CFunc)] == []
    f32 = numba_kernels.handler("f32")
    assert isinstance(f32, CFunc) and f32.address and numba_kernels.handler("f32") is f32


def test_compile_cpu_kernels_readies_every_handler_for_later_processes():
    """`python -m pallas_kernels.compile_cpu_kernels` (what `make test` runs before pytest, in two
    processes) compiles or loads every numba FFI handler, so that a later process loads each from
    numba's disk cache: a second process finds all of them there, none compiled again (nor lost by
    the two processes writing the cache at once)."""
    import subprocess

    def run() -> str:
        res = subprocess.run([sys.executable, "-m", "pallas_kernels.compile_cpu_kernels"], check=False,
                             capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        return res.stderr

    run()
    line = next(x for x in run().splitlines() if x.startswith("numba kernels ready"))
    seconds = dict(re.findall(r"(\w[\w ]*?) ([0-9.]+) s", line.split("(", 1)[1]))
    assert set(seconds) == {"matmul", "matmul int8", "matmul int8 grouped", "attention float32 pool",
                            "attention bfloat16 pool", "attention fp8 pool", "rope and KV write"}, line
    # loaded, not compiled: a compile of the attention handlers takes tens of seconds
    assert all(float(v) < 10 for v in seconds.values()), line
