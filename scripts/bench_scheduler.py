"""Scheduler benchmark: no model. R requests (prompt 128 tokens, max_tokens 128) through
schedule -> pack -> update with fabricated sampled tokens until all finish; per-step host time.

Prints one JSON line per R: R, steps, step_us_p50, step_us_p99, step_us_mean, step_us_max, and the
share of schedule / pack / update in the mean. A thin wrapper over `jaxsched bench scheduler`
(jaxsched/bench/scheduler.py), which writes all R in one JSON result and plots them.

    python scripts/bench_scheduler.py                  # R = 256, 1024, 2048, 4096
    python scripts/bench_scheduler.py --R 2048 --max-steps 300
"""

from __future__ import annotations

import argparse
import json

from jaxsched.bench.scheduler import add_arguments, run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap, output=False)  # --R (or --sizes) and the scheduler's settings
    args = ap.parse_args()
    for R in args.sizes:
        print(json.dumps(run(R, args)), flush=True)


if __name__ == "__main__":
    main()
