"""Property tests: random streams of add / abort / step with fabricated tokens, random priorities,
n in 1..3, tiny pools and both preemption modes. Invariants are checked after every step."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxsched.config import SchedulerConfig
from jaxsched.core.block_manager import BlockManager
from jaxsched.core.buckets import seq_buckets, token_buckets
from jaxsched.core.policy import PriorityPolicy
from jaxsched.core.request import Request, RequestStatus, SamplingParams
from jaxsched.core.scheduler import Scheduler

EOS = 1
AGING = 8


def build(mode: str, num_blocks: int, budget: int, max_seqs: int, caching: bool, policy, host_blocks: int):
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=64,
                          enable_chunked_prefill=True, token_buckets=token_buckets(budget),
                          seq_buckets=seq_buckets(max_seqs), preemption_mode=mode, swap_min_tokens=16,
                          num_host_blocks=host_blocks, swap_threshold=0.9, max_paddings=4)
    return Scheduler(cfg, BlockManager(num_blocks, 8, enable_prefix_caching=caching), policy=policy)


op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12), st.integers(0, 3), st.integers(1, 3),
              st.integers(0, 2)),
    st.tuples(st.just("abort"), st.integers(0, 40)),
    st.tuples(st.just("step"), st.integers(0, 6)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=5, max_size=60), mode=st.sampled_from(["swap", "recompute", "auto"]),
       num_blocks=st.integers(9, 24), budget=st.sampled_from([16, 24, 32]), max_seqs=st.integers(1, 6),
       caching=st.booleans(), use_priority=st.booleans(), host_blocks=st.sampled_from([0, 4, 32]),
       token_seed=st.integers(0, 2**16))
def test_random_streams_keep_invariants(ops, mode, num_blocks, budget, max_seqs, caching, use_priority,
                                        host_blocks, token_seed):
    policy = PriorityPolicy(aging_steps=AGING) if use_priority else "fcfs"
    s = build(mode, num_blocks, budget, max_seqs, caching, policy, host_blocks)
    bm = s.block_manager
    live: list[str] = []
    first_step: dict[str, int] = {}
    rng = token_seed

    def step() -> None:
        nonlocal rng
        waiting_before = {r.request_id for r in s.waiting}
        # whether a sibling waits for its first sample, as schedule() sees it (it counts the first
        # sample's prompt as computed once it is scheduled)
        waited = {r.request_id for r in s.waiting if s._waits_for_leader(r)}
        out = s.schedule()
        cfg = s.config
        rows = out.scheduled.values()
        assert sum(row.num_new_tokens for row in rows) == out.num_tokens <= cfg.max_num_batched_tokens
        assert all(row.num_new_tokens >= 1 for row in rows)
        assert len(s.running) <= cfg.max_num_seqs and out.num_seqs <= cfg.max_num_seqs
        for rid, row in out.scheduled.items():  # each row's block table is the request's after the step
            assert row.request.request_id == rid and list(row.block_ids) == bm.block_ids(rid)
        if out.scheduled:
            assert out.token_bucket >= out.num_tokens and out.seq_bucket >= out.num_seqs
        # admitted from waiting this step: the policy's order is respected (no overtaking except
        # by siblings that wait for their first sample's prompt)
        admitted = [row.request for rid, row in out.scheduled.items() if rid in waiting_before]
        if admitted:
            worst = max(s._key(r) for r in admitted)
            for r in s.waiting:
                if r.request_id in waiting_before and s._key(r) < worst:
                    assert r.request_id in waited or s._waits_for_leader(r), f"{r.request_id} was overtaken"
        for rid in out.scheduled:
            first_step.setdefault(rid, s.step_count)
        tokens = []
        for _ in out.scheduled:
            rng = (rng * 1103515245 + 12345) % 2**31
            tokens.append(EOS if rng % 23 == 0 else 2 + rng % 50)
        s.update(out, tokens)
        s.check_invariants()
        st_ = bm.stats()
        assert st_.num_used_blocks + st_.num_free_blocks == bm.num_usable_blocks
        assert st_.num_cached_blocks <= st_.num_free_blocks

    n_added = 0
    for o in ops:
        if o[0] == "add":
            _, plen, max_tokens, prio, n, variant = o
            prompt = [3 + (variant * 7 + i) % 40 for i in range(plen)]  # shared prefixes across variants
            sp = SamplingParams(max_tokens=max_tokens, n=n)
            rid = f"r{n_added}"
            n_added += 1
            for i in range(n):
                req = Request(f"{i}_{rid}" if n > 1 else rid, prompt, sp, priority=prio, eos_token_ids=(EOS,),
                              group_id=rid if n > 1 else None, group_size=n)
                s.add_request(req)
                live.append(req.request_id)
        elif o[0] == "abort":
            if live:
                rid = live[o[1] % len(live)]
                s.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
                s.check_invariants()
        else:
            for _ in range(o[1]):
                step()
    # Drain: everything finishes (no request starves; bounded by the aging rule and pool size).
    for _ in range(5000):
        if not s.has_unfinished_requests():
            break
        step()
    assert not s.has_unfinished_requests(), s.stats()
    assert bm.num_free_blocks == bm.num_usable_blocks and not bm.req_blocks
    assert s.swap_pool.num_free_blocks == s.swap_pool.num_blocks


def test_aging_bounds_starvation():
    """A priority-9 request under an endless stream of priority-0 arrivals is overtaken only by
    requests that arrived within the policy's starvation bound after it, so it does get served."""
    policy = PriorityPolicy(aging_steps=AGING)
    s = build("recompute", 64, 16, 1, False, policy, 0)
    low = Request("low", [5] * 4, SamplingParams(max_tokens=2), priority=9, eos_token_ids=(EOS,))
    s.add_request(low)
    overtook: list[Request] = []
    for k in range(400):
        s.add_request(Request(f"hi{k}", [6] * 4, SamplingParams(max_tokens=2), priority=0, eos_token_ids=(EOS,)))
        out = s.schedule()
        if "low" in out.scheduled:
            break
        overtook.extend(row.request for row in out.scheduled.values() if row.request not in overtook)
        s.update(out, [7] * out.num_seqs)
    else:
        raise AssertionError("the low-priority request starved")
    latest = max(r.arrival_step for r in overtook)
    assert latest - low.arrival_step <= policy.starvation_bound(9), latest
    assert len(overtook) >= 9 * AGING - 1  # and priority did matter: it waited for the window


