"""Scheduler tests: fabricated requests and fabricated sampled tokens, no model, no jax."""

from __future__ import annotations

import random

import pytest

from jaxsched.config import SchedulerConfig
from jaxsched.core.block_manager import BlockManager
from jaxsched.core.buckets import seq_buckets, token_buckets
from jaxsched.core.request import Request, RequestStatus, SamplingParams
from jaxsched.core.scheduler import Scheduler

EOS = 2


def make_sched(num_blocks=64, block_size=8, max_num_seqs=4, budget=32, max_model_len=128, chunked=True):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                          enable_chunked_prefill=chunked, token_buckets=token_buckets(budget),
                          seq_buckets=seq_buckets(max_num_seqs))
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(cfg, bm), bm


def make_req(rid, n_prompt=10, max_tokens=4, **kw) -> Request:
    return Request(rid, [7] * n_prompt, SamplingParams(max_tokens=max_tokens, **kw), eos_token_ids=(EOS,))


def step(s: Scheduler, token: int = 5, per_request: dict[str, int] | None = None):
    out = s.schedule()
    s.update(out, [(per_request or {}).get(rid, token) for rid in out.scheduled])
    s.block_manager.check_invariants()
    return out


def scheduled(out) -> dict[str, int]:
    return {rid: row.num_new_tokens for rid, row in out.scheduled.items()}


def test_continuous_batching_fcfs():
    s, _bm = make_sched()
    for rid in "abc":
        s.add_request(make_req(rid))
    out = step(s)
    assert scheduled(out) == {"a": 10, "b": 10, "c": 10}
    assert (out.num_tokens, out.token_bucket, out.seq_bucket) == (30, 32, 4)
    s.add_request(make_req("d"))
    out = step(s)  # the new request joins the running decodes in the same step
    assert scheduled(out) == {"a": 1, "b": 1, "c": 1, "d": 10}
    assert [r.request_id for r in s.running] == ["a", "b", "c", "d"]


def test_chunked_prefill_and_discarded_partial_samples():
    s, bm = make_sched(budget=16)
    r = make_req("a", n_prompt=50, max_tokens=2)
    s.add_request(r)
    chunks = [scheduled(step(s, token=9))["a"] for _ in range(4)]
    assert chunks == [16, 16, 16, 2]
    assert r.output_token_ids == [9]  # only the last chunk's sample counts
    assert r.num_computed_tokens == 50
    out = step(s, token=9)
    assert scheduled(out) == {"a": 1}
    assert r.is_finished and r.finish_reason.value == "length"
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_token_budget_and_seq_cap():
    s, _ = make_sched(max_num_seqs=3, budget=25)
    for i in range(6):
        s.add_request(make_req(str(i), n_prompt=10))
    out = step(s)
    assert out.num_tokens <= 25 and out.num_seqs <= 3
    assert scheduled(out) == {"0": 10, "1": 10, "2": 5}  # the third gets a chunk
    for _ in range(3):
        out = step(s)
        assert out.num_seqs <= 3 and len(s.running) <= 3


def test_chunking_disabled_waits_for_room():
    s, _ = make_sched(budget=32, chunked=False)
    s.add_request(make_req("a", n_prompt=20))
    s.add_request(make_req("b", n_prompt=20))
    out = step(s)
    assert scheduled(out) == {"a": 20}  # b does not fit whole and is not chunked
    out = step(s)
    assert scheduled(out) == {"a": 1, "b": 20}


def test_preemption_by_recompute_picks_latest_arrival():
    # 6 usable blocks of 8 slots; three requests of 16 prompt tokens take 2 blocks each.
    s, bm = make_sched(num_blocks=7, block_size=8, max_num_seqs=4, budget=64)
    reqs = [make_req(rid, n_prompt=16, max_tokens=10) for rid in "abc"]
    for r in reqs:
        s.add_request(r)
    out = step(s)
    assert bm.num_free_blocks == 0
    out = step(s)  # each needs a third block: the latest arrival, c, is preempted
    assert out.preempted == ["c"]
    assert scheduled(out) == {"a": 1, "b": 1}
    c = reqs[2]
    assert c.status == RequestStatus.WAITING and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert bm.block_ids("c") == [] and s.waiting[0] is c
    assert c.output_token_ids == [5]  # its output survives and will be recomputed
    # run to completion: c comes back and recomputes prompt + output
    while s.has_unfinished_requests():
        step(s)
    assert all(len(r.output_token_ids) == 10 for r in reqs)
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert s.num_preemptions >= 1


def test_stop_conditions_and_finish_reasons():
    s, bm = make_sched()
    a = make_req("a", max_tokens=5)
    b = make_req("b", max_tokens=5, ignore_eos=True)
    c = make_req("c", max_tokens=5, stop_token_ids=[9])
    for r in (a, b, c):
        s.add_request(r)
    step(s, per_request={"a": EOS, "b": EOS, "c": 5})
    assert a.status == RequestStatus.FINISHED_STOPPED and a.stop_reason is None
    assert b.status == RequestStatus.RUNNING  # ignore_eos keeps going
    step(s, per_request={"b": 5, "c": 9})
    assert c.status == RequestStatus.FINISHED_STOPPED and c.stop_reason == 9
    while s.has_unfinished_requests():
        step(s, token=EOS)
    assert b.status == RequestStatus.FINISHED_LENGTH and len(b.output_token_ids) == 5
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_max_model_len_ends_a_request():
    s, _bm = make_sched(max_model_len=16)
    r = make_req("a", n_prompt=12, max_tokens=None)
    s.add_request(r)
    while s.has_unfinished_requests():
        step(s)
    assert r.num_tokens == 16 and r.finish_reason.value == "length"


