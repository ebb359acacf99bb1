"""The scheduling-policy contract: what SchedulerPolicy declares is what the scheduler uses, for the
built-in policies and the README's example alike."""

from __future__ import annotations

import os
import re

import pytest
from test_scheduler import EOS, make_sched, step

from jaxsched.core.block_manager import BlockManager
from jaxsched.core.policy import FCFSPolicy, PriorityPolicy, SchedulerPolicy, make_policy
from jaxsched.core.request import Request, SamplingParams
from jaxsched.core.scheduler import Scheduler

README = os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")


def readme_policy_class() -> type:
    """The policy class the README shows, defined from the README's own code block."""
    with open(README) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.DOTALL)
    code = next(b for b in blocks if "(SchedulerPolicy)" in b)
    # the block ends by building an LLM on the demo model; the class definition is what is tested
    code = code.split("\nllm = ")[0]
    scope: dict = {}
    exec(compile(code, README, "exec"), scope)  # noqa: S102 - our own README, on purpose
    return next(v for v in scope.values() if isinstance(v, type) and issubclass(v, SchedulerPolicy)
                and v is not SchedulerPolicy)


def test_readme_policy_goes_through_the_same_path_as_the_built_in_ones():
    cls = readme_policy_class()
    policy = cls()
    s, _ = make_sched(max_num_seqs=2, budget=64)
    s = Scheduler(s.config, BlockManager(64, 8), policy=policy)
    assert s.policy is policy and s._key == policy.sort_key  # the one path: queues sorted by this key
    for rid, n in (("long", 30), ("mid", 12), ("short", 3)):
        s.add_request(Request(rid, [7] * n, SamplingParams(max_tokens=4), eos_token_ids=(EOS,)))
    assert [r.request_id for r in s.waiting] == ["short", "mid", "long"]
    out = step(s)
    assert list(out.scheduled) == ["short", "mid"]  # two seats: the shortest prompts get them


def test_a_policy_must_define_sort_key():
    class NoKey(SchedulerPolicy):
        pass

    with pytest.raises(TypeError, match="sort_key"):
        NoKey()


def test_make_policy_refuses_what_is_not_a_policy():
    class Duck:  # the old duck-typed contract: prioritize() alone is no longer a policy
        def prioritize(self, requests):
            return list(requests)

    with pytest.raises(ValueError, match="SchedulerPolicy subclass"):
        make_policy(Duck())
    with pytest.raises(ValueError, match="'fcfs', 'priority'|\\['fcfs', 'priority'\\]"):
        make_policy("lifo")
    assert isinstance(make_policy("fcfs"), FCFSPolicy) and isinstance(make_policy("priority"), PriorityPolicy)


def test_a_user_policy_may_preempt_for_priority():
    """preempts_for_priority is read from any policy, not only the built-in one."""

    class Newest(SchedulerPolicy):
        preempts_for_priority = True

        def sort_key(self, request):
            return -request.seq_no

    s, _ = make_sched(max_num_seqs=1, budget=32)
    s = Scheduler(s.config, BlockManager(64, 8), policy=Newest())
    s.add_request(Request("old", [7] * 4, SamplingParams(max_tokens=20), eos_token_ids=(EOS,)))
    step(s)
    s.add_request(Request("new", [7] * 4, SamplingParams(max_tokens=20), eos_token_ids=(EOS,)))
    out = step(s)
    assert out.preempted == ["old"] and list(out.scheduled) == ["new"]
