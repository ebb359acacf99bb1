"""LLMEngine / LLM behaviour on a tiny random model: compilation, bad input, stops, logprobs, abort."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from compiles import no_compilation
from test_parity import SENTENCES, hf_greedy, hf_model
from tiny import needs_torch

from jaxsched import LLM, EngineArgs, SamplingParams
from jaxsched.errors import InvalidRequestError, StepFailedError
from pallas_kernels import backends, tuning

ENGINE = {"max_model_len": 96, "max_num_seqs": 8, "max_num_batched_tokens": 32, "block_size": 8}


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, **ENGINE)


def prompts_of(llm, n):
    tok = llm.get_tokenizer()
    return [{"prompt_token_ids": tok.encode(SENTENCES[i % len(SENTENCES)])[: 2 + i % 40]} for i in range(n)]


def test_zero_compilations_after_warm_up(llm):
    eng = llm.llm_engine
    rng = np.random.default_rng(0)
    params = []
    for i in range(60):  # greedy and sampled, logprobs, stops, lengths from 1 to 40 tokens
        params.append(SamplingParams(
            temperature=float(rng.choice([0.0, 0.8])), top_k=int(rng.choice([0, 5])),
            top_p=float(rng.choice([1.0, 0.9])), max_tokens=int(rng.integers(1, 30)),
            logprobs=int(rng.choice([0, 2])) if i % 3 == 0 else None, seed=i if i % 2 else None,
            stop=["the"] if i % 7 == 0 else None, ignore_eos=bool(i % 2)))
    with no_compilation():
        outs = llm.generate(prompts_of(llm, 60), params, use_tqdm=False)
    assert len(outs) == 60 and all(o.finished for o in outs)
    assert eng.core.block_manager.num_free_blocks == eng.core.block_manager.num_usable_blocks


def test_the_sampler_is_one_program_per_seq_bucket_shared_by_every_t(llm):
    """The sampler does not depend on T: it is compiled once per S, apart from the model's (T, S)
    programs, which hold none of it (it was about half of each pair's compile time)."""
    runner = llm.llm_engine.core.runner
    pairs = runner.bucket_pairs()
    seqs = sorted({S for _, S in pairs})
    assert len(pairs) > len(seqs), "the fixture must have several T per S, or this proves nothing"
    assert sorted(runner._samplers) == seqs
    for T, S in pairs:  # the compiled HLO names each op's source file
        assert "sampler.py" not in runner._executables[(T, S)].as_text(), (T, S)
    assert all(len(runner._samplers[S]) == len(runner.sampler_variants) for S in seqs)
    assert all("sampler.py" in p.as_text() for S in seqs for p in runner._samplers[S])


def test_generate_keeps_input_order_and_string_prompts(llm):
    tok = llm.get_tokenizer()
    outs = llm.generate(["hello", "what is a cat ?", "one two"], SamplingParams(temperature=0, max_tokens=3),
                        use_tqdm=False)
    assert [o.prompt for o in outs] == ["hello", "what is a cat ?", "one two"]
    assert [o.prompt_token_ids for o in outs] == [tok.encode(p) for p in ("hello", "what is a cat ?", "one two")]
    for o in outs:
        c = o.outputs[0]
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("make,match", [
    (lambda llm: llm.generate([""], use_tqdm=False), "prompt is empty"),
    (lambda llm: llm.generate([{"prompt_token_ids": []}], use_tqdm=False), "prompt_token_ids is empty"),
    (lambda llm: llm.generate([{"prompt_token_ids": [1] * 96}], use_tqdm=False), "max_model_len is 96"),
    (lambda llm: llm.generate([{"prompt_token_ids": [10**6]}], use_tqdm=False), r"integers in \[0, \d+\)"),
    (lambda llm: SamplingParams(max_tokens=0), r"max_tokens must be an integer in \[1, 2147483647\]"),
    (lambda llm: SamplingParams(max_tokens=2**31), r"max_tokens must be an integer in \[1, 2147483647\]"),
    (lambda llm: SamplingParams(temperature=-0.1), r"temperature must be a finite number in \[0, inf\)"),
    (lambda llm: SamplingParams(temperature=float("inf")), r"temperature must be a finite number"),
    (lambda llm: SamplingParams(temperature=float("nan")), r"temperature must be a finite number"),
    (lambda llm: SamplingParams(top_p=0.0), r"top_p must be a finite number in \(0, 1\]"),
    (lambda llm: SamplingParams(top_p=1.5), r"top_p must be a finite number in \(0, 1\]"),
    (lambda llm: SamplingParams(min_p=2.0), r"min_p must be a finite number in \[0, 1\]"),
    (lambda llm: SamplingParams(n=10**9), r"n must be an integer in \[1, 128\]"),
    (lambda llm: SamplingParams(seed=2**64), r"seed must be an integer in \[-9223372036854775808, 18446744073709551615\]"),
    (lambda llm: SamplingParams(stop_token_ids=[2**40]), r"stop_token_ids must be an integer in \[0, 2147483647\]"),
    (lambda llm: SamplingParams(stop=["x"] * 65), "at most 64"),
    (lambda llm: llm.generate(["hi"], SamplingParams(stop_token_ids=[10**6]), use_tqdm=False),
     r"stop_token_ids must be token ids in \[0, \d+\)"),
    (lambda llm: llm.generate(["hi"], priority=[2**63], use_tqdm=False), "priority must be a 64-bit integer"),
    (lambda llm: llm.generate(["a", "b"], [SamplingParams()] * 3, use_tqdm=False), "one per prompt"),
    (lambda llm: llm.chat([], use_tqdm=False), "messages is empty"),
    (lambda llm: llm.generate(["hi"], SamplingParams(logprobs=50), use_tqdm=False), "max_logprobs"),
])
def test_bad_input_is_refused_without_disturbing_work_in_flight(llm, make, match):
    eng = llm.llm_engine
    tok = llm.get_tokenizer()
    p = tok.encode("the capital of france is")
    eng.add_request("inflight", {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    eng.step()
    with pytest.raises(ValueError, match=match):
        make(llm)
    done = []
    while eng.has_unfinished_requests():
        done += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in done] == ["inflight"]
    alone = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                         use_tqdm=False)
    assert done[0].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_engine_argument_errors(llama_dir, tmp_path):
    with pytest.raises(TypeError, match="'max_num_seq' \\(did you mean 'max_num_seqs'\\?\\)"):
        LLM(llama_dir, max_num_seq=4)
    with pytest.raises(ValueError, match="block_size must be a positive multiple of 8"):
        LLM(llama_dir, block_size=12)
    with pytest.raises(ValueError, match="max_model_len \\(100000\\) is larger"):
        LLM(llama_dir, max_model_len=100000)
    bad = tmp_path / "bad"
    shutil.copytree(llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unknown architecture.*supported architectures: LlamaForCausalLM"):
        LLM(str(bad))
    with pytest.raises(ValueError, match="missing': no such file or folder; pass a Hugging Face model folder, a .gguf"):
        LLM(str(tmp_path / "missing"))
    assert EngineArgs().max_num_seqs == 128


@needs_torch
def test_block_size_defaults_per_attention_backend(llama_dir):
    """block_size=None (the default) picks 128 for the XLA path, 16 for the Pallas kernel."""
    assert EngineArgs().block_size is None
    assert backends.get("xla").default_block_size == 128 and backends.get("pallas").default_block_size == 16
    llm = LLM(llama_dir, max_model_len=160, max_num_seqs=4, max_num_batched_tokens=32, attention_backend="xla")
    cc = llm.llm_engine.cache_config
    assert cc.block_size == 128
    k_pool, v_pool = llm.llm_engine.core.runner.kv
    assert v_pool.shape[3] == 128 and k_pool.shape[4] == 128  # P; the xla backend's K pages are [H, P]
    ids = [int(x) for x in np.random.default_rng(3).integers(3, 200, 126)]  # crosses a page boundary
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf_model(llama_dir), ids, 6)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    p = prompts_of(llm, 1)[0]
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate(prompts_of(llm, 6)[1:] + [p],
                         [SamplingParams(temperature=0.9, max_tokens=20)] * 5 + [sp], use_tqdm=False)
    assert crowd[-1].outputs[0].token_ids == alone
    other = llm.generate([p], SamplingParams(temperature=1.0, seed=4321, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert other != alone


def test_stop_strings_and_stop_tokens(llm):
    p = prompts_of(llm, 3)[2]
    free = llm.generate([p], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    text, ids = free.outputs[0].text, free.outputs[0].token_ids
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    kept = llm.generate([p], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop],
                                            include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]
    by_id = llm.generate([p], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                             stop_token_ids=[ids[3]]), use_tqdm=False)[0].outputs[0]
    assert by_id.token_ids == ids[: ids.index(ids[3]) + 1] and by_id.stop_reason == ids[3]


@needs_torch
def test_logprobs_match_transformers(llm, llama_dir):
    import torch

    p = prompts_of(llm, 5)[4]["prompt_token_ids"]
    o = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=4, logprobs=3,
                                                               ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(o.logprobs) == 4
    ref = hf_model(llama_dir)
    with torch.no_grad():
        lp = torch.log_softmax(ref(torch.tensor([p + o.token_ids])).logits[0], -1).numpy()
    total = 0.0
    for j, (tid, entry) in enumerate(zip(o.token_ids, o.logprobs)):
        want = lp[len(p) - 1 + j]
        assert entry[tid].rank == 1
        assert abs(entry[tid].logprob - want[tid]) < 1e-4
        top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:3]
        assert [t for t, _ in top] == list(np.argsort(-want)[:3])
        total += entry[tid].logprob
    assert abs(o.cumulative_logprob - total) < 1e-4


def test_abort_frees_blocks_and_spares_others(llm):
    eng = llm.llm_engine
    ps = prompts_of(llm, 3)
    for i, p in enumerate(ps):
        eng.add_request(f"a{i}", p, SamplingParams(temperature=0, max_tokens=15, ignore_eos=True))
    eng.step()
    eng.step()
    eng.abort_request("a1")
    finished = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o
    assert sorted(finished) == ["a0", "a2"]
    assert all(len(o.outputs[0].token_ids) == 15 for o in finished.values())
    assert eng.core.block_manager.num_free_blocks == eng.core.block_manager.num_usable_blocks


def test_a_failed_device_step_ends_its_requests_and_the_engine_goes_on(llm, monkeypatch):
    """StepFailedError carries the final outputs of the requests the step held (error set); the
    scheduler is consistent afterwards and the next requests generate as before."""
    eng = llm.llm_engine
    ps = prompts_of(llm, 3)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(ps, greedy, use_tqdm=False)]
    for i, p in enumerate(ps):
        eng.add_request(f"f{i}", p, greedy if i else SamplingParams(n=2, temperature=0, max_tokens=6))

    def on_fire(batch):
        raise RuntimeError("device on fire")

    monkeypatch.setattr(eng.core.runner, "run", on_fire)
    with pytest.raises(StepFailedError, match="device on fire") as failed:
        eng.step()
    outs = failed.value.outputs
    assert sorted(o.request_id for o in outs) == ["f0", "f1", "f2"]  # the n = 2 request under its own id
    assert all(o.finished and "device on fire" in o.error for o in outs)
    assert all(c.finish_reason == "error" for o in outs for c in o.outputs) and len(outs[0].outputs) == 2
    assert not eng.has_unfinished_requests()
    monkeypatch.undo()
    assert eng.step() == []  # a step with no rows runs through the same path
    eng.core.scheduler.check_invariants()
    assert eng.core.block_manager.num_free_blocks == eng.core.block_manager.num_usable_blocks
    assert [o.outputs[0].token_ids for o in llm.generate(ps, greedy, use_tqdm=False)] == expected


