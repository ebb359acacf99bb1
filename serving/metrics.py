"""Prometheus metrics, named as vLLM's with a `jaxsched:` prefix, on prometheus_client.

Each AsyncEngine has its own CollectorRegistry (a process may hold several engines: tests build many),
observed on the front end's output thread and rendered on the server's event loop; prometheus_client's metrics
are thread-safe. Every sample carries a `model_name` label, as vLLM's do, added when rendering: the
served name is the app's to choose, after the engine is built.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from jaxsched.core.stats import HOST_PHASES, EngineStats
from jaxsched.runner.memory_report import MemoryReport

PREFIX = "jaxsched:"

_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_STEP_HOST = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class EngineMetrics:
    """The metrics the AsyncEngine records: request latencies and token counts from its outputs,
    the gauges and the preemption count from the engine's EngineStats."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, registry=self.registry)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry)

        self.time_to_first_token = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between output tokens.", _ITL)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "End-to-end request latency.", _E2E)
        self.request_queue_time = histogram("request_queue_time_seconds", "Time from arrival to first scheduling.",
                                            _E2E)
        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_requests_swapped = gauge("num_requests_swapped", "Requests swapped out to host memory.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).")
        self.num_preemptions = counter("num_preemptions", "Preemptions since start.")
        # the engine thread's time in steps, and the part of it spent waiting for the device: against
        # wall time, what the server path (commands, streams, the event loop) costs beside the steps
        self.engine_step_seconds = counter("engine_step_seconds", "Seconds the engine thread spent in steps.")
        self.engine_device_wait_seconds = counter("engine_device_wait_seconds",
                                                  "Seconds of the steps spent waiting for the device.")
        # the host's part of the steps by phase, and per step: "scheduling overhead as a share of the
        # step" is engine_host_seconds{phase="schedule"} / engine_step_seconds
        self.engine_host_seconds = counter("engine_host_seconds", "Seconds of the steps spent on the host, by phase "
                                           f"({', '.join(HOST_PHASES)}).", ("phase",))
        self.engine_step_host_seconds = histogram("engine_step_host_seconds",
                                                  "Host seconds of a step (its wall time less the device wait).",
                                                  _STEP_HOST)
        self.kv_cache_internal_waste_perc = gauge(
            "kv_cache_internal_waste_perc", "Share of allocated KV slots holding no token (last blocks' tails).")
        self.kv_cache_external_fragmentation_perc = gauge(
            "kv_cache_external_fragmentation_perc",
            "Free KV blocks no request could use: 0 by construction (one page size, pages need not be contiguous).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that produced output.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.request_success = counter("request_success", "Requests that finished (not aborted).",
                                       ("finished_reason",))
        self.request_timeouts = counter("request_timeouts", "Requests ended by a deadline: their own `timeout` "
                                        "(kind deadline), or --queue-timeout before they started (kind queue).",
                                        ("kind",))
        self.cache_config_info = Gauge(
            PREFIX + "cache_config_info", "The KV pool as configured (value 1; the figures are labels), per device "
            "of one engine: every device holds every block, with its share of the KV heads.",
            ("block_size", "num_gpu_blocks", "kv_bytes_per_device", "num_kv_heads_per_device", "tensor_parallel_size",
             "data_parallel_size"), registry=self.registry)
        self.memory_bytes = Gauge(
            PREFIX + "memory_bytes", "Where one device's memory went at start, by kind: weights, kv_pool, swap (host "
            "memory), workspace (the largest step program's temporaries), budget (gpu_memory_utilization of the "
            "device) and what it leaves.", ("kind",), registry=self.registry)
        # speculative decoding (vLLM's names): rows that verified proposals, proposals verified,
        # those kept, and those kept by position (the mean accepted length is 1 + accepted / drafts)
        self.spec_counters = {name: counter(name, doc) for name, doc in (
            ("spec_decode_num_drafts", "Rows that verified proposed tokens (speculative decoding)."),
            ("spec_decode_num_draft_tokens", "Proposed tokens verified."),
            ("spec_decode_num_accepted_tokens", "Proposed tokens kept."))}
        self.spec_decode_num_accepted_tokens_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Proposed tokens kept, by their position in the proposal "
            "(0 first).", ("position",))
        self._spec_seen: dict[str, int] = dict.fromkeys(self.spec_counters, 0)
        self._spec_pos_seen: list[int] = []
        self._preemptions_seen = 0
        self._seconds_seen = (0.0, 0.0)
        self._phases_seen = dict.fromkeys(HOST_PHASES, 0.0)
        self._steps_seen = 0

    def describe_cache(self, block_size: int, num_blocks: int, bytes_per_device: int, kv_heads_per_device: int,
                       tensor_parallel_size: int, data_parallel_size: int) -> None:
        """Set cache_config_info (vLLM's name) once, from the engine's resolved config."""
        self.cache_config_info.labels(str(block_size), str(num_blocks), str(bytes_per_device),
                                      str(kv_heads_per_device), str(tensor_parallel_size),
                                      str(data_parallel_size)).set(1)

    def describe_memory(self, report: MemoryReport) -> None:
        """Set memory_bytes once, from the engine's start-up report."""
        for kind, value in report.bytes_by_kind().items():
            self.memory_bytes.labels(kind).set(value)

    def publish(self, stats: EngineStats) -> None:
        """Set the gauges from the engine's figures. The scheduler counts preemptions itself; the
        counter follows it by the difference (a prometheus_client Counter cannot be set)."""
        self.num_requests_running.set(stats.num_requests_running)
        self.num_requests_waiting.set(stats.num_requests_waiting)
        self.num_requests_swapped.set(stats.num_requests_swapped)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage_perc)
        self.kv_cache_internal_waste_perc.set(stats.kv_internal_waste_perc)
        self.kv_cache_external_fragmentation_perc.set(stats.kv_external_fragmentation_perc)
        for phase in HOST_PHASES:
            now = getattr(stats, f"{phase}_seconds")
            if now > self._phases_seen[phase]:
                self.engine_host_seconds.labels(phase=phase).inc(now - self._phases_seen[phase])
                self._phases_seen[phase] = now
        for name, c in self.spec_counters.items():
            now = getattr(stats, name)
            if now > self._spec_seen[name]:
                c.inc(now - self._spec_seen[name])
                self._spec_seen[name] = now
        per_pos = stats.spec_decode_num_accepted_tokens_per_pos
        self._spec_pos_seen += [0] * (len(per_pos) - len(self._spec_pos_seen))
        for j, now in enumerate(per_pos):
            if now > self._spec_pos_seen[j]:
                self.spec_decode_num_accepted_tokens_per_pos.labels(position=str(j)).inc(now - self._spec_pos_seen[j])
                self._spec_pos_seen[j] = now
        if stats.num_preemptions > self._preemptions_seen:
            self.num_preemptions.inc(stats.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = stats.num_preemptions
        step, device = self._seconds_seen
        if stats.num_steps > self._steps_seen and stats.step_seconds > step:  # published after every step
            host = max(0.0, (stats.step_seconds - step) - (stats.device_seconds - device))
            self.engine_step_host_seconds.observe(host / (stats.num_steps - self._steps_seen))
        self._steps_seen = max(self._steps_seen, stats.num_steps)
        if stats.step_seconds > step:
            self.engine_step_seconds.inc(stats.step_seconds - step)
        if stats.device_seconds > device:
            self.engine_device_wait_seconds.inc(stats.device_seconds - device)
        self._seconds_seen = (max(step, stats.step_seconds), max(device, stats.device_seconds))

    def observe_tokens(self, new_tokens: int, prompt_tokens: int, arrival_time: float, prev_tokens: int,
                       prev_token_time: float, now: float) -> None:
        """A request got new_tokens (over all its samples) at `now`, having had prev_tokens, the
        last of them at prev_token_time. Runs on the front end's output thread."""
        if new_tokens <= 0:
            return
        if prev_tokens == 0:
            self.time_to_first_token.observe(now - arrival_time)
            self.prompt_tokens.inc(prompt_tokens)
        else:
            self.inter_token_latency.observe(now - prev_token_time)
        self.generation_tokens.inc(new_tokens)

    def observe_finished(self, out: Any, arrival_time: float, now: float) -> None:
        """A request's final RequestOutput."""
        self.e2e_request_latency.observe(now - arrival_time)
        if out.metrics is not None and out.metrics.first_scheduled_time:
            self.request_queue_time.observe(max(0.0, out.metrics.first_scheduled_time - arrival_time))
        reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "stop")
        if reason in ("timeout", "queue_timeout"):
            self.request_timeouts.labels(kind="deadline" if reason == "timeout" else "queue").inc()
        elif reason not in ("abort", "error"):
            self.request_success.labels(finished_reason=reason).inc()

    def value(self, name: str, **labels: str) -> float:
        """One sample's value by its exposed name without the prefix (e.g. "request_success_total"),
        0 if it has none yet."""
        return self.registry.get_sample_value(PREFIX + name, labels) or 0.0

    def render(self, **labels: str) -> bytes:
        """The text exposition (prometheus_client.CONTENT_TYPE_LATEST), `labels` added to every sample."""
        return generate_latest(_Labelled(self.registry, labels))


class _Labelled:
    """A registry's metrics with constant labels added to each sample, and without the `_created`
    timestamps prometheus_client adds to counters and histograms (series this server never exposed)."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.registry = registry
        self.labels = labels

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={**self.labels, **s.labels}) for s in family.samples
                           if not s.name.endswith("_created")]
            yield out
