"""The scheduler sizing steps by a step-cost model (scheduler._choose_by_cost): deferring decode rows
when the next bucket up costs more than the rows it adds, trimming prefill chunks to a TPOT target,
and replaying exactly from the same cost table."""

from __future__ import annotations

import json
import random

from jaxsched.config import SchedulerConfig
from jaxsched.core.block_manager import BlockManager
from jaxsched.core.buckets import bucket_pairs, seq_buckets, token_buckets
from jaxsched.core.request import Request, SamplingParams
from jaxsched.core.scheduler import Scheduler
from jaxsched.core.step_cost import StepCostModel, StepShape

BUDGET, SEQS = 256, 64


def config() -> SchedulerConfig:
    return SchedulerConfig(max_num_seqs=SEQS, max_num_batched_tokens=BUDGET, max_model_len=512,
                           enable_chunked_prefill=True, token_buckets=token_buckets(BUDGET, SEQS),
                           seq_buckets=seq_buckets(SEQS), swap_threshold=1.0)


def cost_model(per_token: float, fixed: float = 1e-3) -> StepCostModel:
    """A model that has seen steps costing fixed + per_token * T (context adds nothing)."""
    cfg = config()
    model = StepCostModel(bucket_pairs(cfg.token_buckets, cfg.seq_buckets))
    for T, S in model.pairs:
        for ctx in (S, 4 * S):
            model.observe(StepShape(T, S, ctx), fixed + per_token * T)
    return model


def scheduler(model, target=None, blocks: int = 512) -> Scheduler:
    return Scheduler(config(), BlockManager(blocks, 16), cost_model=model, target_step_seconds=target)


def add(s: Scheduler, n: int, prompt: int = 4, max_tokens: int = 6) -> list[Request]:
    reqs = [Request(f"r{i}", list(range(1, prompt + 1)), SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                        ignore_eos=True)) for i in range(n)]
    for r in reqs:
        s.add_request(r)
    return reqs


def run(s: Scheduler, steps: int = 1000) -> list[tuple]:
    """Step to the end, each row sampling token 7; the decisions of every step."""
    log = []
    while s.has_unfinished_requests() and steps:
        out = s.schedule()
        log.append((tuple((rid, row.num_new_tokens) for rid, row in out.scheduled.items()), out.token_bucket,
                    out.seq_bucket, out.num_deferred))
        s.update(out, [7] * out.num_seqs)
        s.check_invariants()
        steps -= 1
    assert not s.has_unfinished_requests()
    return log


def test_decode_rows_past_a_bucket_are_deferred_when_the_bigger_bucket_costs_more():
    # 33 decoding requests hold the pool's 33 blocks while 7 wait: the 32 bucket (linear cost)
    # beats 48 padded for one row
    s = scheduler(cost_model(per_token=1e-4), blocks=34)
    add(s, 40, prompt=4, max_tokens=8)
    log = run(s)
    decode_steps = [entry for entry in log if entry[1] <= 48 and len(entry[0]) >= 32]
    assert any(e[3] == 1 and e[1] == 32 for e in decode_steps), log
    # no request is deferred twice in a row: each gets a row in at least every other step
    last_seen = {}
    for i, (rows, *_rest) in enumerate(log):
        for rid, _ in rows:
            assert i - last_seen.get(rid, i - 1) <= 2, (rid, i)
            last_seen[rid] = i


def test_nothing_is_deferred_when_a_bigger_bucket_costs_nothing_more_or_no_row_has_slack():
    s = scheduler(cost_model(per_token=0.0), blocks=34)
    add(s, 40, prompt=4, max_tokens=8)
    assert all(e[3] == 0 for e in run(s))
    # the pool holds all 33, nothing waits, and the rows end together: a deferred row would end
    # the run a step later
    s = scheduler(cost_model(per_token=1e-4))
    add(s, 33, prompt=1, max_tokens=8)
    log = run(s)
    assert all(e[3] == 0 for e in log) and any(e[1] == 48 for e in log[1:]), log