def test_stats_time_the_host_phases_and_count_kv_waste(llm):
    """EngineStats splits the host's step work by phase (each phase moves, and together they stay
    within the steps' wall time less the device wait), and counts the unfilled tails of the
    requests' last blocks while they run (none once they are done)."""
    eng = llm.llm_engine
    before = eng.stats()
    B = eng.cache_config.block_size
    ps = prompts_of(llm, 4)
    for i, p in enumerate(ps):
        eng.add_request(f"w{i}", p, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    eng.step()
    eng.step()
    mid = eng.stats()
    req = eng.core.scheduler.requests
    held = {rid: len(eng.core.block_manager.req_blocks[rid]) for rid in req if rid in eng.core.block_manager.req_blocks}
    assert held and mid.kv_allocated_slots == (eng.core.block_manager.num_usable_blocks
                                               - eng.core.block_manager.num_free_blocks) * B
    assert 0 < mid.kv_internal_waste_slots < len(held) * B  # at most a tail per request, never a whole block
    assert 0 < mid.kv_internal_waste_perc < 1 and mid.kv_external_fragmentation_perc == 0.0
    while eng.has_unfinished_requests():
        eng.step()
    after = eng.stats()
    phases = ("schedule", "pack", "launch", "update", "output")
    moved = {k: getattr(after, f"{k}_seconds") - getattr(before, f"{k}_seconds") for k in phases}
    assert all(v > 0 for v in moved.values()), moved
    host = (after.step_seconds - before.step_seconds) - (after.device_seconds - before.device_seconds)
    assert sum(moved.values()) <= host + 1e-3
    assert 0 < after.scheduling_share < 1
    assert after.kv_internal_waste_slots == 0 and after.kv_internal_waste_perc == 0.0


def test_exit_waits_for_the_step_in_flight(llm):
    """The exit hook waits for a step still running (jax's CPU client torn down under a running
    computation deadlocked the process), and the engine is registered with it."""
    from jaxsched.engine import core as engine_mod

    eng = llm.llm_engine
    assert eng.core in engine_mod._CORES and engine_mod._at_exit_registered
    eng.add_request("x", prompts_of(llm, 1)[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    eng.step()
    step = eng.core._in_flight
    assert step is not None and step.ints is not None
    engine_mod._wait_for_steps_in_flight()
    assert step.ints.is_ready() and step.floats.is_ready()
    while eng.has_unfinished_requests():
        eng.step()


def test_a_failed_dispatch_keeps_the_tokens_of_the_step_in_flight(llm, monkeypatch):
    """Overlapped scheduling: when step N+1 fails to start, step N (already on the device) is read
    and applied first. A request it ends gets its normal final output inside the StepFailedError,
    and only the requests of the failed step are ended with an error."""
    eng = llm.llm_engine
    assert eng.core.async_scheduling
    ps = prompts_of(llm, 2)
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = llm.generate(ps[:1], short, use_tqdm=False)[0].outputs[0].token_ids
    eng.add_request("short", ps[0], short)
    eng.add_request("long", ps[1], long)
    got: list[int] = []
    while len(got) < 2:  # until the step in flight carries the short request's last token
        for o in eng.step():
            if o.request_id == "short":
                got = list(o.outputs[0].token_ids)
    assert eng.core._in_flight is not None and not got[2:]

    def on_fire(batch):
        raise RuntimeError("device on fire")

    monkeypatch.setattr(eng.core.runner, "run", on_fire)
    with pytest.raises(StepFailedError, match="device on fire") as failed:
        eng.step()
    outs = {o.request_id: o for o in failed.value.outputs}
    assert outs["short"].error is None and outs["short"].finished
    assert outs["short"].outputs[0].token_ids == expected and outs["short"].outputs[0].finish_reason == "length"
    assert outs["long"].error is not None and "device on fire" in outs["long"].error
    assert failed.value.request_ids == ["long"]
    monkeypatch.undo()
    assert not eng.has_unfinished_requests()
    eng.core.scheduler.check_invariants()
    assert eng.core.block_manager.num_free_blocks == eng.core.block_manager.num_usable_blocks


def test_a_pool_lost_with_a_failed_step_is_replaced(llm, monkeypatch):
    """The KV pool is donated to the step: when the call fails after taking it, the runner
    allocates a fresh pool, so the next steps run (the requests that had KV in it were ended)."""
    eng = llm.llm_engine
    ps = prompts_of(llm, 2)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(ps, greedy, use_tqdm=False)]
    eng.add_request("lost", ps[0], greedy)

    def lose_the_pool(state, kv, *args):
        for x in kv:
            x.delete()
        raise RuntimeError("device lost")

    monkeypatch.setattr(eng.core.runner, "_executables", dict.fromkeys(eng.core.runner._executables, lose_the_pool))
    with pytest.raises(StepFailedError, match="device lost"):
        eng.step()
    monkeypatch.undo()
    assert not any(x.is_deleted() for x in eng.core.runner.kv)
    assert [o.outputs[0].token_ids for o in llm.generate(ps, greedy, use_tqdm=False)] == expected


def test_one_requests_output_failure_fails_it_alone(llm, monkeypatch):
    """A request whose output cannot be processed (here its detokenizer raises) ends with an error;
    the others in its step finish as if it had not been there."""
    eng = llm.llm_engine
    ps = prompts_of(llm, 3)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(ps, greedy, use_tqdm=False)]
    for i, p in enumerate(ps):
        eng.add_request(f"o{i}", p, greedy)

    def undecodable(*args, **kwargs):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    monkeypatch.setattr(eng.outputs._requests["o1"].samples[0].detok, "add_token", undecodable)
    finished = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o
    assert "invalid start byte" in finished["o1"].error and finished["o1"].outputs[0].finish_reason == "error"
    assert [finished[f"o{i}"].outputs[0].token_ids for i in (0, 2)] == [expected[0], expected[2]]
    assert eng.core.block_manager.num_free_blocks == eng.core.block_manager.num_usable_blocks


def test_a_sample_id_in_flight_refuses_the_whole_request(llm):
    """With n = 2, request "y" runs as samples "0_y" and "1_y": if "0_y" is in flight already, "y"
    is refused and "0_y" carries on untouched."""
    eng = llm.llm_engine
    p = prompts_of(llm, 1)[0]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    eng.add_request("0_y", p, greedy)
    with pytest.raises(InvalidRequestError, match="'0_y' is already in flight") as refused:
        eng.add_request("y", p, SamplingParams(n=2, temperature=0, max_tokens=5))
    assert refused.value.param == "request_id"
    with pytest.raises(InvalidRequestError, match="'0_y' is already in flight"):
        eng.add_request("0_y", p, greedy)
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert [(o.request_id, len(o.outputs[0].token_ids), o.error) for o in outs] == [("0_y", 5, None)]


def test_chat_uses_the_template(llm):
    tok = llm.get_tokenizer()
    msgs = [{"role": "user", "content": "what is a cat ?"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert out.prompt_token_ids == list(ids)
    assert tok.decode(out.prompt_token_ids) == (
        "<|im_start|>user\nwhat is a cat ?<|im_end|>\n<|im_start|>assistant\n")
    assert len(out.outputs[0].token_ids) >= 1


HOST_ONLY = ["jaxsched/core/scheduler.py", "jaxsched/core/block_manager.py", "jaxsched/core/request.py", "jaxsched/core/buckets.py",
             "jaxsched/core/policy.py", "jaxsched/runner/penalties.py", "jaxsched/runner/batch.py", "jaxsched/engine/detokenizer.py",
             "jaxsched/engine/output_processor.py", "jaxsched/config.py", "jaxsched/sizing.py", "jaxsched/core/stats.py",
             "jaxsched/errors.py", "jaxsched/envs.py"]


def test_host_modules_do_not_import_jax():
    root = os.path.dirname(os.path.dirname(__file__))
    for rel in HOST_ONLY:
        with open(os.path.join(root, rel)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "jax" or n.startswith(("jax.", "flax")) for n in names), f"{rel} imports {names}"
    code = ("import sys, jaxsched.core.scheduler, jaxsched.runner.batch, jaxsched.engine.output_processor, jaxsched.sizing; "
            "print('jax' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True)
    assert res.stdout.strip() == "False", "importing the scheduler must not load jax"


def test_compile_falls_back_when_jaxlib_rejects_the_xla_options(llm, monkeypatch, caplog):
    """The step's XLA options are experimental flags; a jaxlib that lacks one must still compile."""
    import dataclasses

    runner = llm.llm_engine.core.runner
    monkeypatch.setattr(runner, "platform", dataclasses.replace(
        runner.platform, compiler_options={runner.config.attention_backend: {"xla_cpu_no_such_option_here": "1"}}))
    monkeypatch.setattr(runner, "_use_compiler_options", True)
    T, S = runner.bucket_pairs()[0]
    with caplog.at_level("WARNING", logger="jaxsched.runner.model_runner"):
        exe = runner.compile(T, S)
    assert exe is not None and runner._use_compiler_options is False
    assert any("rejects the XLA options" in r.message for r in caplog.records)


def test_stats_split_each_step_into_host_and_device_time(llm):
    eng = llm.llm_engine
    before = eng.stats()
    llm.generate(["one two three", "hello world"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                 use_tqdm=False)
    after = eng.stats()
    steps = after.num_steps - before.num_steps
    wall = after.step_seconds - before.step_seconds
    device = after.device_seconds - before.device_seconds
    assert steps >= 6 and 0 < device < wall  # every step waited on its jitted call, and did host work besides
    assert 0 < after.host_share < 1


@pytest.mark.parametrize("branches", ["device", "host", "mixed"])
def test_warm_up_runs_run_every_program_once_and_change_no_output(llm, llama_dir, branches):
    """warm_up_runs: each compiled program runs once on padding at warm-up (its one-time costs paid
    there, not by the first requests), which leaves no trace in the pool: the same greedy tokens;
    with every sampler variant (sampler_branches="host") as with one."""
    warm = LLM(llama_dir, **ENGINE, warm_up_runs=True, sampler_branches=branches)
    runner = warm.llm_engine.core.runner
    assert runner.ran == set(runner.bucket_pairs())
    assert runner.sampler_ran == {(S, k) for S, programs in runner._samplers.items() for k in range(len(programs))}
    assert len(runner._samplers[runner.bucket_pairs()[0][1]]) == len(tuning.SAMPLER_PROGRAMS[branches])
    assert llm.llm_engine.config.warm_up_runs is False  # off by default in the library
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = prompts_of(llm, 10)
    with no_compilation():
        got = warm.generate(prompts, params, use_tqdm=False)
    want = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    eng = warm.llm_engine
    assert eng.core.block_manager.num_free_blocks == eng.core.block_manager.num_usable_blocks


@pytest.mark.parametrize("flags,expected", [((), True), (("--no-warm-up-runs",), False)])
def test_serve_runs_every_program_at_warm_up_unless_told_not_to(monkeypatch, flags, expected):
    import jaxsched.engine.llm_engine
    from serving import cli

    class Built(Exception):
        pass

    def create_engine(args):
        raise Built(args)

    monkeypatch.setattr(jaxsched.engine.llm_engine, "create_engine", create_engine)
    with pytest.raises(Built) as e:
        cli.main(["serve", "some-model", *flags])
    assert e.value.args[0].warm_up_runs is expected


def test_unrolled_layers_give_the_default_layouts_tokens(llm, llama_dir):
    """layer_weights="unrolled" (every layer its own code in the program, no loop: the layout meant
    for GPUs) gives the platform default's greedy tokens, and a wrong name says what to pass."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = prompts_of(llm, 6)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    unrolled = LLM(llama_dir, layer_weights="unrolled", **ENGINE)
    assert unrolled.llm_engine.config.layer_weights == "unrolled"

    def loops(engine):  # while loops in a step's compiled program: the layer scan is one
        exe = next(iter(engine.core.runner._executables.values()))
        return exe.as_text().count(" while(")

    assert loops(unrolled.llm_engine) < loops(llm.llm_engine)
    with no_compilation():  # every program compiled at warm-up, as with the other layouts
        got = [o.outputs[0].token_ids for o in unrolled.generate(prompts, params, use_tqdm=False)]
    assert got == want
    with pytest.raises(ValueError, match="layer_weights must be 'auto' or one of"):
        EngineArgs(layer_weights="scanned")


def test_sampler_branches_is_the_platforms_choice_unless_named():
    """"auto" picks between the argmax alone and one sampler program with lax.conds on a CPU, and
    among cond-free ones elsewhere (the platform record's sampler_branches); a bad name says what the choices are."""
    from jaxsched import platforms

    assert platforms.CPU.sampler_branches == "mixed" and platforms.GPU.sampler_branches == "host"
    with pytest.raises(ValueError, match=r"sampler_branches must be 'auto' or one of \('device', 'host', 'mixed'\)"):
        EngineArgs(sampler_branches="gpu")


def test_checked_token_ids_are_not_walked_again(llm, monkeypatch):
    """The server checks a prompt's ids on a worker thread (serving/convert.py) and hands them over
    as CheckedTokens, which make_request takes without walking them on the caller's event loop; any
    other prompt of ids is checked there, by the same rule."""
    from jaxsched.engine import frontend

    eng = llm.llm_engine
    V = eng.model_config.vocab_size
    assert frontend.first_bad_token_id([1, 2, V - 1], V) == -1
    assert [frontend.first_bad_token_id(ids, V) for ids in ([1, V], [True], [1, 2.0], [-1])] == [1, 0, 1, 0]
    walked = []
    real = frontend.first_bad_token_id
    monkeypatch.setattr(frontend, "first_bad_token_id", lambda ids, v: walked.append(len(ids)) or real(ids, v))
    new = eng.make_request("a", frontend.CheckedTokens([5, 6, 7], "x y z", cache_salt="s"), SamplingParams())
    assert walked == [] and new.core.prompt_token_ids == [5, 6, 7] and new.prompt == "x y z"
    assert new.core.cache_salt != 0  # the salt travels with the checked ids
    eng.make_request("b", {"prompt_token_ids": [5, 6, 7]}, SamplingParams())
    assert walked == [3]
    with pytest.raises(InvalidRequestError, match="prompt_token_ids is empty"):
        eng.make_request("c", frontend.CheckedTokens([]), SamplingParams())
