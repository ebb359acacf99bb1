"""Scheduling policies: which request goes first. Plain Python: no jax, no clocks.

The contract is the SchedulerPolicy ABC, and it is exactly what the scheduler uses: a `sort_key`
per request (smaller runs first) that does not change while the request sits in a queue, and
whether a waiting request may preempt a running one that ranks below it. A static key lets the
scheduler keep its queues sorted by insertion instead of re-sorting them every step, which keeps
its share of a step small with thousands of requests waiting (scripts/bench_scheduler.py). The built-in policies go through the same path as
any user's.

Aging without clocks: PriorityPolicy's key is priority + arrival_step / aging_steps. Between two
requests waiting at the same time the step count cancels out, so the key is static, and a request
of priority p is overtaken only by requests whose key is smaller: requests of priority p - d that
arrived less than d * aging_steps steps after it. That bounds how long any request can starve.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from jaxsched.core.request import Request


class SchedulerPolicy(ABC):
    """Orders requests. The scheduler serves running requests in key order, admits swapped and
    waiting ones in key order, and preempts from the end of the running queue."""

    name = "custom"
    # May a waiting request that does not fit preempt the lowest-ranked running request, when that
    # one's key is larger? (vLLM's priority scheduling does; FCFS never preempts for rank.)
    preempts_for_priority = False

    @abstractmethod
    def sort_key(self, request: Request) -> Any:
        """The request's rank, smaller first. It is read when the request enters a queue (arrival,
        preemption, admission) and must not change while it sits there; break ties with
        request.seq_no (arrival order)."""


class FCFSPolicy(SchedulerPolicy):
    """First come, first served: arrival order."""

    name = "fcfs"

    def sort_key(self, request: Request) -> int:
        return request.seq_no


class PriorityPolicy(SchedulerPolicy):
    """Lower `priority` first, ties by arrival (vLLM's "priority"), with aging: every
    `aging_steps` steps a request has waited count as one priority level.

    A waiting request that ranks above the lowest-ranked running request may preempt it when the
    batch is full or the pool is out of blocks.
    """

    name = "priority"
    preempts_for_priority = True

    def __init__(self, aging_steps: int = 512) -> None:
        if not isinstance(aging_steps, int) or aging_steps < 1:
            raise ValueError(f"aging_steps must be a positive integer, got {aging_steps!r}")
        self.aging_steps = aging_steps

    def sort_key(self, request: Request) -> tuple[float, int]:
        return (request.priority + request.arrival_step / self.aging_steps, request.seq_no)

    def starvation_bound(self, priority_gap: int) -> int:
        """Requests arriving more than this many steps after a request `priority_gap` levels
        below them no longer outrank it: only a finite set of arrivals can ever overtake it."""
        return priority_gap * self.aging_steps


POLICIES: dict[str, type[SchedulerPolicy]] = {"fcfs": FCFSPolicy, "priority": PriorityPolicy}


def make_policy(policy: str | SchedulerPolicy) -> SchedulerPolicy:
    """A policy from scheduling_policy: "fcfs", "priority" or a SchedulerPolicy instance."""
    if isinstance(policy, SchedulerPolicy):
        return policy
    if isinstance(policy, str) and policy in POLICIES:
        return POLICIES[policy]()
    raise ValueError(
        f"scheduling_policy must be one of {sorted(POLICIES)} or an instance of a jaxsched.core.policy.SchedulerPolicy "
        f"subclass (which defines sort_key(request)), got {policy!r}"
    )
