"""Overlapped scheduling (async_scheduling): step N+1 is scheduled and dispatched before step N's
tokens are read. Outputs must be exactly the synchronous engine's, whatever ends a request (EOS, a
stop token or string, max_tokens, an abort), with n > 1, logprobs, penalties, seeded sampling and
preemption by swap or recompute."""

from __future__ import annotations

import pytest
from compiles import no_compilation
from test_parity import SENTENCES

from jaxsched import LLM, SamplingParams
from jaxsched.config import SchedulerConfig
from jaxsched.core.block_manager import BlockManager
from jaxsched.core.buckets import seq_buckets, token_buckets
from jaxsched.core.request import Request
from jaxsched.core.scheduler import Scheduler
from pallas_kernels import tuning

# the step-cost model off: it sizes steps from measured times, so batches (and the last bits of
# logprobs) would differ from run to run; test_cost_model_keeps_the_tokens covers it
BASE = {"max_model_len": 96, "max_num_seqs": 8, "max_num_batched_tokens": 32, "block_size": 8,
        "step_cost_model": False}


def prompts(llm, n):
    tok = llm.get_tokenizer()
    return [tok.encode(SENTENCES[i % len(SENTENCES)] + " " + SENTENCES[(i + 2) % len(SENTENCES)])[: 4 + (9 * i) % 37]
            for i in range(n)]


def workload(llm):
    """(request id, prompt ids, params) of a mixed batch; stops are taken from a plain greedy run so
    that they do fire mid-generation."""
    ps = prompts(llm, 12)
    plain = llm.generate([{"prompt_token_ids": p} for p in ps],
                         SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    toks = [o.outputs[0].token_ids for o in plain]
    texts = [o.outputs[0].text for o in plain]
    params = [
        SamplingParams(temperature=0, max_tokens=20),  # EOS may end it
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[toks[1][6]]),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[texts[2][len(texts[2]) // 2:][:3]]),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=2),
        SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=15, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=18, ignore_eos=True, repetition_penalty=1.4,
                       presence_penalty=0.5),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=20, ignore_eos=True, min_tokens=4),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),  # aborted
        SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[toks[9][4]]),
        SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, include_stop_str_in_output=True,
                       stop=[texts[10][8:11]]),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),  # aborted
    ]
    return [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(ps, params))]


def drive(llm, reqs, abort_after: int = 3):
    """Add every request, step until done; abort r8 and r11 once each has `abort_after` tokens.
    Returns each request's last output."""
    eng = llm.llm_engine
    for rid, p, sp in reqs:
        eng.add_request(rid, {"prompt_token_ids": p}, sp)
    last = {}
    to_abort = {"r8", "r11"}
    while eng.has_unfinished_requests():
        for o in eng.step():
            last[o.request_id] = o
        for rid in sorted(to_abort):
            if rid in last and len(last[rid].outputs[0].token_ids) >= abort_after:
                eng.abort_request(rid)
                to_abort.discard(rid)
    eng.core.scheduler.check_invariants()
    assert not eng.core.block_manager.req_blocks and not eng.core.scheduler.swap_pool.req_blocks
    return last


def summary(o):
    """What must not depend on overlap: tokens, text, why it ended, and logprobs (to float rounding:
    preemption changes the batches a row runs in, and with them the last bits of its logits)."""
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
             None if c.logprobs is None else [sorted((t, lp.rank, round(lp.logprob, 3)) for t, lp in d.items())
                                              for d in c.logprobs]) for c in o.outputs]


