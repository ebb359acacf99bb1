"""Scheduling policies: which request goes first. Plain Python: no jax, no clocks.

A policy orders requests; the scheduler serves running requests in that order, admits waiting and
swapped ones in that order, and preempts from the end of it. Any object with
`prioritize(requests) -> ordered list` is a policy (the SchedulerPolicy protocol), so users can plug
in their own rule; the scheduler calls it once per step on each queue.

The built-in policies also expose `sort_key(request)`, a key that never changes while a request
lives. With it the scheduler keeps its queues sorted by insertion instead of re-sorting them every
step, which is what keeps a step under a millisecond with thousands of requests waiting.

Aging without clocks: PriorityPolicy's key is priority + arrival_step / aging_steps. Between two
requests waiting at the same time the step count cancels out, so the key is static, and a request
of priority p is overtaken only by requests whose key is smaller: requests of priority p - d that
arrived less than d * aging_steps steps after it. That bounds how long any request can starve.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from jaxsched.request import Request


@runtime_checkable
class SchedulerPolicy(Protocol):
    """Orders requests, most urgent first."""

    def prioritize(self, requests: Sequence[Request]) -> list[Request]: ...


class FCFSPolicy:
    """First come, first served: arrival order."""

    name = "fcfs"
    preempts_for_priority = False

    @staticmethod
    def sort_key(request: Request) -> tuple[float, int]:
        return (0.0, request.seq_no)

    def prioritize(self, requests: Sequence[Request]) -> list[Request]:
        return sorted(requests, key=self.sort_key)


class PriorityPolicy:
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

    def prioritize(self, requests: Sequence[Request]) -> list[Request]:
        return sorted(requests, key=self.sort_key)


def make_policy(policy: str | SchedulerPolicy) -> SchedulerPolicy:
    """A policy from scheduling_policy: "fcfs", "priority" or an instance."""
    if isinstance(policy, str):
        if policy == "fcfs":
            return FCFSPolicy()
        if policy == "priority":
            return PriorityPolicy()
        raise ValueError(f"scheduling_policy must be 'fcfs', 'priority' or a SchedulerPolicy, got {policy!r}")
    if not callable(getattr(policy, "prioritize", None)):
        raise ValueError(  # noqa: TRY004 - a bad engine argument is a ValueError throughout
            f"scheduling_policy {policy!r} has no prioritize(requests) method; subclass "
            "jaxsched.policy.SchedulerPolicy or pass 'fcfs' / 'priority'"
        )
    return policy
