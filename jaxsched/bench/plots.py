"""PNG plots of bench results, with matplotlib (an optional extra: pip install 'jaxsched[plot]'),
drawn off screen (the Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

INSTALL_HINT = "--plot needs matplotlib, which is not installed: pip install 'jaxsched[plot]'"


def require_matplotlib() -> None:
    """Fail before a benchmark runs, not after, when its plots cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(INSTALL_HINT) from None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, folder: str, name: str) -> Path:
    path = Path(folder) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def throughput(res: dict[str, Any], folder: str) -> list[Path]:
    """Bars per run (batching / overlap): output tokens/s, steps, and the share of idle seats."""
    plt = _pyplot()
    runs = res["runs"]
    one_overlap = len({r["overlap"] for r in runs}) == 1
    names = [r["batching"] if one_overlap else f"{r['batching']}\n(overlap {r['overlap']})" for r in runs]
    colors = ["tab:blue" if r["batching"] == "continuous" else "tab:orange" for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = (("output_throughput", "output tokens/s", 1), ("num_steps", "engine steps", 1),
              ("idle_seat_share", "idle seats (% of seat-steps)", 100))
    for ax, (key, title, scale) in zip(axes, panels):
        values = [r[key] * scale for r in runs]
        bars = ax.bar(names, values, color=colors)
        ax.bar_label(bars, fmt="%.1f" if scale == 100 or key == "output_throughput" else "%d")
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=8)
    ratio = res.get("continuous_over_static", {}).get("output_throughput")
    w = res["workload"]
    fig.suptitle(f"{w['name']} workload, {w['num_requests']} requests, {res['engine']['max_num_seqs']} seats"
                 + (f": continuous / static = {ratio}x" if ratio else ""))
    return [_save(fig, folder, "throughput_batching.png")]


def latency(res: dict[str, Any], folder: str) -> list[Path]:
    """The step times of the last iteration, prefill phase and decode steps."""
    plt = _pyplot()
    ms = res["last_iter_step_ms"]
    k = res["last_iter_prefill_steps"]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    ax.bar(range(k), ms[:k], color="tab:orange", label="prefill phase")
    ax.bar(range(k, len(ms)), ms[k:], color="tab:blue", label="decode")
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.legend()
    ax.set_title(f"batch {res['batch_size']} x ({res['input_len']} in, {res['output_len']} out): "
                 f"{res['avg_latency'] * 1e3:.0f} ms per batch")
    return [_save(fig, folder, "latency_steps.png")]


def scheduler(res: dict[str, Any], folder: str) -> list[Path]:
    """Per-step time of the scheduler alone (schedule + pack + update) against the request count."""
    plt = _pyplot()
    rs = res["results"]
    R = [r["R"] for r in rs]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, name in (("step_us_p50", "p50"), ("step_us_p99", "p99")):
        ax.plot(R, [r[key] / 1e3 for r in rs], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests (R)")
    ax.set_ylabel("ms per step")
    ax.set_title(f"scheduler step, policy {res['settings']['policy']}")
    ax.legend()
    ax.grid(alpha=0.3)
    return [_save(fig, folder, "scheduler_steps.png")]


def _runs_of(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return obj.get("sweep", [obj])


def _curves(res: dict[str, Any], key: str) -> list[tuple[str, np.ndarray]]:
    """(class, sorted seconds) per class of a serve result, 'all' when it has one class."""
    cls = res.get("request_classes") or []
    values = res.get(key) or []
    names = sorted(set(cls)) if len(set(cls)) > 1 else ["all"]
    out = []
    for name in names:
        xs = [v for v, c in zip(values, cls) if v is not None and (name == "all" or c == name)]
        if xs:
            out.append((name, np.sort(np.asarray(xs, dtype=float))))
    return out


def serve_cdf(res: dict[str, Any], compared: list[dict[str, Any]], folder: str, suffix: bool = False) -> list[Path]:
    """CDFs of TTFT and end-to-end latency per priority class, this run's and the compared runs'."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    runs = [(res, res.get("label") or "this run")]
    for j, c in enumerate(compared, 1):
        for r in _runs_of(c):
            label = r.get("label") or c.get("label") or f"compared {j}"
            runs.append((r, label + (f" @ {r['request_rate']} req/s" if "sweep" in c else "")))
    # a colour per class, a line style per run: one class under two servers reads side by side
    colors = {"high": "tab:red", "normal": "tab:blue", "all": "tab:gray"}
    styles = ["-", "--", ":", "-."]
    for i, (run, label) in enumerate(runs):
        for ax, key in zip(axes, ("ttfts", "e2els")):
            for cls, xs in _curves(run, key):
                ms = xs * 1e3
                ax.step(np.r_[ms[0], ms], np.arange(xs.size + 1) / xs.size, where="post",
                        color=colors.get(cls), linestyle=styles[i % len(styles)],
                        label=f"{label}: {cls} (median {np.median(ms):.0f} ms)")
    for ax, title in zip(axes, ("time to first token", "end-to-end latency")):
        ax.set_xlabel("ms")
        ax.set_ylabel("share of requests")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{res['num_prompts']} requests at {res['request_rate']} req/s, {res['endpoint']}")
    name = f"serve_latency_cdf_rate{res['request_rate']}.png" if suffix else "serve_latency_cdf.png"
    return [_save(fig, folder, name)]


def serve_sweep(results: list[dict[str, Any]], folder: str) -> list[Path]:
    """Output throughput and p99 TTFT (overall, and per class) against the request rate."""
    plt = _pyplot()
    x = np.arange(len(results))
    ticks = [str(r["request_rate"]) for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot(x, [r["output_throughput"] for r in results], marker="o")
    axes[0].set_ylabel("output tokens/s")
    axes[1].plot(x, [r["p99_ttft_ms"] or np.nan for r in results], marker="o", label="all")
    for cls in results[0].get("classes", {}):
        axes[1].plot(x, [r["classes"][cls]["p99_ttft_ms"] or np.nan for r in results], marker=".", linestyle="--",
                     label=cls)
    axes[1].set_ylabel("p99 TTFT (ms)")
    axes[1].legend()
    for ax, title in zip(axes, ("throughput", "p99 time to first token")):
        ax.set_xticks(x, ticks)
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    return [_save(fig, folder, "serve_sweep.png")]