def test_priority_preempts_lowest_running():
    s = build("recompute", 64, 32, 2, False, PriorityPolicy(), 0)
    for rid, prio in (("a", 5), ("b", 3)):
        s.add_request(Request(rid, [5] * 4, SamplingParams(max_tokens=20), priority=prio, eos_token_ids=(EOS,)))
    s.update(s.schedule(), [7, 7])
    s.add_request(Request("urgent", [5] * 4, SamplingParams(max_tokens=20), priority=0, eos_token_ids=(EOS,)))
    out = s.schedule()
    assert out.preempted == ["a"] and set(out.scheduled) == {"b", "urgent"}
    assert s.stats().num_preemptions == 1


def test_priority_preemption_does_not_thrash_for_a_blocked_sibling():
    """A waiting sibling that waits for its first sample's prompt cannot be admitted, so it must not
    preempt anyone (it once made the same victim be preempted and re-admitted every step)."""
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=512, enable_chunked_prefill=True,
                          token_buckets=token_buckets(64), seq_buckets=seq_buckets(2), long_prefill_token_threshold=32)
    s = Scheduler(cfg, BlockManager(64, 16, enable_prefix_caching=True), policy=PriorityPolicy())
    s.add_request(Request("v", [5] * 100, SamplingParams(max_tokens=50), priority=5, eos_token_ids=(EOS,)))
    s.update(s.schedule(), [7])
    sp = SamplingParams(max_tokens=4, n=2)
    for i in range(2):
        s.add_request(Request(f"{i}_g", [6] * 300, sp, priority=0, eos_token_ids=(EOS,), group_id="g", group_size=2))
    for _ in range(12):
        out = s.schedule()
        assert not set(out.preempted) & set(out.scheduled)
        s.update(out, [7] * out.num_seqs)
        s.check_invariants()
    # once, legitimately: when the sibling can finally join, it takes the lower-priority seat
    assert s.num_preemptions == 1


def test_prefix_cache_counts_each_admission_once():
    s = build("recompute", 32, 64, 4, True, "fcfs", 0)
    s.add_request(Request("a", [5] * 40, SamplingParams(max_tokens=2), eos_token_ids=(EOS,)))
    s.update(s.schedule(), [7])
    s.add_request(Request("b", [5] * 40, SamplingParams(max_tokens=2), eos_token_ids=(EOS,)))
    s.update(s.schedule(), [7, 7])
    st_ = s.stats()
    assert (st_.prefix_cache_queries, st_.prefix_cache_hits) == (80, 32)  # b hits a's 4 full blocks of 8


def test_recover_after_a_failed_step_requeues_this_steps_swaps_and_names_the_running():
    """A step that failed on the device leaves no trusted prefix-cache entry and no trusted host
    copy: requests it swapped out go back to waiting (recomputed from scratch), and recover()
    names every running request (their KV lived in the pool the failed step held)."""
    s = build("swap", 8, 32, 3, True, "fcfs", 32)
    for rid in "abc":
        s.add_request(Request(rid, [5 + ord(rid)] * 12, SamplingParams(max_tokens=20), eos_token_ids=(EOS,)))
    out = s.schedule()
    while not out.swapped_out:  # decode until the 7 usable blocks run out and someone is swapped
        s.update(out, [7] * out.num_seqs)
        out = s.schedule()
    assert s.block_manager.cached  # full blocks were registered
    swapped = list(out.swapped_out)
    suspect = s.recover(out)
    assert sorted(suspect) == sorted(r.request_id for r in s.running) and suspect
    assert not s.block_manager.cached
    for rid in swapped:
        req = s.requests[rid]
        assert req.status == RequestStatus.WAITING and req.num_computed_tokens == 0 and req in s.waiting
        assert rid not in s.swap_pool.req_blocks
    s.finish_requests(suspect, RequestStatus.FINISHED_ERROR)
    s.check_invariants()
    out = s.schedule()  # the swapped ones are admitted again, by recompute
    assert set(out.scheduled) == set(swapped)