def test_a_tpot_target_trims_prefill_chunks_and_never_defers_decodes():
    # steps cost 1 ms + 10 us per token bucket; the target allows T <= 128: prefill chunks beside
    # the 40 decodes are cut to fit, no decode waits
    model = cost_model(per_token=1e-5)
    target = 1e-3 + 128e-5
    s = scheduler(model, target=target)
    add(s, 40, prompt=4, max_tokens=20)
    first = s.schedule()
    s.update(first, [7] * first.num_seqs)
    for i in range(3):
        s.add_request(Request(f"long{i}", list(range(1, 200)), SamplingParams(temperature=0, max_tokens=4,
                                                                             ignore_eos=True)))
    log = run(s)
    for rows, T, S, deferred in log:
        assert deferred == 0 and model.predict(StepShape(T, S, 0)) <= target, (rows, T)
    assert max(T for _, T, _, _ in log) == 128  # the chunks fill the allowance, no more
    untargeted = scheduler(model)
    add(untargeted, 40, prompt=4, max_tokens=20)
    first = untargeted.schedule()
    untargeted.update(first, [7] * first.num_seqs)
    untargeted.add_request(Request("long", list(range(1, 200)), SamplingParams(temperature=0, max_tokens=4)))
    assert untargeted.schedule().token_bucket == 256  # without the target the chunk takes the budget


def test_the_same_cost_table_replays_the_same_decisions():
    table = json.loads(json.dumps(cost_model(per_token=1e-4).to_table()))
    logs = []
    for _ in range(2):
        s = scheduler(StepCostModel.from_table(table), blocks=40)
        add(s, 45, prompt=9, max_tokens=10)
        logs.append(run(s))
    assert logs[0] == logs[1] and any(e[3] for e in logs[0])


def test_a_target_no_step_can_meet_takes_the_quickest_step():
    # a target below any step's cost: prefill chunks are trimmed as far as they go (each row keeps
    # a token), decodes still run
    model = cost_model(per_token=1e-5)
    s = scheduler(model, target=1e-4)
    add(s, 4, prompt=4, max_tokens=3)
    first = s.schedule()
    s.update(first, [7] * first.num_seqs)
    s.add_request(Request("long", list(range(1, 200)), SamplingParams(temperature=0, max_tokens=4)))
    out = s.schedule()
    assert out.num_deferred == 0 and len(out.scheduled) == 5
    assert out.token_bucket == 16 and out.scheduled["long"].num_new_tokens == 12  # 4 decodes + 12 prompt tokens


def test_a_draining_batch_defers_only_rows_that_still_end_before_the_longest():
    # nothing waits; 40 rows of different lengths drain through the 48 and 32 buckets. Rows with
    # steps to spare are put off to land on the 32 bucket, the longest (r0, 15 tokens) never is,
    # so the run takes the steps it takes without the model and every request gets all its tokens
    def drain(model):
        s = scheduler(model)
        reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0, max_tokens=15 if i == 0 else 4 + i % 11,
                                                          ignore_eos=True)) for i in range(40)]
        for r in reqs:
            s.add_request(r)
        return run(s), reqs

    log, reqs = drain(cost_model(per_token=1e-4))
    plain, _ = drain(None)
    assert sum(e[3] for e in log) > 0, log
    assert len(log) == len(plain)
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in reqs)
    assert all("r0" in dict(rows) for rows, *_rest in log)  # the longest has a row in every step


def noisy_cost_model(seed: int, amp: float = 0.1) -> StepCostModel:
    """A linear cost table as a real run fits it: each pair off by up to +-amp (measured step times
    move by ~10 % on this CPU), so neighbouring buckets look a few per cent better or worse."""
    rnd = random.Random(seed)
    cfg = config()
    model = StepCostModel(bucket_pairs(cfg.token_buckets, cfg.seq_buckets))
    for T, S in model.pairs:
        f = 1 + rnd.uniform(-amp, amp)
        for ctx in (S, 4 * S):
            model.observe(StepShape(T, S, ctx), f * (1e-3 + 1e-4 * T))
    return model


def test_a_noisy_cost_table_never_lengthens_a_run_with_a_queue():
    # 60 requests of mixed prompt and output lengths through a 256-token budget: a queue for most
    # of the run, full prefill steps. Trimming a chunk to a bucket that only looked cheaper moved
    # prompt tokens to later steps and ended the run later; the model may now only defer decode
    # rows, so the run takes the steps it takes without it, padding no more
    def drive(model):
        s = scheduler(model)
        rnd = random.Random(1)
        reqs = [Request(f"r{i}", list(range(1, rnd.randint(8, 120))),
                        SamplingParams(temperature=0, max_tokens=rnd.randint(4, 40), ignore_eos=True))
                for i in range(60)]
        for r in reqs:
            s.add_request(r)
        log = run(s)
        padding = sum(T - sum(n for _, n in rows) for rows, T, _S, _d in log)
        return log, padding, reqs

    plain, plain_padding, _ = drive(None)
    for seed in range(6):
        log, padding, reqs = drive(noisy_cost_model(seed))
        assert len(log) == len(plain), (seed, len(log), len(plain))
        assert padding <= plain_padding, (seed, padding, plain_padding)
        assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in reqs)
