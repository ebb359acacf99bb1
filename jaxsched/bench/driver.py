"""Runs a workload through an engine, offline, and measures the run: continuous batching (every
request added at once; the scheduler refills a seat as soon as one frees) or static batching
(requests in arrival order, in batches of one per seat; a batch runs until all of its requests
finish, and nothing joins it), on the same engine, the same code and the same seat count.

Between steps it samples the engine's gauges (EngineStats): KV usage, and the requests running,
whose complement to the seat count is the idle seats of the step. Counters (steps, tokens,
padding, preemptions, step seconds, and any counter the engine adds later) are read as the
difference over the run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jaxsched.bench.workloads import BenchRequest
from jaxsched.core.request import SamplingParams
from jaxsched.core.stats import EngineStats

BATCHING = ("continuous", "static")
# EngineStats fields that are gauges (a value now), not counters (a total since start)
_GAUGES = frozenset({"num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc",
                     "last_step_padded_tokens", "kv_allocated_slots", "kv_internal_waste_slots"})


@dataclass(frozen=True)
class Run:
    """One measured run of a workload."""

    batching: str
    overlap: bool
    elapsed: float  # seconds, first request added to last one finished
    num_finished: int
    output_tokens: int
    prompt_tokens: int
    counters: dict[str, float]  # EngineStats counters over the run
    seats: int  # requests the engine runs at once (max_num_seqs, every replica)
    peak_kv_usage: float
    mean_kv_usage: float
    step_calls: int  # engine.step() calls (one step of every busy replica)
    running_request_steps: int  # sum over step() calls of the requests running after it
    # KV slots summed over step() calls: in blocks held by requests, and their unfilled tails
    kv_allocated_slot_steps: int = 0
    kv_waste_slot_steps: int = 0
    cost_errors: tuple[tuple[float, float], ...] = ()  # the step-cost model's (predicted, measured) seconds
    speculation: bool | None = None  # proposals made in the run (None: the engine has no speculative_config)

    @property
    def num_steps(self) -> int:
        return int(self.counters.get("num_steps", 0))

    @property
    def idle_seat_steps(self) -> int:
        """Seat-steps without a running request: a static batch's finished rows, or a drained queue."""
        return max(self.seats * self.step_calls - self.running_request_steps, 0)


def set_overlap(engine: Any, on: bool) -> None:
    """Overlapped scheduling on or off for the next steps (every core of the engine)."""
    engine.client.call_utility("set_async_scheduling", on)


def overlap_of(engine: Any) -> bool:
    return bool(engine.client.call_utility(lambda core: core.async_scheduling)[0])


def seats_of(engine: Any) -> int:
    return engine.scheduler_config.max_num_seqs * engine.client.num_cores


def counters(stats: EngineStats) -> dict[str, float]:
    return {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)
            if f.name not in _GAUGES and isinstance(getattr(stats, f.name), (int, float))}


def run(engine: Any, reqs: Sequence[BenchRequest], params: Sequence[SamplingParams], batching: str,
        max_steps: int | None = None) -> Run:
    """Run `reqs` to completion with `batching`, or for `max_steps` step() calls, after which the
    requests left are aborted (outside the measurement); the prefix cache is emptied first, so that
    a repeated workload is computed again rather than found in the cache."""
    if batching not in BATCHING:
        raise ValueError(f"batching must be one of {BATCHING}, got {batching!r}")
    engine.client.call_utility("reset_prefix_cache")
    engine.client.call_utility("keep_cost_errors")
    seats = seats_of(engine)
    # every request is validated before the clock starts and before any is added
    made = [engine.make_request(engine.next_request_id(), r.prompt, p) for r, p in zip(reqs, params)]
    batches = [made] if batching == "continuous" else [made[i:i + seats] for i in range(0, len(made), seats)]
    kv_peak = kv_sum = 0.0
    running = samples = finished = out_tokens = prompt_tokens = allocated = waste = 0
    before = engine.stats()
    t0 = time.perf_counter()
    pending: set[str] = set()
    for batch in batches:
        for req in batch:
            engine.add_request_obj(req)
        pending = {r.request_id for r in batch}
        while pending and samples != max_steps:
            for o in engine.step():
                if o.finished and o.request_id in pending:
                    pending.discard(o.request_id)
                    finished += 1
                    out_tokens += len(o.outputs[0].token_ids)
                    prompt_tokens += len(o.prompt_token_ids)
            s = engine.stats()
            kv_peak = max(kv_peak, s.kv_cache_usage_perc)
            kv_sum += s.kv_cache_usage_perc
            running += s.num_requests_running
            allocated += s.kv_allocated_slots
            waste += s.kv_internal_waste_slots
            samples += 1
        if samples == max_steps:
            break
    elapsed = time.perf_counter() - t0
    after = engine.stats()
    if pending:  # stopped at max_steps: end the rest, and read the step still in flight
        engine.abort_request(list(pending))
        while engine.has_unfinished_requests():
            engine.step()
    c0 = counters(before)
    delta = {k: v - c0.get(k, 0) for k, v in counters(after).items()}
    errors = tuple(tuple(x) for each in engine.client.call_utility("take_cost_errors") for x in each)
    return Run(batching=batching, overlap=overlap_of(engine), elapsed=elapsed, num_finished=finished,
               output_tokens=out_tokens, prompt_tokens=prompt_tokens, counters=delta, seats=seats,
               peak_kv_usage=kv_peak, mean_kv_usage=kv_sum / max(samples, 1), step_calls=samples,
               running_request_steps=running, kv_allocated_slot_steps=allocated, kv_waste_slot_steps=waste,
               cost_errors=errors)