@pytest.mark.parametrize("extra", [
    {},
    {"num_gpu_blocks_override": 9, "preemption_mode": "recompute"},
    {"num_gpu_blocks_override": 9, "preemption_mode": "swap"},
], ids=["ample", "recompute", "swap"])
def test_outputs_equal_the_synchronous_engine(llama_dir, extra):
    runs = {}
    for mode in (False, True):
        llm = LLM(llama_dir, **BASE, **extra, async_scheduling=mode)
        reqs = workload(llm)
        with no_compilation():
            runs[mode] = drive(llm, reqs)
        stats = llm.llm_engine.stats()
        if extra:
            assert stats.num_preemptions > 0, "the small pool must force preemptions"
    sync, over = runs[False], runs[True]
    assert set(sync) == set(over) == {f"r{i}" for i in range(12)}
    finished = [rid for rid in sync if rid not in ("r8", "r11")]
    assert all(sync[rid].finished for rid in finished)
    for rid in sync:  # the aborted ones too: each engine reported the same 3 tokens before the abort
        assert summary(over[rid]) == summary(sync[rid]), rid
    reasons = {c.finish_reason for rid in finished for c in sync[rid].outputs}
    assert reasons == {"stop", "length"}, "the workload must end requests both ways"
    assert sync["r1"].outputs[0].stop_reason is not None and sync["r2"].outputs[0].stop_reason is not None
    for rid in ("r8", "r11"):  # aborted mid-generation
        assert len(sync[rid].outputs[0].token_ids) == 3 and not sync[rid].finished


def test_the_default_is_the_engines_choice(llama_dir, monkeypatch, caplog):
    """async_scheduling=None is decided by config.resolve (cpu_affinity.auto_async_scheduling,
    asked with this engine's platform, reserve and hosts): on a CPU, off (logged, with why) once the
    model counts as keeping every core busy, here by moving the line to 0, and the tokens are the
    overlapped engine's; an explicit True is kept all the same. (The tiny model's default, on, is
    test_engine.py's `llm`.)"""
    import logging

    import jax

    from jaxsched import config
    from jaxsched.bench.driver import set_overlap
    from jaxsched.platforms import cpu_affinity

    cpu = jax.default_backend() == "cpu"
    monkeypatch.setattr(cpu_affinity, "AUTO_OVERLAP_MAX_FLOPS_PER_CORE", 0.0)
    asked = []
    decide = config.auto_async_scheduling
    monkeypatch.setattr(config, "auto_async_scheduling", lambda *a, **kw: asked.append(kw) or decide(*a, **kw))
    with caplog.at_level(logging.INFO, logger="jaxsched.config"):
        llm = LLM(llama_dir, **BASE)
    assert asked == [{"cpu": cpu, "reserved": 0, "multi_host": False}]
    eng = llm.llm_engine
    assert eng.core.async_scheduling is not cpu and eng.config.async_scheduling is not cpu
    if cpu:
        assert "async_scheduling: off (the model's" in caplog.text and "no core is reserved" in caplog.text
    ps = [{"prompt_token_ids": p} for p in prompts(llm, 6)]
    sp = SamplingParams(temperature=0, max_tokens=12)
    outs = {}
    for mode in (eng.core.async_scheduling, not eng.core.async_scheduling):
        set_overlap(eng, mode)
        with no_compilation():
            outs[mode] = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
    assert outs[True] == outs[False]
    assert LLM(llama_dir, **BASE, async_scheduling=True).llm_engine.core.async_scheduling is True
    assert len(asked) == 1  # a given value is not the rule's to decide


def test_the_auto_lines_nest():
    """reserve_count decides cpu_reserved_cores="auto" before async_scheduling is decided, taking an
    undecided overlap as on. That is consistent only while the overlap line lies below both reserve
    lines: a model that gets no core with overlap then runs synchronous, and gets none there either."""
    from jaxsched.platforms import cpu_affinity as c

    assert c.AUTO_OVERLAP_MAX_FLOPS_PER_CORE <= c.AUTO_MAX_FLOPS_PER_CORE_SYNC <= c.AUTO_MAX_FLOPS_PER_CORE


