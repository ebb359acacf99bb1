"""What a jax.profiler trace of a benchmark run says about the device and the host: the time the
device's streams were busy (the union of their kernels and copies), its busiest kernels, and the
host's busiest traced regions (XLA's and the runtime's TraceMe names: executing a program, launching
a CUDA graph, copying). Timings of the host around its calls can only say how long the host was
blocked; this says how long the device worked, which is the figure the GPU idle share needs.

Read with jax.profiler.ProfileData (no TensorBoard). A CPU trace has no device plane: busy figures
are then None and the host regions are still reported.
"""

from __future__ import annotations

import glob
import os
from collections import Counter
from typing import Any

# lines of a device plane that XLA derives from the stream lines (they repeat their time)
_DERIVED = ("XLA Modules", "XLA Ops", "Steps", "Framework Ops", "Framework Name Scope", "Source", "XLA TraceMe")


def _stream_lines(lines: list[Any]) -> list[Any]:
    """The lines of a device plane whose events are the device's own work: CUPTI's stream lines
    ("Stream #7(Compute)", "Stream #14(MemcpyH2D)"). A plane without such names (another runtime)
    falls back to every line but the ones XLA derives from the streams."""
    streams = [line for line in lines if line.name.startswith("Stream")]
    return streams or [line for line in lines if line.name not in _DERIVED]


def newest_trace(trace_dir: str) -> str | None:
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    return max(files, key=os.path.getmtime) if files else None


def union_ns(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def summary(trace_dir: str, steps: int, top: int = 12) -> dict[str, Any]:
    """Figures of the newest trace under `trace_dir`, over a run of `steps` engine steps."""
    from jax.profiler import ProfileData

    path = newest_trace(trace_dir)
    if path is None:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}: did jax.profiler.trace write there?")
    return summarize(ProfileData.from_file(path).planes, steps, top) | {"file": path}


def summarize(planes: Any, steps: int, top: int = 12) -> dict[str, Any]:
    """summary()'s figures from a trace's planes (objects with .name and .lines; lines with .name
    and .events; events with .name, .start_ns, .duration_ns)."""
    steps = max(steps, 1)
    intervals: list[tuple[float, float]] = []
    kernels: Counter[str] = Counter()
    host: Counter[str] = Counter()
    device_lines: list[str] = []
    counted: list[str] = []
    for plane in planes:
        if plane.name.startswith("/device:") and "CPU" not in plane.name:
            lines = list(plane.lines)
            device_lines += [line.name for line in lines]
            for line in _stream_lines(lines):
                counted.append(line.name)
                for ev in line.events:
                    intervals.append((ev.start_ns, ev.start_ns + ev.duration_ns))
                    kernels[ev.name[:80]] += ev.duration_ns
        elif plane.name.startswith("/host:CPU"):
            for line in plane.lines:
                if line.name == "python":  # the interpreter's own frames: py-spy's business
                    continue
                for ev in line.events:
                    host[ev.name[:80]] += ev.duration_ns
    res: dict[str, Any] = {"steps": steps, "device_lines": sorted(set(device_lines)),
                           "device_lines_counted": sorted(set(counted))}
    if intervals:
        window = max(e for _, e in intervals) - min(s for s, _ in intervals)
        busy = union_ns(intervals)
        res |= {"device_busy_ms_per_step": round(busy / steps / 1e6, 4),
                "device_window_ms_per_step": round(window / steps / 1e6, 4),
                "device_busy_share_of_window": round(busy / window, 4) if window else None,
                "top_device_ms_per_step": {k: round(v / steps / 1e6, 4) for k, v in kernels.most_common(top)}}
    else:
        res |= {"device_busy_ms_per_step": None, "device_window_ms_per_step": None,
                "device_busy_share_of_window": None, "top_device_ms_per_step": {}}
    res["top_host_ms_per_step"] = {k: round(v / steps / 1e6, 4) for k, v in host.most_common(top)}
    return res
