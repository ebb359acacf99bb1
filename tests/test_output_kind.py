"""SamplingParams.output_kind (vLLM's RequestOutputKind): CUMULATIVE outputs every step, DELTA only
what is new, FINAL_ONLY one output at the end, all three the same request's tokens and text; and
LLM.generate builds only final outputs."""

from __future__ import annotations

import dataclasses

import pytest
from test_parity import SENTENCES

from jaxsched import LLM, RequestOutputKind, SamplingParams
from jaxsched.engine.output_processor import OutputProcessor
from jaxsched.errors import InvalidRequestError

ENGINE = {"max_model_len": 96, "max_num_seqs": 8, "max_num_batched_tokens": 32, "block_size": 8}
K = RequestOutputKind


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, **ENGINE)


def _prompt(llm, i=0):
    return {"prompt_token_ids": llm.get_tokenizer().encode(SENTENCES[i % len(SENTENCES)])[:12]}


def _run(llm, prompt, params: SamplingParams, kind: RequestOutputKind, rid: str):
    """Every output of one request, stepped to the end (other requests share none of its steps)."""
    eng = llm.llm_engine
    eng.add_request(rid, prompt, dataclasses.replace(params, output_kind=kind))
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.request_id == rid]
    assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1])
    return outs


def _joined(outs, index=0):
    """A sample's DELTA outputs put together: (text, token ids, logprobs)."""
    comps = [c for o in outs for c in o.outputs if c.index == index]
    lps = [lp for c in comps for lp in (c.logprobs or [])]
    return "".join(c.text for c in comps), [t for c in comps for t in c.token_ids], lps


@pytest.mark.parametrize("n", [1, 2])
def test_final_only_is_one_output_the_cumulatives_last(llm, n):
    params = SamplingParams(n=n, temperature=0.0 if n == 1 else 0.8, seed=3, max_tokens=20, logprobs=2,
                            ignore_eos=True)
    cum = _run(llm, _prompt(llm), params, K.CUMULATIVE, f"cum{n}")
    fin = _run(llm, _prompt(llm), params, K.FINAL_ONLY, f"fin{n}")
    assert len(cum) >= 20 and len(fin) == 1  # an output per step (per sample that moved) against one
    assert [(c.index, c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason)
            for c in fin[0].outputs] == [(c.index, c.text, c.token_ids, c.logprobs, c.cumulative_logprob,
                                          c.finish_reason) for c in cum[-1].outputs]


@pytest.mark.parametrize("n", [1, 2])
def test_delta_outputs_add_up_to_the_cumulative_ones(llm, n):
    params = SamplingParams(n=n, temperature=0.0 if n == 1 else 0.8, seed=5, max_tokens=24, logprobs=1,
                            ignore_eos=True)
    cum = _run(llm, _prompt(llm, 1), params, K.CUMULATIVE, f"cum-d{n}")
    delta = _run(llm, _prompt(llm, 1), params, K.DELTA, f"delta{n}")
    for o in delta:  # each output holds the samples that got a token since the last, with new tokens only
        assert o.outputs and all(c.token_ids for c in o.outputs)
        assert [c.index for c in o.outputs] == sorted({c.index for c in o.outputs})
    assert sum(len(c.token_ids) for o in delta for c in o.outputs) == n * 24
    for want in cum[-1].outputs:
        text, ids, lps = _joined(delta, want.index)
        assert (text, ids, lps) == (want.text, want.token_ids, want.logprobs)
    last = {c.index: c for c in delta[-1].outputs}
    assert all(c.finish_reason == "length" for c in last.values())


def test_delta_text_never_shows_what_a_stop_string_takes_back(llm):
    """A stop string may begin in text already generated: DELTA holds text back while it may, so
    the deltas put together are at every step a prefix of the final text, which ends before it."""
    base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    free = _run(llm, _prompt(llm, 2), base, K.CUMULATIVE, "free")[-1].outputs[0].text
    # a 3-character stop string from the middle of the output that spans at least two tokens' text
    stop = next(free[i:i + 3] for i in range(len(free) // 3, len(free) - 3) if free[i:i + 3].strip() == free[i:i + 3])
    params = dataclasses.replace(base, stop=[stop])
    want = _run(llm, _prompt(llm, 2), params, K.CUMULATIVE, "cum-stop")[-1].outputs[0]
    assert want.finish_reason == "stop" and want.stop_reason == stop and stop not in want.text
    delta = _run(llm, _prompt(llm, 2), params, K.DELTA, "delta-stop")
    seen = ""
    for o in delta:
        seen += o.outputs[0].text
        assert want.text.startswith(seen), (seen, want.text)
    assert seen == want.text and delta[-1].outputs[0].stop_reason == stop


@pytest.mark.parametrize("bad", [3, -1, 1.0, "DELTA", None, True])
def test_output_kind_must_be_one_of_the_three(bad):
    with pytest.raises(InvalidRequestError, match="output_kind") as e:
        SamplingParams(output_kind=bad)
    assert e.value.param == "output_kind"


def test_generate_builds_only_the_final_outputs(llm, monkeypatch):
    built = []
    original = OutputProcessor._output

    def counting(self, state, which, final):
        built.append(state.request_id)
        return original(self, state, which, final)

    monkeypatch.setattr(OutputProcessor, "_output", counting)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([_prompt(llm, i) for i in range(4)], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [10] * 4
    assert sorted(built) == sorted(o.request_id for o in outs)  # one each, not one per step
    assert params.output_kind == K.CUMULATIVE  # the caller's params are left as they were