def test_llm_generate_and_stats_with_overlap(llama_dir):
    """LLM.generate with overlap on equals off; a finished request's wasted row is the only extra
    work (stops end requests that overlap had scheduled once more), and no step compiles."""
    outs, stats = {}, {}
    for mode in (False, True):
        llm = LLM(llama_dir, **BASE, async_scheduling=mode)
        ps = [{"prompt_token_ids": p} for p in prompts(llm, 10)]
        with no_compilation():
            res = llm.generate(ps, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        outs[mode] = [o.outputs[0].token_ids for o in res]
        stats[mode] = llm.llm_engine.stats()
    assert outs[True] == outs[False]
    n_stopped = sum(len(t) < 16 for t in outs[False])
    # each request stopped by a token costs at most one extra scheduled token
    assert stats[True].num_scheduled_tokens - stats[False].num_scheduled_tokens <= n_stopped
    # the device-only time is timed on the steps that ran with nothing else in flight: without
    # overlap every step but a program's first run, with overlap (almost) none
    sync, over = stats[False], stats[True]
    assert 0 < sync.device_busy_steps <= sync.num_steps and sync.device_busy_seconds > 0
    assert over.device_busy_steps < sync.device_busy_steps // 2


@pytest.mark.parametrize("penalty", [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0},
                                     {"repetition_penalty": 3.0}], ids=["presence", "frequency", "repetition"])
def test_penalised_steps_do_not_wait_and_give_the_synchronous_tokens(llama_dir, penalty):
    """With overlap, a penalised row's table lacks the token in flight; the sampler folds it in on
    the device (batch.pending_src), so no step waits for the one before, and the greedy tokens are
    the synchronous engine's. Strong penalties make every token count: a table without the last
    token lets it repeat at once."""
    runs, waited = {}, {}
    for mode in (False, True):
        llm = LLM(llama_dir, **BASE, async_scheduling=mode)
        runner = llm.llm_engine.core.runner
        flags = []
        dispatch = runner.dispatch

        def recording(out, dispatch=dispatch, flags=flags):
            step = dispatch(out)
            flags.append(step.needs_tokens)
            return step

        runner.dispatch = recording
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **penalty)
        with no_compilation():
            res = llm.generate([{"prompt_token_ids": p} for p in prompts(llm, 6)], params, use_tqdm=False)
        runs[mode] = [o.outputs[0].token_ids for o in res]
        waited[mode] = sum(flags)
        assert len(flags) > 24
    assert runs[True] == runs[False]
    assert waited[True] == 0


def test_min_tokens_counts_the_pending_token(llama_dir):
    """min_tokens masks a stop token while fewer outputs exist than it asks, the one in flight
    included: a request whose stop token comes first at output j, with min_tokens j, stops right
    there with overlap too (a mask that counted only the outputs read would block it one step more)."""
    llm = LLM(llama_dir, **BASE)
    ps = prompts(llm, 6)
    base = {"temperature": 0, "max_tokens": 24, "ignore_eos": True, "frequency_penalty": 1.0}
    free = llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(**base), use_tqdm=False)
    cases = []
    for p, o in zip(ps, free):
        toks = o.outputs[0].token_ids
        j = next((j for j in range(2, len(toks)) if toks[j] not in toks[:j]), None)
        if j is not None:
            cases.append((p, toks, j))
    assert len(cases) >= 3, "the fixture's greedy outputs must have fresh tokens to stop on"
    for mode in (False, True):
        llm = LLM(llama_dir, **BASE, async_scheduling=mode)
        params = [SamplingParams(**base, stop_token_ids=[toks[j]], min_tokens=j) for _, toks, j in cases]
        res = llm.generate([{"prompt_token_ids": p} for p, _, _ in cases], params, use_tqdm=False)
        for o, (_, toks, j) in zip(res, cases):
            c = o.outputs[0]
            assert (c.token_ids, c.finish_reason, c.stop_reason) == (toks[: j + 1], "stop", toks[j]), (mode, j)


