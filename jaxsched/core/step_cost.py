"""Execution prediction: what a step of a given shape costs, so the scheduler can choose between
candidate batches by predicted time (scheduler._choose_by_cost: how far to trim a step's prefill
chunks, and whether to defer decode rows one step).

A step's shape is its (T, S) bucket pair, which fixes the compiled program and so the matmul work,
plus the KV context its attention reads (the sum of every row's sequence length after the step). Per
pair the cost is linear in the context:

    seconds = a[T, S] + b[T, S] * context,    b >= 0

fitted by exponentially weighted least squares, so the fit follows drift (clocks, thermal, other
tenants) instead of averaging over the whole run. A pair with no data yet is predicted from the
others: a[T, S] ~ c0 + c1 * T + c2 * S (c1, c2 >= 0) over the fitted pairs, b = the pooled slope.
Predictions are then made non-decreasing in T at a fixed S and context, because the scheduler
assumes a bigger bucket never costs less.

The model is an input to the scheduler, not something the scheduler measures: scheduler.py reads no
clocks, so a recorded trace replays to the same decisions. The engine times steps and feeds
observe(); the scheduler only reads predict(). A replay that feeds the same seeds and observations
(or loads a table saved with to_table) decides the same, and with several hosts process 0 sends
its seeds and each step's observations with the step's operations (distributed.py), so every host
predicts, and so decides, the same. For that the arithmetic is plain Python floats in a fixed
order (no BLAS, whose summation order may differ between builds): the same observations in the
same order give bit-identical predictions on any host. No jax, no clocks, no randomness here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SEED_WEIGHT = 1.0  # a warm-up timing weighs as one observation; forgetting makes real ones dominate
REL_SPREAD = 1e-4  # contexts closer than this (relative std) cannot separate a from b
WITHIN = 0.15  # error_report's "close enough" share
TABLE_VERSION = 2  # 2: pairs [T, S, width, ...]; 1 had no width (read as width 1)


@dataclass(frozen=True)
class StepShape:
    """What a candidate step is."""

    T: int  # token bucket
    S: int  # sequence bucket
    context: int  # KV tokens attention reads: sum of every row's sequence length after the step
    width: int = 1  # Q: positions each row's logits are taken at (speculative decoding verifies Q - 1 proposals)


def _check_seconds(seconds: float) -> float:
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"step time must be a finite number of seconds >= 0, got {seconds!r}")
    return float(seconds)


def _slope(st: list[float]) -> float | None:
    """The weighted least-squares slope of one pair, or None when its contexts barely differ."""
    sw, sx, sxx, sy, sxy = st
    mx = sx / sw
    var = sxx / sw - mx * mx  # weighted variance of the contexts (tokens^2)
    if var <= 0 or var <= (REL_SPREAD * mx) ** 2:  # also rules out cancellation noise
        return None
    return max((sxy / sw - mx * sy / sw) / var, 0.0)  # b < 0 is noise: clip, then a = mean y


def _fit_intercepts(points: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Least squares a ~ c0 + c1 * T + c2 * S over the fitted pairs, with c1, c2 >= 0 (a bigger
    bucket does not run faster); drops a variable that is constant, collinear or of negative slope."""
    if not points:
        return 0.0, 0.0, 0.0
    n = len(points)
    mt, ms, ma = (sum(p[i] for p in points) / n for i in range(3))
    stt = sum((t - mt) ** 2 for t, _, _ in points)
    sss = sum((s - ms) ** 2 for _, s, _ in points)
    sts = sum((t - mt) * (s - ms) for t, s, _ in points)
    sta = sum((t - mt) * (a - ma) for t, _, a in points)
    ssa = sum((s - ms) * (a - ma) for _, s, a in points)
    det = stt * sss - sts * sts
    if det > 1e-9 * stt * sss:  # T and S vary independently over the fitted pairs
        c1, c2 = (sta * sss - ssa * sts) / det, (ssa * stt - sta * sts) / det
        if c1 >= 0 and c2 >= 0:
            return ma - c1 * mt - c2 * ms, c1, c2
    # one variable: the one whose fit removes more of the squared error (slope * covariance)
    c1 = max(sta / stt, 0.0) if stt > 0 else 0.0
    c2 = max(ssa / sss, 0.0) if sss > 0 else 0.0
    if c1 * sta >= c2 * ssa:
        return ma - c1 * mt, c1, 0.0
    return ma - c2 * ms, 0.0, c2


