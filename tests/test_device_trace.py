"""device_trace reads a profiler trace's device plane: busy time is the union of the stream lines'
events (overlaps counted once, XLA's derived lines left out), the host's regions leave out the
interpreter's own line, and a trace without a device plane says so instead of inventing figures."""

from __future__ import annotations

import pytest
from jax.profiler import ProfileData

from jaxsched.bench import device_trace


def _line(name: str, events: list[tuple[int, int, int]]) -> str:
    # events: (metadata id, start us, duration us); XPlane offsets are in picoseconds
    evs = " ".join(f"events {{ metadata_id: {m} offset_ps: {s * 10**6} duration_ps: {d * 10**6} }}"
                   for m, s, d in events)
    return f'lines {{ name: "{name}" timestamp_ns: 0 {evs} }}'


def _plane(name: str, lines: list[str], names: dict[int, str]) -> str:
    meta = " ".join(f'event_metadata {{ key: {k} value {{ id: {k} name: "{v}" }} }}' for k, v in names.items())
    return f'planes {{ name: "{name}" {" ".join(lines)} {meta} }}'


def _write(tmp_path, planes: list[str]) -> None:
    run = tmp_path / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    (run / "host.xplane.pb").write_bytes(ProfileData.text_proto_to_serialized_xspace(" ".join(planes)))


def test_union_counts_overlaps_once():
    assert device_trace.union_ns([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert device_trace.union_ns([]) == 0


def test_summary_of_a_gpu_trace(tmp_path):
    names = {1: "gemm", 2: "attention", 3: "step_module"}
    gpu = _plane("/device:GPU:0", [
        _line("Stream #13(Compute)", [(1, 0, 400), (2, 400, 100), (1, 900, 100)]),
        _line("Stream #14(MemcpyH2D)", [(2, 450, 100)]),  # overlaps the first stream: once
        _line("XLA Modules", [(3, 0, 1000)]),  # derived from the streams: not counted again
    ], names)
    host = _plane("/host:CPU", [
        _line("python", [(1, 0, 5000)]),  # the interpreter's frames: left out
        _line("pjrt thread", [(2, 0, 300), (2, 500, 100)]),
    ], names)
    _write(tmp_path, [gpu, host])
    s = device_trace.summary(str(tmp_path), steps=2)
    # busy: [0, 550) and [900, 1000) = 650 us over 2 steps; window [0, 1000)
    assert s["device_busy_ms_per_step"] == pytest.approx(0.325)
    assert s["device_window_ms_per_step"] == pytest.approx(0.5)
    assert s["device_busy_share_of_window"] == pytest.approx(0.65)
    assert s["top_device_ms_per_step"] == {"gemm": pytest.approx(0.25), "attention": pytest.approx(0.1)}
    assert s["top_host_ms_per_step"] == {"attention": pytest.approx(0.2)}
    assert "XLA Modules" in s["device_lines"]


def test_summary_without_a_device_plane(tmp_path):
    _write(tmp_path, [_plane("/host:CPU", [_line("worker", [(1, 0, 10)])], {1: "ThunkExecutor::Execute"})])
    s = device_trace.summary(str(tmp_path), steps=1)
    assert s["device_busy_ms_per_step"] is None and s["top_device_ms_per_step"] == {}
    assert s["top_host_ms_per_step"] == {"ThunkExecutor::Execute": pytest.approx(0.01)}


def test_summary_says_where_it_looked(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.xplane.pb under"):
        device_trace.summary(str(tmp_path), steps=1)


def test_only_the_stream_lines_count_as_the_devices_work(tmp_path):
    """A device plane's other lines (launch statistics, derived views of any name) are not the
    device's work: with stream lines present, only they count."""
    names = {1: "gemm", 2: "launch"}
    gpu = _plane("/device:GPU:0", [
        _line("Stream #13(Compute)", [(1, 0, 400)]),
        _line("Kernel Launch Stats", [(2, 1000, 500)]),  # would add 500 us and stretch the window
    ], names)
    _write(tmp_path, [gpu])
    s = device_trace.summary(str(tmp_path), steps=1)
    assert s["device_busy_ms_per_step"] == pytest.approx(0.4) and s["device_window_ms_per_step"] == pytest.approx(0.4)
    assert s["device_lines_counted"] == ["Stream #13(Compute)"]
    assert set(s["device_lines"]) == {"Stream #13(Compute)", "Kernel Launch Stats"}