def test_the_host_chosen_sampler_programs_give_the_same_outputs(llama_dir):
    """sampler_branches="host" (a GPU's choice: a sampler program without lax.cond, picked by the host
    for each step) and "mixed" (a CPU's: the argmax alone for all-greedy steps, else the program with
    conds) give the outputs of "device" (one program with conds), overlap on, with no compile after
    warm-up; the workload (greedy, sampled with and without filters, logprobs, penalties,
    min_tokens, a logit_bias, a long sampled request, then a greedy one with logprobs) makes the host
    pick every variant."""
    runs, used = {}, {}
    for mode in ("device", "host", "mixed"):
        llm = LLM(llama_dir, **BASE, sampler_branches=mode)
        runner = llm.llm_engine.core.runner
        picked = set()
        pick = runner.sampler_for

        def counting(S, needs, pick=pick, runner=runner, picked=picked):
            program = pick(S, needs)
            picked.add(runner._samplers[S].index(program))
            return program

        runner.sampler_for = counting
        reqs = workload(llm)
        biased = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={7: 100.0})
        reqs.append(("r12", reqs[0][1], biased))
        # sampled without filters, outliving the rest: its last steps need the draw alone
        reqs.append(("r13", reqs[0][1], SamplingParams(temperature=1.0, seed=3, max_tokens=45, ignore_eos=True)))
        # then, alone, greedy with logprobs
        later = [("r14", reqs[0][1], SamplingParams(temperature=0, logprobs=1, max_tokens=12, ignore_eos=True))]
        with no_compilation():
            runs[mode] = drive(llm, reqs) | drive(llm, later)
        used[mode] = picked
    assert used["device"] == {0}
    assert used["host"] == set(range(len(tuning.SAMPLER_VARIANTS))), used["host"]
    assert used["mixed"] == {0, 1}, used["mixed"]
    assert runs["host"]["r12"].outputs[0].token_ids == [7] * 6
    for mode in ("host", "mixed"):
        assert set(runs["device"]) == set(runs[mode])
        for rid in runs["device"]:
            assert summary(runs[mode][rid]) == summary(runs["device"][rid]), (mode, rid)


def _counting_picks(runner) -> list[int]:
    """The index of the sampler variant each step runs, appended as the runner picks it."""
    picked, pick = [], runner.sampler_for

    def counting(S, needs):
        program = pick(S, needs)
        picked.append(runner._samplers[S].index(program))
        return program

    runner.sampler_for = counting
    return picked


def test_a_min_tokens_row_past_its_minimum_runs_no_penalty_stage(llama_dir):
    """min_tokens alone counts no outputs: once the minimum is reached the row has an empty table and
    no token in flight to fold in, so the host picks the greedy variant, without the penalty stage,
    for its later steps. Before that, the variant with the penalty stage but without the filters'
    sort."""
    llm = LLM(llama_dir, **BASE, sampler_branches="host")
    picked = _counting_picks(llm.llm_engine.core.runner)
    sp = SamplingParams(temperature=0, max_tokens=12, min_tokens=3)  # EOS masked for 3 tokens
    with no_compilation():
        out = drive(llm, [("m", prompts(llm, 1)[0], sp)])
    assert len(out["m"].outputs[0].token_ids) > 3
    adjust = next(k for k, v in enumerate(tuning.SAMPLER_VARIANTS) if "adjust" in v)
    assert "filter" not in tuning.SAMPLER_VARIANTS[adjust]
    assert picked[:3] == [adjust] * 3 and set(picked[3:]) == {0}, picked


def test_a_step_without_top_k_p_or_min_p_runs_no_sort(llama_dir):
    """The filters' sort over [S, V] is by far the sampler's costliest part: a step that needs no
    filter (greedy structured output, penalties, a logit_bias, sampled rows with logprobs) gets a
    variant without it; one that does gets the filters."""
    runner = LLM(llama_dir, **BASE, sampler_branches="host").llm_engine.core.runner
    S = runner.bucket_pairs()[0][1]

    def picked(needs):
        return tuning.SAMPLER_VARIANTS[runner._samplers[S].index(runner.sampler_for(S, frozenset(needs)))]

    for needs in ({"adjust"}, {"adjust", "logprobs"}, {"sample", "adjust"}, {"sample", "logprobs"},
                  {"sample", "logprobs", "adjust"}):
        variant = picked(needs)
        assert needs <= variant and "filter" not in variant, (sorted(needs), sorted(variant))
        assert needs | {"filter"} <= picked(needs | {"sample", "filter"})