class StepCostModel:
    """Per (T, S) pair and width (the programs of speculative steps, which take each row's logits
    at `width` positions, are apart: their lm_head and sampler do more), the weighted sufficient
    statistics [sum w, sum w*x, sum w*x^2, sum w*y, sum w*x*y] of x = context (tokens) and y = step
    time (seconds). Widths are fitted apart."""

    def __init__(self, pairs: Sequence[tuple[int, int]], forgetting: float = 0.98, widths: Sequence[int] = (1,)):
        if not 0 < forgetting <= 1:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting!r}")
        if not pairs:
            raise ValueError("StepCostModel needs the compiled (T, S) bucket pairs, got none")
        self.forgetting = float(forgetting)
        self._stats: dict[tuple[int, int, int], list[float]] = {
            (int(t), int(s), int(q)): [0.0] * 5 for q in widths for t, s in pairs}
        self._ts_by_s: dict[tuple[int, int], list[int]] = {}  # (S, width) -> its T buckets, ascending
        for t, s, q in sorted(self._stats):
            self._ts_by_s.setdefault((s, q), []).append(t)
        self._lines: dict[tuple[int, int, int], tuple[float, float]] | None = None  # fitted (a, b), lazily

    @property
    def pairs(self) -> list[tuple[int, int]]:
        """The (T, S) bucket pairs this model predicts."""
        return list(dict.fromkeys((t, s) for t, s, _ in self._stats))

    @property
    def widths(self) -> list[int]:
        return sorted({q for _, _, q in self._stats})

    def _pair(self, T: int, S: int, width: int = 1) -> list[float]:
        st = self._stats.get((T, S, width))
        if st is None:
            at = f" at width {width}" if width != 1 else ""
            raise ValueError(f"(T={T}, S={S}) is not a compiled bucket pair of this model{at}")
        return st

    def _add(self, T: int, S: int, x: float, y: float, w: float, forget: float, width: int = 1) -> None:
        st = self._pair(T, S, width)
        st[:] = [forget * st[0] + w, forget * st[1] + w * x, forget * st[2] + w * x * x,
                 forget * st[3] + w * y, forget * st[4] + w * x * y]
        self._lines = None

    def observe(self, shape: StepShape, seconds: float) -> None:
        """One measured step; older observations of its pair lose weight by `forgetting`."""
        if shape.context < 0:
            raise ValueError(f"context must be >= 0 tokens, got {shape.context}")
        self._add(shape.T, shape.S, float(shape.context), _check_seconds(seconds), 1.0, self.forgetting, shape.width)

    def seed(self, T: int, S: int, seconds: float, width: int = 1) -> None:
        """Cold start: the warm-up timing of a step of (T, S) made of padding only (runner.time_pairs),
        so context = 0. A weak observation that does not age the others."""
        self._add(T, S, 0.0, _check_seconds(seconds), SEED_WEIGHT, 1.0, width)

    def known(self, T: int, S: int, width: int = 1) -> bool:
        st = self._stats.get((T, S, width))
        return st is not None and st[0] > 0

    def _fitted(self) -> dict[tuple[int, int], tuple[float, float]]:
        if self._lines is not None:
            return self._lines
        known = {p: st for p, st in self._stats.items() if st[0] > 0}
        slopes = {p: _slope(st) for p, st in known.items()}
        # pooled slope: for pairs whose contexts barely vary, and for pairs without data
        num = sum(known[p][0] * b for p, b in slopes.items() if b is not None)
        den = sum(known[p][0] for p, b in slopes.items() if b is not None)
        pooled = num / den if den > 0 else 0.0
        lines = {}
        for p, st in known.items():
            b = pooled if slopes[p] is None else slopes[p]
            lines[p] = (st[3] / st[0] - b * st[1] / st[0], b)  # a = mean y - b * mean x
        for q in self.widths:  # each width's pairs without data, from that width's fitted ones
            c0, c1, c2 = _fit_intercepts([(t, s, a) for (t, s, w), (a, _) in lines.items() if w == q])
            for t, s, w in self._stats:
                if w == q and (t, s, w) not in lines:
                    lines[t, s, w] = (c0 + c1 * t + c2 * s, pooled)
        self._lines = lines
        return lines

    def predict(self, shape: StepShape) -> float:
        """Predicted seconds: the max over this S's pairs of T' <= T (monotone in T), at least 0.
        With no data at all every step predicts 0.0, so no candidate is preferred."""
        self._pair(shape.T, shape.S, shape.width)
        lines = self._fitted()
        best = 0.0
        for t in self._ts_by_s[shape.S, shape.width]:
            if t > shape.T:
                break
            a, b = lines[t, shape.S, shape.width]
            best = max(best, a + b * shape.context)
        return best

    def to_table(self) -> dict:
        """JSON-serialisable state; JSON keeps Python floats exactly, so from_table predicts the same."""
        return {"version": TABLE_VERSION, "forgetting": self.forgetting,
                "pairs": [[t, s, q, *st] for (t, s, q), st in self._stats.items()]}

    @classmethod
    def from_table(cls, table: dict) -> StepCostModel:
        version = table.get("version")
        if version not in (1, TABLE_VERSION):
            raise ValueError(f"step-cost table version {version!r}, this build reads 1 and {TABLE_VERSION}")
        rows = [[r[0], r[1], 1, *r[2:]] for r in table["pairs"]] if version == 1 else table["pairs"]
        model = cls([(r[0], r[1]) for r in rows], table["forgetting"], widths=sorted({r[2] for r in rows}))
        for t, s, q, *st in rows:
            model._stats[t, s, q] = [float(v) for v in st]
        return model

    def error_report(self, samples: Sequence[tuple[StepShape, float]]) -> dict:
        """Relative errors |predicted - measured| / measured of (shape, measured seconds) samples."""
        if any(not math.isfinite(m) or m <= 0 for _, m in samples):
            raise ValueError("error_report needs measured times > 0 seconds")
        if not samples:
            return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None,
                    "within_15": None}
        rel = np.array([abs(self.predict(shape) - m) / m for shape, m in samples])
        p50, p90, p99 = (float(v) for v in np.percentile(rel, [50, 90, 99]))
        return {"count": len(rel), "mean": float(rel.mean()), "p50": p50, "p90": p90, "p99": p99,
                "max": float(rel.max()), "within_15": float(np.mean(rel <= WITHIN))}
