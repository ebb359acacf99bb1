"""Prometheus metrics in the text exposition format (0.0.4), named as vLLM's with a `jaxsched:` prefix.

Three tiny metric types instead of a prometheus_client dependency: they are observed on the engine
thread and rendered on the server's event loop, so each holds a lock. Every sample carries a
`model_name` label, as vLLM's do, added when rendering.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence
from typing import Any

PREFIX = "jaxsched:"


def _fmt(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    esc = {k: str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for k, v in labels.items()}
    return "{" + ",".join(f'{k}="{v}"' for k, v in esc.items()) + "}"


class _Metric:
    kind = ""

    def __init__(self, name: str, help_: str, label_names: Sequence[str] = ()) -> None:
        self.name = PREFIX + name
        self.help = help_
        self.label_names = tuple(label_names)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.label_names):
            raise ValueError(f"{self.name} takes labels {self.label_names}, got {sorted(labels)}")
        return tuple(str(labels[k]) for k in self.label_names)

    def header(self, name: str) -> list[str]:
        return [f"# HELP {name} {self.help}", f"# TYPE {name} {self.kind}"]


class Counter(_Metric):
    """A monotonic count; rendered with the `_total` suffix, as Prometheus clients do."""

    kind = "counter"

    def __init__(self, name: str, help_: str, label_names: Sequence[str] = ()) -> None:
        super().__init__(name, help_, label_names)
        self._values: dict[tuple[str, ...], float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name} can only go up, got {amount}")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def set_total(self, value: float, **labels: str) -> None:
        """Mirror a count kept elsewhere (e.g. the scheduler's preemptions), never moving it down."""
        key = self._key(labels)
        with self._lock:
            self._values[key] = max(self._values.get(key, 0.0), float(value))

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def render(self, extra: dict[str, str]) -> list[str]:
        name = self.name + "_total"
        with self._lock:
            items = sorted(self._values.items()) or ([((), 0.0)] if not self.label_names else [])
        lines = self.header(name)
        for key, v in items:
            lines.append(f"{name}{_labels({**extra, **dict(zip(self.label_names, key))})} {_fmt(v)}")
        return lines


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name: str, help_: str) -> None:
        super().__init__(name, help_)
        self._value = 0.0

    def set(self, value: float) -> None:
        with self._lock:
            self._value = float(value)

    def render(self, extra: dict[str, str]) -> list[str]:
        with self._lock:
            v = self._value
        return [*self.header(self.name), f"{self.name}{_labels(extra)} {_fmt(v)}"]


class Histogram(_Metric):
    """Cumulative buckets (`le`), `_sum` and `_count`, as Prometheus histograms are exposed."""

    kind = "histogram"

    def __init__(self, name: str, help_: str, buckets: Sequence[float]) -> None:
        super().__init__(name, help_)
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self._sum = 0.0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)  # `le` buckets: value <= bound
        with self._lock:
            self._counts[i] += 1
            self._sum += value

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._counts)

    def render(self, extra: dict[str, str]) -> list[str]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        lines = self.header(self.name)
        acc = 0
        for bound, c in zip((*self.buckets, math.inf), counts):
            acc += c
            lines.append(f"{self.name}_bucket{_labels({**extra, 'le': _fmt(bound)})} {acc}")
        lines.append(f"{self.name}_sum{_labels(extra)} {_fmt(total)}")
        lines.append(f"{self.name}_count{_labels(extra)} {acc}")
        return lines


_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class EngineMetrics:
    """The metrics the AsyncEngine records (vLLM's names, `jaxsched:` prefix)."""

    def __init__(self) -> None:
        self.time_to_first_token = Histogram("time_to_first_token_seconds", "Time to first token.", _TTFT)
        self.inter_token_latency = Histogram("inter_token_latency_seconds", "Time between output tokens.", _ITL)
        self.e2e_request_latency = Histogram("e2e_request_latency_seconds", "End-to-end request latency.", _E2E)
        self.request_queue_time = Histogram("request_queue_time_seconds",
                                            "Time from arrival to first scheduling.", _E2E)
        self.num_requests_running = Gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = Gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_requests_swapped = Gauge("num_requests_swapped", "Requests swapped out to host memory.")
        self.kv_cache_usage_perc = Gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).")
        self.num_preemptions = Counter("num_preemptions", "Preemptions since start.")
        self.prompt_tokens = Counter("prompt_tokens", "Prompt tokens of requests that produced output.")
        self.generation_tokens = Counter("generation_tokens", "Generated tokens.")
        self.request_success = Counter("request_success", "Requests that finished (not aborted).",
                                       ("finished_reason",))

    def observe(self, out: Any, arrival_time: float, prev_tokens: int, prev_token_time: float, now: float) -> int:
        """Record one cumulative RequestOutput of a request, given what its previous one had (tokens,
        time of the last new token). Returns its token count. Runs on the engine thread."""
        n = sum(len(c.token_ids) for c in out.outputs)
        if n > prev_tokens:
            if prev_tokens == 0:
                self.time_to_first_token.observe(now - arrival_time)
                self.prompt_tokens.inc(len(out.prompt_token_ids))
            else:
                self.inter_token_latency.observe(now - prev_token_time)
            self.generation_tokens.inc(n - prev_tokens)
        if out.finished:
            self.e2e_request_latency.observe(now - arrival_time)
            if out.metrics is not None and out.metrics.first_scheduled_time:
                self.request_queue_time.observe(max(0.0, out.metrics.first_scheduled_time - arrival_time))
            reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "stop")
            if reason not in ("abort", "error"):
                self.request_success.inc(finished_reason=reason)
        return n

    def all(self) -> list[_Metric]:
        return [m for m in vars(self).values() if isinstance(m, _Metric)]

    def render(self, **labels: str) -> str:
        lines: list[str] = []
        for m in self.all():
            lines += m.render(labels)
        return "\n".join(lines) + "\n"
