"""Speculative decoding with a draft model (speculative_config method "draft_model"): a smaller
model with the target's tokenizer runs inside every step on the device, into its own KV pool under
the target's block tables, and proposes each verified row's tokens greedily
(model_runner._draft); the step verifies them as it does n-gram proposals. Outputs must be exactly
the engine's without speculation (greedy and seeded, stop strings and ids mid-proposal, n > 1,
preemption by recompute and swap, aborts); the target as its own draft must have every proposal
kept; a draft whose vocabulary or tokenizer differs is refused at start, naming the field; the
memory figures carry the draft's weights and KV."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import tiny
from compiles import no_compilation
from safetensors.numpy import load_file, save_file
from test_async_scheduling import BASE, drive, summary
from test_speculative import _spec_workload

from jaxsched import LLM, SamplingParams
from jaxsched.config import EngineArgs, resolve
from jaxsched.models.loader import load_model_source


def _spec(draft: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def draft_dir(llama_dir, tmp_path_factory) -> str:
    """A draft that agrees with the target often but not always: the target's first layer alone
    (with its embedding, final norm and lm_head)."""
    folder = str(tmp_path_factory.mktemp("draft"))
    for name in os.listdir(llama_dir):
        if name != "model.safetensors":
            shutil.copy(os.path.join(llama_dir, name), folder)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = 1
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    weights = load_file(os.path.join(llama_dir, "model.safetensors"))
    save_file({k: v for k, v in weights.items() if ".layers." not in k or ".layers.0." in k},
              os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("extra", [
    {},
    pytest.param({"num_gpu_blocks_override": 9, "preemption_mode": "recompute"}, marks=pytest.mark.slow),
    pytest.param({"num_gpu_blocks_override": 9, "preemption_mode": "swap"}, marks=pytest.mark.slow),
    pytest.param({"async_scheduling": True}, marks=pytest.mark.slow),
], ids=["ample", "recompute", "swap", "overlap"])
def test_outputs_equal_the_engine_without_speculation(llama_dir, draft_dir, extra):
    """The async-scheduling workload plus a fixed mask and a logit_bias: the same tokens (and
    logprobs) as without speculation, some proposals kept and some refused, fewer steps, no
    compilation after warm-up; the target as its own draft keeps every greedy proposal."""
    runs, stats, greedy = {}, {}, {}
    for name, spec in (("plain", None), ("draft", _spec(draft_dir)), ("self", _spec(llama_dir))):
        llm = LLM(llama_dir, **BASE, **{"async_scheduling": False, **extra}, speculative_config=spec)
        reqs = _spec_workload(llm)
        with no_compilation():
            runs[name] = drive(llm, reqs)
        stats[name] = llm.llm_engine.stats()
        if "num_gpu_blocks_override" in extra:
            assert stats[name].num_preemptions > 0, "the small pool must force preemptions"
        # greedy requests alone: a draft equal to the target proposes the target's own tokens
        greedy[name] = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for _, p, _ in reqs[:6]],
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)]
        after = llm.llm_engine.stats()
        drafted = after.spec_decode_num_draft_tokens - stats[name].spec_decode_num_draft_tokens
        kept = after.spec_decode_num_accepted_tokens - stats[name].spec_decode_num_accepted_tokens
        if name == "self":
            assert drafted > 0 and kept == drafted, "the target as its own draft: greedy acceptance 1.0"
    assert greedy["draft"] == greedy["self"] == greedy["plain"]
    for name in ("draft", "self"):
        for rid in runs["plain"]:
            a, b = runs["plain"][rid].outputs[0].token_ids, runs[name][rid].outputs[0].token_ids
            if rid in ("r8", "r11"):  # aborted once they had 3 tokens: a step may have brought several
                assert len(b) >= len(a) == 3 and b[:3] == a, (name, rid)
                continue
            assert summary(runs[name][rid]) == summary(runs["plain"][rid]), (name, rid)
        st = stats[name]
        assert st.spec_decode_num_drafts > 0 and st.num_steps < stats["plain"].num_steps, name
    st = stats["draft"]
    assert 0 < st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens, "some kept, some refused"


def test_memory_figures_carry_the_draft(llama_dir, draft_dir):
    """The draft's weights and its KV (the target's blocks, its own layers) are in the memory report
    and the pool's size; the pool is sized for both."""
    llm = LLM(llama_dir, **BASE, speculative_config=_spec(draft_dir))
    core = llm.llm_engine.core
    r, report = core.runner, core.memory
    assert len(r.kv) == 4 and r.kv[2].shape[0] == 1 and r.kv[2].shape[1] == r.kv[0].shape[1]  # 1 layer, same blocks
    assert report.draft_weights == sum(x.nbytes for x in r._draft_leaves) > 0
    assert report.draft_kv_pool == r.kv[2].nbytes + r.kv[3].nbytes > 0
    assert report.kv_pool == sum(x.nbytes for x in r.kv) == core.kv_bytes_per_device()
    assert "the draft model's" in report.lines()
    # a prompt logprobs step runs the draft too (its KV follows every computed token): the same figures
    prompt = {"prompt_token_ids": llm.get_tokenizer().encode("the cat sat on the mat and the cat")}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=2)
    figures = []
    for engine in (llm, LLM(llama_dir, **BASE)):
        out = engine.generate([prompt], params, use_tqdm=False)[0]
        figures.append((out.outputs[0].token_ids, [None if d is None else {t: round(lp.logprob, 4) for t, lp in d.items()}
                                                   for d in out.prompt_logprobs]))
    assert figures[0] == figures[1] and figures[0][1][0] is None and len(figures[0][1]) > 5


def test_a_draft_that_differs_from_the_target_is_refused(llama_dir, tmp_path):
    """A draft of another vocabulary size, or with the same size but another tokenizer, is refused
    at start with an error naming speculative_config.model; so is a missing one."""
    other = str(tmp_path / "tok")
    tiny.build_tokenizer(other, added_tokens=("<extra_a>", "<extra_b>"))
    bigger = tiny.build_model(str(tmp_path / "bigger"), "llama", other, seed=3, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"speculative_config.model: the draft's vocabulary has \d+ tokens"):
        LLM(llama_dir, **BASE, speculative_config=_spec(bigger))
    with open(os.path.join(llama_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    same_size = tiny.build_model(str(tmp_path / "same"), "llama", other, seed=3, num_hidden_layers=1,
                                 vocab_size=vocab)
    with pytest.raises(ValueError, match="speculative_config.model .*tokenizer differs from the target's"):
        LLM(llama_dir, **BASE, speculative_config=_spec(same_size))
    with pytest.raises(ValueError, match="speculative_config.model must name the draft model"):
        EngineArgs(speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="speculative_config.model is for method 'draft_model' only"):
        EngineArgs(speculative_config={"method": "ngram", "model": llama_dir})
    with pytest.raises(ValueError, match="speculative_config.model .*no such file"):
        LLM(llama_dir, **BASE, speculative_config=_spec(str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="speculative_config.model: a draft model with tensor_parallel_size > 1"):
        cfg = load_model_source(llama_dir)[0]
        resolve(EngineArgs(model=llama_dir, tensor_parallel_size=2, **BASE), cfg, llama_dir, "cpu",
                weights_bytes=lambda m, d: 0, memory=lambda: (2**30, 2**30), draft=cfg)
