"""A model runner whose steps sleep instead of computing: what the cores around it cost, alone.

    core.runner = SleepingRunner(core.runner, prefill_s=2.0, decode_s=0.02)

A step with any prefill row (more than one new token) sleeps prefill_s, a decode-only step
decode_s; every row samples token `token`. Sleeping releases the GIL as a device does, so several
data-parallel cores with such runners show whether their loops wait for each other, without the
cores' real work competing for this machine's cores (scripts/bench_dp_independence.py, the data
parallel tests). The engine runs it synchronously: set async_scheduling=False.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from jaxsched.core.scheduler import SchedulerOutput
from jaxsched.runner.model_runner import InFlight, StepResult
from jaxsched.runner.sampler import SamplerOutput


class SleepingRunner:
    def __init__(self, real: Any, prefill_s: float, decode_s: float, token: int = 5) -> None:
        self.real = real  # kept for what the core reads besides a step (warm-up figures, the packer)
        self.packer = real.packer
        self.warmup_seconds = real.warmup_seconds
        self.max_logprobs = real.max_logprobs
        self.prefill_s = prefill_s
        self.decode_s = decode_s
        self.token = token
        self.steps: list[tuple[float, float, bool]] = []  # (start, end, prefill) of each step, perf_counter

    def dispatch(self, out: SchedulerOutput) -> InFlight:
        step = InFlight(out, time.monotonic(), S=len(out.scheduled))
        if out.scheduled:
            prefill = any(row.num_new_tokens > 1 for row in out.scheduled.values())
            t0 = time.perf_counter()
            time.sleep(self.prefill_s if prefill else self.decode_s)
            self.steps.append((t0, time.perf_counter(), prefill))
        return step

    def collect(self, step: InFlight) -> StepResult:
        S, k = step.S, self.max_logprobs
        sampled = SamplerOutput(sampled=np.full(S, self.token, np.int32), logprob=np.zeros(S, np.float32),
                                rank=np.ones(S, np.int32), top_ids=np.zeros((S, k), np.int32),
                                top_logprobs=np.zeros((S, k), np.float32))
        return StepResult(sampled, step.started, done=time.perf_counter() if S else 0.0)

    def recover_pool(self) -> None:
        pass