def test_a_sampler_programs_first_run_is_not_fed_to_the_cost_model(llama_dir):
    """Without warm-up runs, a step that runs a sampler variant for the first time pays its one-time
    costs: it is not fed to the step-cost model, even where its (T, S) program ran before."""
    llm = LLM(llama_dir, **{**BASE, "step_cost_model": True}, sampler_branches="host")
    eng = llm.llm_engine
    seen = []
    observe = eng.core._observe

    def recording(step, res):
        n = len(eng.core._costs)
        observe(step, res)
        seen.append(((step.out.token_bucket, step.out.seq_bucket), step.first_run, len(eng.core._costs) > n))

    eng.core._observe = recording
    p = prompts(llm, 1)[0]
    drive(llm, [("g", p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))])
    greedy = len(seen)
    drive(llm, [("s", p, SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True))])
    pairs = {pair for pair, _, _ in seen[:greedy]}
    first_sampled = seen[greedy]
    assert first_sampled[0] in pairs and first_sampled[1:] == (True, False), seen  # its prefill: pair ran, variant new
    assert all(fed == (not first) for _, first, fed in seen[greedy + 1 :]), seen


def test_cost_model_keeps_the_tokens(llama_dir):
    """With the step-cost model sizing steps (and deferring decode rows), greedy tokens are those
    of the max_paddings rule; logprobs agree to float rounding (batches differ)."""
    runs = {}
    for on in (False, True):
        llm = LLM(llama_dir, **{**BASE, "step_cost_model": on})
        with no_compilation():
            runs[on] = drive(llm, workload(llm))
    assert set(runs[False]) == set(runs[True])
    for rid, o in runs[False].items():
        for a, b in zip(o.outputs, runs[True][rid].outputs, strict=True):
            assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason, rid
            for da, db in zip(a.logprobs or [], b.logprobs or [], strict=True):
                assert da.keys() == db.keys()
                assert all(abs(da[t].logprob - db[t].logprob) < 1e-4 for t in da), rid


