"""Data-parallel cores that do not wait for each other: one core's long prefill against the other's decodes.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python scripts/bench_dp_independence.py --model M

Two cores (data_parallel_size=2) whose model runners sleep instead of computing
(jaxsched/bench/stub_runner.py: a step with a prefill row sleeps --prefill-s, a decode-only step
--decode-s), so the figures measure the cores' loops and not this machine's contention. Core 0 gets
--decodes streams of --tokens tokens (prompts sharing a block, so that routing keeps them together);
core 1, in the second run only, a long prefill every --prefill-every seconds. Prints core 0's
inter-token latency (between a request's outputs, as the caller reads them) with and without core
1's prefills, p50 and p99, and their ratio. Cores in lockstep would give core 0's decodes a
--prefill-s gap at every prefill.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def run(eng, ns, with_prefills: bool) -> list[float]:
    from jaxsched import SamplingParams

    decode = SamplingParams(max_tokens=ns.tokens, ignore_eos=True)
    block = eng.cache_config.block_size
    for i in range(ns.decodes):  # a shared first block: the router keeps them on one core
        eng.add_request(f"d{i}", {"prompt_token_ids": [7] * block + [8 + i]}, decode)
    cores = {eng.client.core_of(f"d{i}") for i in range(ns.decodes)}
    assert cores == {0}, cores
    last: dict[str, float] = {}
    gaps: list[float] = []
    next_prefill, n_prefill = time.perf_counter(), 0
    prefill = SamplingParams(max_tokens=1, ignore_eos=True)
    long = [9] * (ns.prefill_tokens - 1)
    while any(f"d{i}" in eng.outputs for i in range(ns.decodes)):
        if with_prefills and time.perf_counter() >= next_prefill:
            rid = f"p{n_prefill}"
            eng.add_request(rid, {"prompt_token_ids": [10 + n_prefill % 50, *long]}, prefill)
            assert eng.client.core_of(rid) == 1
            n_prefill += 1
            next_prefill += ns.prefill_every
        for o in eng.step():
            if not o.request_id.startswith("d"):
                continue
            now = time.perf_counter()
            if o.request_id in last:
                gaps.append(now - last[o.request_id])
            last[o.request_id] = now
    while eng.has_unfinished_requests():
        eng.step()
    return gaps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="any model the engine loads (its steps are stubbed)")
    p.add_argument("--prefill-s", type=float, default=2.0)
    p.add_argument("--decode-s", type=float, default=0.02)
    p.add_argument("--decodes", type=int, default=4)
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--prefill-every", type=float, default=2.5)
    p.add_argument("--prefill-tokens", type=int, default=64)
    ns = p.parse_args()

    from jaxsched import LLM
    from jaxsched.bench.stub_runner import SleepingRunner

    llm = LLM(ns.model, data_parallel_size=2, async_scheduling=False, max_num_seqs=8, max_num_batched_tokens=256,
              max_model_len=512, block_size=16)
    eng = llm.llm_engine
    for core in eng.client.local_cores:
        core.runner = SleepingRunner(core.runner, prefill_s=ns.prefill_s, decode_s=ns.decode_s)
    res = {}
    for label, on in (("alone", False), ("beside prefills", True)):
        gaps = sorted(g * 1e3 for g in run(eng, ns, on))
        res[label] = (statistics.median(gaps), gaps[int(0.99 * (len(gaps) - 1))])
        print(f"core 0 decodes, {label:<16}: {len(gaps)} gaps, ITL p50 {res[label][0]:.1f} ms, "
              f"p99 {res[label][1]:.1f} ms", flush=True)
    print(f"p99 ratio (beside prefills / alone): {res['beside prefills'][1] / res['alone'][1]:.3f}")
    eng.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