def test_abort_waiting_and_running():
    s, bm = make_sched(max_num_seqs=1)
    s.add_request(make_req("a"))
    s.add_request(make_req("b"))
    step(s)
    s.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests() and not s.running and not s.waiting
    assert bm.num_free_blocks == bm.num_usable_blocks
    out = s.schedule()
    assert out.is_empty and sorted(out.finished_ids) == ["a", "b"]


def test_refuses_requests_that_can_never_run():
    s, _ = make_sched(num_blocks=5, block_size=8, max_model_len=64)  # 4 blocks = 32 slots
    with pytest.raises(ValueError, match="max_model_len is 64"):
        s.add_request(make_req("a", n_prompt=64))
    with pytest.raises(ValueError, match=r"needs 5 KV blocks \(40 tokens\) but the pool has 4"):
        s.add_request(make_req("b", n_prompt=30, max_tokens=10))
    s.add_request(make_req("c"))
    with pytest.raises(ValueError, match="already in flight"):
        s.add_request(make_req("c"))
    assert list(s.requests) == ["c"]  # the refused ones left no trace


def run_trace(seed: int) -> list[tuple]:
    """Random adds, aborts and tokens; returns every decision. Used to check replay."""
    rnd = random.Random(seed)
    s, bm = make_sched(num_blocks=9, block_size=8, max_num_seqs=4, budget=24)
    decisions, n = [], 0
    for t in range(200):
        if rnd.random() < 0.3 and n < 30:
            s.add_request(make_req(f"r{n}", n_prompt=rnd.randint(1, 30), max_tokens=rnd.randint(1, 30)))
            n += 1
        if rnd.random() < 0.05 and s.requests:
            s.finish_requests([rnd.choice(sorted(s.requests))], RequestStatus.FINISHED_ABORTED)
        out = s.schedule()
        assert out.num_tokens <= 24 and out.num_seqs <= 4 and len(s.running) <= 4
        decisions.append((tuple(scheduled(out).items()), tuple(out.preempted)))
        s.update(out, [rnd.choice([5, 6, 7, 8, EOS]) for _ in out.scheduled])
        bm.check_invariants()
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update(out, [5] * out.num_seqs)
    assert bm.num_free_blocks == bm.num_usable_blocks
    return decisions


def test_random_workload_conserves_blocks_and_replays_exactly():
    a = run_trace(1)
    assert any(d[1] for d in a), "the trace should exercise preemption"
    assert a == run_trace(1)


def test_a_failed_request_forgets_only_its_own_cached_blocks():
    """A request that ends with an error takes out of the prefix cache the blocks it computed (their
    K/V may not match their hashes), not the prefix it found there: the next request sharing that
    prefix still hits it."""
    s, bm = make_sched(budget=64)
    bm.enable_prefix_caching = True
    shared = list(range(100, 124))  # three full blocks
    s.add_request(Request("a", shared + [1], SamplingParams(max_tokens=1), eos_token_ids=(EOS,)))
    step(s)
    from_a = set(bm.cached)
    assert len(from_a) == 3 and "a" not in s.requests
    tail = list(range(200, 217))  # two more full blocks and a token
    s.add_request(Request("b", shared + tail, SamplingParams(max_tokens=8), eos_token_ids=(EOS,)))
    step(s)
    assert bm.req_num_hits["b"] == 3 and len(set(bm.cached) - from_a) == 2
    s.finish_requests(["b"], RequestStatus.FINISHED_ERROR)
    assert set(bm.cached) == from_a
    bm.check_invariants()
    c = Request("c", shared + tail, SamplingParams(max_tokens=8), eos_token_ids=(EOS,))
    assert len(bm.lookup(c)) == 3


def test_deadlines_end_requests_and_a_queue_deadline_only_before_they_start():
    s, bm = make_sched(max_num_seqs=2, budget=64)
    late = make_req("late", max_tokens=20)
    late.deadline = 10.0
    queued = [make_req(r, max_tokens=20) for r in "abc"]
    for r in queued:
        r.queue_deadline = 5.0
    for r in [late, *queued]:
        s.add_request(r)
    step(s)  # late and a start (max_num_seqs = 2); b and c wait
    assert s.expire(4.9) == []
    ended = s.expire(5.0)
    assert sorted(r.request_id for r in ended) == ["b", "c"]
    assert all(r.status == RequestStatus.FINISHED_QUEUE_TIMEOUT and r.finish_reason.value == "queue_timeout"
               for r in ended)
    assert "a" in s.requests  # it had started: its queue deadline no longer applies
    step(s)
    [gone] = s.expire(10.0)
    assert gone.request_id == "late" and gone.status == RequestStatus.FINISHED_TIMEOUT
    assert "late" not in bm.req_blocks and set(s.requests) == {"a"}
    bm.check_invariants()
    assert s.expire(1e9) == [] and not s.has_deadlines
