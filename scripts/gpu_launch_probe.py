"""Issue 16 probe (GPU): how long dispatching one step's programs takes on the host, against how
long the device takes to run them, under the current XLA_FLAGS. One JSON line on stdout.

  python scripts/gpu_launch_probe.py --model FOLDER [--dtype bfloat16] [--backend pallas]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backend", default="pallas")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    from jaxsched import LLM
    from jaxsched.core.scheduler import SchedulerOutput

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=64, max_num_batched_tokens=64,
              max_model_len=args.max_model_len, attention_backend=args.backend)
    r = llm.llm_engine.runner
    res = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "init_s": round(time.perf_counter() - t0, 1)}
    for T, S in ((64, 64), (16, 8)):
        batch = r.packer.pack(SchedulerOutput(token_bucket=T, seq_bucket=S))
        r._fetch(*r.run(batch))
        launch, total = [], []
        for _ in range(args.reps):  # one step at a time: launch, then wait
            a = time.perf_counter()
            out = r.run(batch)
            b = time.perf_counter()
            r._fetch(*out)
            launch.append(b - a)
            total.append(time.perf_counter() - a)
        a = time.perf_counter()
        for _ in range(args.reps):  # back to back, as with overlap: bound by the slower of the two
            out = r.run(batch)
        r._fetch(*out)
        piped = (time.perf_counter() - a) / args.reps
        res[f"T{T}_S{S}"] = {"launch_ms": round(statistics.median(launch) * 1e3, 3),
                             "launch_then_wait_ms": round(statistics.median(total) * 1e3, 3),
                             "back_to_back_ms": round(piped * 1e3, 3)}
    text = r._executables[(64, 64)].as_text() or ""
    res["hlo"] = {k: len(re.findall(p, text)) for k, p in (
        ("command_buffer", r"command_buffer"), ("while", r"\bwhile\("), ("custom_call", r"custom-call\("),
        ("fusion", r"\bfusion\("), ("lines", r"\n"))}
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
