"""What every bench command does with its figures: summary statistics of a sample, and the result
written as JSON (a file with --output-json, one line on stdout with --json)."""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

PERCENTILES = (50, 90, 99)


def add_output_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output-json", metavar="FILE", default=None, help="write the result to FILE as JSON")
    p.add_argument("--json", action="store_true", help="also print the result as one JSON line on stdout")
    p.add_argument("--plot", metavar="DIR", default=None,
                   help="write PNG plots into DIR (needs matplotlib: pip install 'jaxsched[plot]')")


def summarize(values: Sequence[float], name: str, scale: float = 1e3, unit: str = "ms") -> dict[str, float | None]:
    """vLLM's summary fields of one metric: mean_, median_, std_, p50_, p90_, p99_{name}_{unit},
    seconds scaled by `scale` (ms by default). None for an empty sample (every request failed)."""
    keys = ["mean", "median", "std"] + [f"p{q}" for q in PERCENTILES]
    if len(values) == 0:
        return {f"{k}_{name}_{unit}": None for k in keys}
    a = np.asarray(values, dtype=float) * scale
    out = {f"mean_{name}_{unit}": float(a.mean()), f"median_{name}_{unit}": float(np.median(a)),
           f"std_{name}_{unit}": float(a.std())}
    out.update({f"p{q}_{name}_{unit}": float(np.percentile(a, q)) for q in PERCENTILES})
    return {k: round(v, 3) for k, v in out.items()}


def jsonable(obj: Any) -> Any:
    """Strict JSON: numpy scalars as numbers, infinities as the string "inf" (a request rate)."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return "inf" if obj > 0 else ("-inf" if obj < 0 else None)
    return obj


def emit(result: dict[str, Any], ns: argparse.Namespace, lines: list[dict[str, Any]] | None = None) -> None:
    """Write `result` to --output-json and, with --json, print `lines` (default: the result), each
    as one JSON line, the last lines of stdout so that a caller can parse them."""
    result = jsonable(result)
    if ns.output_json:
        path = Path(ns.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        logger.info("wrote %s", path)
    if ns.json:
        for line in lines if lines is not None else [result]:
            print(json.dumps(jsonable(line)), flush=True)
