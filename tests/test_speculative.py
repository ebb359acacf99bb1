"""Speculative decoding (speculative_config, method "ngram"): the scheduler proposes tokens from a
request's own history (core/ngram.py), the step verifies them (a program of width Q takes each
row's logits at every proposed position), update() keeps those its sampler drew the same token
for (scheduler.kept_proposals). Outputs must be exactly the engine's without speculation, greedy or
seeded, whatever ends a request, with n > 1, logprobs, penalties, preemption and aborts; the sampled tokens'
distribution must be the target's (chi-square), which accepting every proposal breaks; the cost
model sizes proposals (speculation.choose); bad configuration is refused naming the field."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from compiles import no_compilation
from scipy import stats as scipy_stats
from test_async_scheduling import BASE, drive, summary, workload

from jaxsched import LLM, SamplingParams
from jaxsched.config import EngineArgs, SchedulerConfig, SpeculativeConfig, decide_async_scheduling
from jaxsched.core import scheduler as scheduler_module
from jaxsched.core import speculation
from jaxsched.core.block_manager import BlockManager
from jaxsched.core.buckets import seq_buckets, token_buckets
from jaxsched.core.ngram import NgramProposer
from jaxsched.core.request import Request
from jaxsched.core.scheduler import Scheduler
from jaxsched.core.stats import EngineStats
from jaxsched.engine_flags import add_engine_flags, engine_args_from

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


_ids = iter(range(10**6))


def _req(tokens, out=(), rid=None):
    r = Request(rid or f"r{next(_ids)}", list(tokens), SamplingParams(max_tokens=64))
    r.output_token_ids = list(out)
    return r


# -- proposals --------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_last_n_tokens_before():
    p = NgramProposer(1, 3)
    # "5 6 7" occurred at the start, followed by 8 9 10
    assert p.propose(_req([5, 6, 7, 8, 9, 10, 1, 2], [5, 6, 7]), 3) == [8, 9, 10]
    # the longest n wins: "2 7" (n = 2) occurred followed by 4; "7" alone was last followed by 3
    assert p.propose(_req([2, 7, 4, 0, 7, 3, 2], [7]), 1) == [4]
    # the latest occurrence with k tokens after it
    assert p.propose(_req([1, 2, 3, 9, 9, 1, 2, 4, 4, 0], [1, 2]), 2) == [4, 4]
    assert p.propose(_req([1, 2, 3, 4], [5]), 3) == []  # nothing recurs
    assert p.propose(_req([1, 2, 3, 4], [1]), 0) == []
    # min 2: a single recurring token is not enough
    assert NgramProposer(2, 3).propose(_req([9, 1, 2, 3], [9]), 2) == []


def test_ngram_history_follows_the_request_as_it_grows():
    p = NgramProposer(1, 2)
    r = _req([4, 5, 6, 7], [4], rid="r")
    assert p.propose(r, 2) == [5, 6]
    r.output_token_ids += [5, 6, 7, 4, 5]  # "4 5" -> 6 7
    assert p.propose(r, 2) == [6, 7]
    r.output_token_ids += list(range(100, 300)) + [100]  # grows past the buffer; "5 100"? no: "100" -> 101
    assert p.propose(r, 2) == [101, 102]
    p.forget(["r"])
    assert p._history == {}


# -- sizing by cost -----------------------------------------------------------------------------
BUCKETS = (16, 32, 64)


def test_choose_verifies_every_proposal_without_a_cost_model():
    props = [(0.9, 0), (0.8, 0), (0.1, 1)]
    assert speculation.choose(props, 4, 4, 100, BUCKETS, None) == 3
    assert speculation.choose(props, 4, 4, 2, BUCKETS, None) == 2  # the budget
    assert speculation.choose(props, 4, 4, 100, BUCKETS, lambda T, S, wide: 0.0) == 3  # no data yet


def test_choose_weighs_expected_tokens_against_predicted_time():
    # verifying costs 10 % more, and a token over 16 doubles the step
    def predict(T, S, wide):
        return (1.0 if T <= 16 else 2.0) * (1.1 if wide else 1.0)

    good = [(0.9, 0), (0.8, 0), (0.7, 1)]
    assert speculation.choose(good, 8, 8, 100, BUCKETS, predict) == 3  # (8 + 2.4) / 1.1 > 8
    bad = [(0.05, 0), (0.05, 1), (0.05, 2)]
    assert speculation.choose(bad, 8, 8, 100, BUCKETS, predict) == 0  # 8.15 / 1.1 < 8
    # filling the bucket is free; the next one doubles the step, which 20 likely tokens do not pay for
    many = [(0.5, i) for i in range(20)]
    assert speculation.choose(many, 8, 8, 100, BUCKETS, predict) == 8
    # a TPOT target: nothing predicted over it
    assert speculation.choose(good, 8, 8, 100, BUCKETS, predict, target_seconds=1.05) == 0


def test_acceptance_rate_falls_with_refusals_and_rises_with_keeps():
    kept, tried = 0.0, 0.0
    for _ in range(40):
        kept, tried = speculation.record(kept, tried, 3, 0)
    assert speculation.acceptance_rate(kept, tried) < speculation.MIN_RATE
    for _ in range(10):
        kept, tried = speculation.record(kept, tried, 3, 3)
    assert speculation.acceptance_rate(kept, tried) > 0.7


def _scheduler(spec=NGRAM, **kw):
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, enable_chunked_prefill=True,
                          token_buckets=token_buckets(64, 4), seq_buckets=seq_buckets(4),
                          speculative=SpeculativeConfig(**spec), **kw)
    return Scheduler(cfg, BlockManager(64, 8))


def test_a_request_whose_proposals_keep_failing_stops_getting_them():
    s = _scheduler()
    r = Request("a", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=200, ignore_eos=True))
    s.add_request(r)
    out = s.schedule()
    s.update(out, [3] * 8)  # prefill: the first token, 3 ("1 2 3" recurs: proposals come)
    proposed = []
    for _ in range(30):
        out = s.schedule()
        row = out.scheduled["a"]
        proposed.append(len(row.spec_token_ids))
        assert out.width == (4 if row.spec_token_ids else 1)
        assert row.num_new_tokens == 1 + len(row.spec_token_ids)
        # the model never draws a proposed token: 0, which no proposal is (the history has none before)
        s.update(out, [0] * (out.width * out.seq_bucket))
        s.check_invariants()
        r.output_token_ids[-1:] = [1]  # keep the history repetitive (as if 1 had been drawn)
    assert proposed[0] == 3 and proposed[-1] == 0, proposed
    assert s.num_accepted_tokens == 0 and s.num_draft_tokens == sum(proposed)
    # K/V counted: prompt + outputs but the last, which the next step computes
    assert r.num_computed_tokens == r.num_tokens - 1


def test_kept_proposals_and_the_slots_of_refused_ones():
    s = _scheduler()
    r = Request("a", [5, 6, 7, 8, 5, 6], SamplingParams(max_tokens=50, ignore_eos=True))
    s.add_request(r)
    s.update(s.schedule(), [7] * 8)  # output [7]: "5 6 7" recurs -> proposals 8 5 6
    out = s.schedule()
    row = out.scheduled["a"]
    assert list(row.spec_token_ids) == [8, 5, 6]
    sampled = [8, 5, 9, 1] + [0] * (out.width * out.seq_bucket - 4)  # keeps 8 5, then draws 9
    s.update(out, sampled)
    assert r.output_token_ids == [7, 8, 5, 9] and row.num_output == 3
    assert r.num_computed_tokens == r.num_tokens - 1
    assert s.block_manager.req_slots["a"] == r.num_computed_tokens
    assert s.stats().spec_decode_num_accepted_tokens_per_pos == (1, 1, 0)


def test_max_tokens_and_stop_tokens_end_a_request_mid_proposal():
    s = _scheduler()
    r = Request("a", [5, 6, 7, 8, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
    s.add_request(r)
    s.update(s.schedule(), [7] * 8)
    out = s.schedule()
    assert list(out.scheduled["a"].spec_token_ids) == [8]  # max_tokens 3: one token after the proposal's
    s.update(out, [8, 5] + [0] * 30)
    assert r.output_token_ids == [7, 8, 5] and r.is_finished
    s = _scheduler()
    r = Request("b", [5, 6, 7, 8, 5, 6], SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[5]))
    s.add_request(r)
    s.update(s.schedule(), [7] * 8)
    out = s.schedule()
    assert list(out.scheduled["b"].spec_token_ids) == [8, 5, 6]
    s.update(out, [8, 5, 6, 7] + [0] * 30)  # all kept, but 5 is a stop token: the rest is dropped
    assert r.output_token_ids == [7, 8, 5] and r.stop_reason == 5 and r.is_finished
    assert not s.block_manager.req_blocks


# -- the engine ---------------------------------------------------------------------------------
def _spec_workload(llm):
    reqs = workload(llm)
    # a fixed mask and a logit_bias apply at every verified position
    p = reqs[0][1]
    vocab = sorted(set(p))
    reqs.append(("r12", p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                          allowed_token_ids=vocab[: max(4, len(vocab) // 2)])))
    reqs.append(("r13", p, SamplingParams(temperature=0.7, seed=3, max_tokens=20, ignore_eos=True,
                                          logit_bias={vocab[0]: 5.0, vocab[1]: -5.0}, logprobs=3)))
    return reqs


@pytest.mark.parametrize("extra", [
    {},
    pytest.param({"num_gpu_blocks_override": 9, "preemption_mode": "recompute"}, marks=pytest.mark.slow),
    pytest.param({"num_gpu_blocks_override": 9, "preemption_mode": "swap"}, marks=pytest.mark.slow),
    {"async_scheduling": True},
], ids=["ample", "recompute", "swap", "overlap"])
def test_outputs_equal_the_engine_without_speculation(llama_dir, extra):
    """Greedy and seeded requests give exactly the tokens (and logprobs, to rounding) of the engine
    without speculation: stop strings and stop tokens mid-proposal, n > 1, a penalised and a
    min_tokens request, a fixed mask and a logit_bias, preemption, aborts. No compilation after
    warm-up."""
    runs, engines = {}, {}
    for spec in (None, NGRAM):
        llm = LLM(llama_dir, **BASE, **{"async_scheduling": False, **extra}, speculative_config=spec)
        reqs = _spec_workload(llm)
        with no_compilation():
            runs[spec is not None] = drive(llm, reqs)
        engines[spec is not None] = llm.llm_engine.stats()
        if "num_gpu_blocks_override" in extra:
            assert engines[spec is not None].num_preemptions > 0, "the small pool must force preemptions"
    plain, spec = runs[False], runs[True]
    assert set(plain) == set(spec) == {f"r{i}" for i in range(14)}
    for rid in plain:
        if rid in ("r8", "r11"):  # aborted once they had 3 tokens: a step may have brought several
            a, b = plain[rid].outputs[0].token_ids, spec[rid].outputs[0].token_ids
            assert len(b) >= len(a) == 3 and b[:3] == a, rid
            continue
        assert summary(spec[rid]) == summary(plain[rid]), rid
    st = engines[True]
    assert st.spec_decode_num_drafts > 0 and 0 < st.spec_decode_num_accepted_tokens <= st.spec_decode_num_draft_tokens
    assert sum(st.spec_decode_num_accepted_tokens_per_pos) == st.spec_decode_num_accepted_tokens
    assert st.spec_decode_mean_accepted_length > 1.0
    assert engines[False].spec_decode_num_drafts == 0
    assert st.num_steps < engines[False].num_steps, "kept proposals save steps"
    if extra.get("async_scheduling"):  # paused where proposals might come, overlapped elsewhere
        assert 0 < st.spec_decode_overlap_pauses < st.num_steps - 1, (st.spec_decode_overlap_pauses, st.num_steps)


def test_penalties_and_min_tokens_apply_at_every_verified_position(llama_dir):
    """Penalised requests verify proposals too: each verified position's table counts the proposals
    before it as outputs (and min_tokens counts them), so the tokens are the engine's without
    speculation, greedy or seeded."""
    outs, stats = {}, {}
    for spec in (None, NGRAM):
        llm = LLM(llama_dir, **BASE, speculative_config=spec)
        tok = llm.get_tokenizer()
        prompt = tok.encode("the cat sat on the mat and the cat sat on the hat and the cat sat on the")
        params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=0.3,
                                 repetition_penalty=1.1),
                  SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, presence_penalty=-0.5),
                  SamplingParams(temperature=0.9, seed=7, max_tokens=30, min_tokens=12, presence_penalty=0.2,
                                 logprobs=2)]
        with no_compilation():
            res = llm.generate([{"prompt_token_ids": prompt}] * 3, params, use_tqdm=False)
        outs[spec is not None] = [summary(o) for o in res]
        stats[spec is not None] = llm.llm_engine.stats()
    assert outs[True] == outs[False]
    assert stats[True].spec_decode_num_drafts > 0 and stats[True].spec_decode_num_accepted_tokens > 0


def test_overlap_pauses_only_where_a_row_may_be_given_proposals():
    """With overlapped scheduling the engine reads a step before scheduling the next where
    may_propose says so: the step verified proposals (how many were kept moves the next row), or
    a row of it may be given some next; a row the proposer had nothing for lets the overlap run on
    for EMPTY_RETRY_STEPS steps."""
    s = _scheduler()
    r = Request("a", [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=200, ignore_eos=True))
    s.add_request(r)
    out = s.schedule()
    assert s.may_propose(out), "a new request may be given proposals: the prior acceptance rate"
    s.update(out, [9] * 8)  # nothing recurs in 1..9: no proposal
    out = s.schedule()
    assert not out.scheduled["a"].spec_token_ids and not s.may_propose(out)
    for _ in range(speculation.EMPTY_RETRY_STEPS):  # overlapped: each step scheduled before the last is read
        nxt = s.schedule()
        assert not nxt.num_draft_tokens, "a row whose token is pending is given no proposals"
        s.update(out, [10 + s.step_count] * (out.width * out.seq_bucket))
        out = nxt
    assert s.may_propose(out), "asked again after EMPTY_RETRY_STEPS"
    s.update(out, [3] * (out.width * out.seq_bucket))  # "3" recurs: proposals come
    out = s.schedule()
    assert out.num_draft_tokens and s.may_propose(out)
    s.speculating = False
    s.update(out, [0] * (out.width * out.seq_bucket))
    out = s.schedule()
    assert not out.num_draft_tokens and not s.may_propose(out), "speculation off: never"


class _Prefix:
    """A stand-in grammar (depends on tokens) that takes only the first `n` proposals."""

    depends_on_tokens = True

    def __init__(self, n: int) -> None:
        self.n = n

    finished = False

    def valid_prefix(self, tokens) -> int:
        return min(self.n, len(tokens))

    def accept(self, token: int) -> None:
        return None


def test_proposals_a_grammar_refuses_are_cut_before_verification():
    s = _scheduler()
    r = Request("a", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=200, ignore_eos=True))
    s.add_request(r)
    s.update(s.schedule(), [3] * 8)  # the first token, 3: "1 2 3" recurs, three proposals come
    r.constraint = _Prefix(1)
    out = s.schedule()
    assert list(out.scheduled["a"].spec_token_ids) == [1] and out.num_draft_tokens == 1
    s.update(out, [0] * (out.width * out.seq_bucket))
    r.constraint = _Prefix(0)
    out = s.schedule()
    assert not out.scheduled["a"].spec_token_ids and out.width == 1


def test_grammar_rows_verify_the_proposals_their_grammar_takes(llama_dir):
    """Rows with a grammar verify n-gram proposals: each verified position's mask is the grammar's
    after the proposals before it (the matcher walks through them and back), and update() has the
    matcher take only the kept ones, so the tokens are the engine's without speculation, greedy and
    seeded, n > 1 included."""
    from jaxsched.structured.params import StructuredOutputsParams as SO

    outs, stats = {}, {}
    for spec in (None, NGRAM):
        llm = LLM(llama_dir, **BASE, speculative_config=spec)
        prompt = llm.get_tokenizer().encode("the cat sat on the mat and the cat sat on the hat and the cat sat on the")
        regex = SO(regex=r"(the (cat|hat|mat) (sat|ran) on ){3,6}the (cat|hat|mat)")
        schema = SO(json={"type": "object", "properties": {"a": {"type": "array", "items": {"enum": ["cat", "hat"]},
                                                                  "maxItems": 6}}, "required": ["a"],
                          "additionalProperties": False}, disable_any_whitespace=True)
        params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=regex),
                  SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=60, structured_outputs=regex, logprobs=2),
                  SamplingParams(temperature=0, max_tokens=60, structured_outputs=schema)]
        with no_compilation():
            res = llm.generate([{"prompt_token_ids": prompt}] * 3, params, use_tqdm=False)
        assert all(c.finish_reason == "stop" for o in res for c in o.outputs), [summary(o) for o in res]
        outs[spec is not None] = [summary(o) for o in res]
        stats[spec is not None] = llm.llm_engine.stats()
    assert outs[True] == outs[False]
    st = stats[True]
    assert st.spec_decode_num_drafts > 0 and st.spec_decode_num_accepted_tokens > 0


def test_only_kept_tokens_are_cached(llama_dir):
    """A request that continues another's output takes its blocks from the prefix cache: they must
    hold the kept tokens' K/V, never a refused proposal's, so its tokens equal the engine's
    without speculation (where nothing was cached from a proposal)."""
    outs = {}
    for spec in (None, NGRAM):
        llm = LLM(llama_dir, **BASE, speculative_config=spec)
        tok = llm.get_tokenizer()
        prompt = tok.encode("the cat sat on the mat and the cat sat on the hat")
        first = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=40,
                                                                            ignore_eos=True), use_tqdm=False)
        grown = prompt + list(first[0].outputs[0].token_ids[:33])
        second = llm.generate([{"prompt_token_ids": grown}], SamplingParams(temperature=0, max_tokens=20,
                                                                            ignore_eos=True), use_tqdm=False)
        st = llm.llm_engine.stats()
        outs[spec is not None] = (first[0].outputs[0].token_ids, second[0].outputs[0].token_ids, st)
    assert outs[True][:2] == outs[False][:2]
    st = outs[True][2]
    assert st.prefix_cache_hits >= 32, "the second request must take the first one's blocks"
    assert st.spec_decode_num_draft_tokens > st.spec_decode_num_accepted_tokens > 0, "some proposals refused"


def _chi_square(counts: np.ndarray, expected_p: np.ndarray) -> float:
    """The p-value of observed counts against probabilities, cells under 5 expected pooled."""
    n = counts.sum()
    exp = expected_p * n
    small = exp < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(exp[~small], exp[small].sum())
    keep = exp > 0
    return float(scipy_stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


@pytest.mark.slow  # ~25 s: two thousand requests and the target's full distributions
def test_sampled_tokens_follow_the_target_distribution(llama_dir, monkeypatch):
    """Temperature 1, seeds 0..N-1: the prompt holds every token once, so whatever t1 is drawn,
    prompt lookup (n = 1) proposes the token after t1 in the prompt, verified at t2. t2's counts
    must fit the target's marginal sum_t1 p(t1) p(t2 | t1), computed from the engine's own full
    logprobs without speculation (chi-square, p > 0.001); accepting every proposal must fail it."""
    N = 1000
    base = {**BASE, "max_model_len": 320, "max_num_seqs": 16, "max_num_batched_tokens": 320, "block_size": 16}
    with open(f"{llama_dir}/config.json") as f:
        V = json.load(f)["vocab_size"]
    spec = {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_max": 1, "prompt_lookup_min": 1}
    llm = LLM(llama_dir, **base, max_logprobs=V, speculative_config=spec)
    llm.llm_engine.client.call_utility("set_speculation", False)  # the target alone, first
    tokens = np.random.default_rng(0).permutation(np.arange(3, V)).tolist()
    lp = SamplingParams(temperature=1.0, max_tokens=1, logprobs=V, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": tokens}], lp, use_tqdm=False)[0].outputs[0].logprobs[0]
    p1 = np.zeros(V)
    for t, v in first.items():
        p1[t] = np.exp(v.logprob)
    second = llm.generate([{"prompt_token_ids": tokens + [t]} for t in range(V)], lp, use_tqdm=False)
    p2 = np.zeros((V, V))
    for t, o in enumerate(second):
        for u, v in o.outputs[0].logprobs[0].items():
            p2[t, u] = np.exp(v.logprob)
    marginal = p1 @ p2
    assert abs(marginal.sum() - 1) < 1e-3
    assert llm.llm_engine.stats().spec_decode_num_drafts == 0
    llm.llm_engine.client.call_utility("set_speculation", True)
    # max_tokens 3: a proposal is verified only where a token would follow it (t2's, then t3)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=3, ignore_eos=True) for i in range(N)]

    # the proposal after t1: the token after t1 in the prompt (-1 for a token not in it)
    after = np.full(V, -1)
    after[tokens[:-1]] = tokens[1:]
    after[tokens[-1]] = tokens[-1]  # the prompt's last token: its one earlier occurrence is itself
    # how often the target draws the proposal: sum_t1 p(t1) p(after[t1] | t1)
    q = sum(p1[t] * p2[t, after[t]] for t in range(V) if after[t] >= 0)

    def t2_counts():
        res = llm.generate([{"prompt_token_ids": tokens}] * N, params, use_tqdm=False)
        t1t2 = np.array([o.outputs[0].token_ids[:2] for o in res])
        return np.bincount(t1t2[:, 1], minlength=V), int((t1t2[:, 1] == after[t1t2[:, 0]]).sum())

    def fits(counts, proposed):
        """p-values: t2's counts against the target's marginal, and how often t2 is the proposal
        against q (a chi-square of two cells)."""
        return _chi_square(counts, marginal), _chi_square(np.array([proposed, N - proposed]), np.array([q, 1 - q]))

    before = llm.llm_engine.stats()
    counts, proposed = t2_counts()
    st = llm.llm_engine.stats()
    verified = st.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    assert verified >= N * 0.95, "every request's second token must be a verified one"
    assert 0 < st.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens == proposed
    assert min(fits(counts, proposed)) > 1e-3

    # a deliberately wrong rule: every proposal kept
    monkeypatch.setattr(scheduler_module, "kept_proposals", lambda sampled, proposed: len(proposed))
    llm.llm_engine.core.block_manager.reset_prefix_cache()
    counts, proposed = t2_counts()
    assert proposed >= N * 0.95
    assert fits(counts, proposed)[1] < 1e-6


def test_configuration_errors_name_the_field():
    for bad, field in [({"method": "medusa"}, "method"), ({"method": "eagle"}, "EAGLE heads are not built yet"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
                       ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
                       ({"method": "ngram", "lookahead": 2}, "unknown key"),
                       ({"num_speculative_tokens": 2}, "needs a 'method'"), ("{not json", "JSON object"),
                       (3, "must be a dict")]:
        with pytest.raises(ValueError, match=field):
            EngineArgs(speculative_config=bad)
    # overlapped scheduling: off unless asked for (it then pauses before steps that may verify proposals)
    assert decide_async_scheduling(EngineArgs(speculative_config={"method": "ngram"}, async_scheduling=True), None,
                                   "cpu", 0) is True
    assert decide_async_scheduling(EngineArgs(speculative_config={"method": "ngram"}), None, "gpu", 0) is False
    with pytest.raises(ValueError, match="several hosts"):
        EngineArgs(speculative_config={"method": "ngram"}, distributed_coordinator="10.0.0.1:1234", num_processes=2,
                   process_id=0)
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    ns = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'])
    assert engine_args_from(ns).speculative_config == SpeculativeConfig("ngram", 5)


def test_metrics_carry_vllms_spec_decode_counters():
    from prometheus_client import generate_latest

    from serving.metrics import EngineMetrics

    m = EngineMetrics()
    m.publish(EngineStats(spec_decode_num_drafts=4, spec_decode_num_draft_tokens=12,
                          spec_decode_num_accepted_tokens=7, spec_decode_num_accepted_tokens_per_pos=(4, 2, 1)))
    m.publish(EngineStats(spec_decode_num_drafts=5, spec_decode_num_draft_tokens=15,
                          spec_decode_num_accepted_tokens=9, spec_decode_num_accepted_tokens_per_pos=(5, 3, 1)))
    text = generate_latest(m.registry).decode()
    assert "jaxsched:spec_decode_num_drafts_total 5.0" in text
    assert "jaxsched:spec_decode_num_draft_tokens_total 15.0" in text
    assert "jaxsched:spec_decode_num_accepted_tokens_total 9.0" in text
    assert 'jaxsched:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 3.0' in text