def _req(rid, n_prompt, max_tokens):
    from jaxsched.core.request import SamplingParams as SP

    return Request(rid, list(range(1, n_prompt + 1)), SP(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def test_scheduler_runs_one_step_ahead():
    """The scheduler alone: a step scheduled before the last one's update takes each decode row's
    token from the device (from_prev), a request whose pending token is its last gets no row, and a
    request preempted while its token was pending still gets that token."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, enable_chunked_prefill=True,
                          token_buckets=token_buckets(32), seq_buckets=seq_buckets(4))
    s = Scheduler(cfg, BlockManager(64, 8))
    a, b = _req("a", 5, 3), _req("b", 9, 1)
    s.add_request(a)
    s.add_request(b)
    o1 = s.schedule()
    assert [r.num_new_tokens for r in o1.scheduled.values()] == [5, 9] and a.num_pending == b.num_pending == 1
    o2 = s.schedule()  # before o1's update: a decodes its pending token, b (max_tokens 1) gets no row
    assert list(o2.scheduled) == ["a"] and o2.scheduled["a"].from_prev and o2.scheduled["a"].output_index == 1
    assert a.num_pending == 2 and a.num_computed_tokens == 6
    assert s.update(o1, [7, 8]) == [0, 1]
    assert a.output_token_ids == [7] and b.is_finished and b.output_token_ids == [8]
    o3 = s.schedule()
    row = o3.scheduled["a"]
    assert row.from_prev and row.output_index == 2 and a.num_pending == 2
    s.update(o2, [9])
    s.update(o3, [10])
    assert a.output_token_ids == [7, 9, 10] and a.is_finished and not s.has_unfinished_requests()

    # preempted (recompute) by the step scheduled while its token was pending: the token still counts
    c = _req("c", 5, 4)
    s.add_request(c)
    o4 = s.schedule()
    s.running.remove(c)
    s._preempted_now = set()
    s._preempt(c, o4)  # as the next schedule() would when the pool runs dry
    s.update(o4, [3])
    assert c.output_token_ids == [3] and c.num_pending == 0 and c.num_computed_tokens == 0
    o5 = s.schedule()
    assert o5.scheduled["c"].num_new_tokens == 6 and not o5.scheduled["c"].from_prev
    s.check_invariants()



def steady_params():
    """Rows that keep their sampling values from step to step: greedy, seeded draws with top-k,
    top-p and min-p, logprobs; of different lengths, so that rows end while the others go on."""
    return [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0.9, top_k=5, seed=3, max_tokens=17, ignore_eos=True),
            SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05, seed=4, max_tokens=21, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=13, ignore_eos=True, logprobs=2)]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_steady_decode_steps_are_packed_from_the_last_step(llama_dir, overlap, monkeypatch):
    """Decode steps of the last step's rows (or those of them still running), one token further,
    are packed from its buffers (batch.BatchPacker._pack_steady). The suite checks every such step
    against the full pack (tests/conftest.py); here it must run often, also after rows ended, the
    rows cross into new blocks (8-token blocks, up to 24 tokens each), and the outputs equal those
    with it switched off."""
    from jaxsched.runner.batch import BatchPacker

    def run():
        llm = LLM(llama_dir, **BASE, async_scheduling=overlap)
        ps = [{"prompt_token_ids": p} for p in prompts(llm, 8)]
        params = [steady_params()[i % 4] for i in range(8)]
        with no_compilation():
            res = llm.generate(ps, params, use_tqdm=False)
        packer = llm.llm_engine.core.runner.packer
        return [summary(o) for o in res], packer

    got, packer = run()
    assert packer.verify_steady, "tests/conftest.py turns the check on"
    assert packer.steady_packs >= 15, packer.steady_packs
    assert packer.steady_gathers >= 2, "rows that ended must leave steady steps of the others"
    monkeypatch.setattr(BatchPacker, "_pack_steady", lambda self, out, rows, buffers: None)
    want, off = run()
    assert off.steady_packs == 0
    assert got == want


def test_steady_pack_check_catches_a_wrong_field(llama_dir, monkeypatch):
    """The check the suite runs can fail: a steady pack with one wrong output index stops the step."""
    from jaxsched.runner.batch import BatchPacker

    steady = BatchPacker._pack_steady

    def off_by_one(self, out, rows, buffers):
        b = steady(self, out, rows, buffers)
        if b is not None:
            b.sample_index[0] += 1
        return b

    monkeypatch.setattr(BatchPacker, "_pack_steady", off_by_one)
    llm = LLM(llama_dir, **BASE)
    with pytest.raises(Exception) as e:
        llm.generate([{"prompt_token_ids": p} for p in prompts(llm, 4)],
                     SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    chain = [e.value, e.value.__cause__, e.value.__context__]
    assert any("steady pack differs from the full pack in ['sample_index']" in str(x) for x in chain), chain


def test_no_steady_pack_for_rows_whose_tables_move(llama_dir):
    """Penalties (their tables take every token), a logit_bias and min_tokens keep the full pack."""
    llm = LLM(llama_dir, **BASE)
    ps = [{"prompt_token_ids": p} for p in prompts(llm, 4)]
    for sp in (SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3),
               SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logit_bias={5: 1.0}),
               SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, min_tokens=18)):
        llm.generate(ps, sp, use_tqdm=False)
    assert llm.llm_engine.core.runner.packer.steady_packs == 0
