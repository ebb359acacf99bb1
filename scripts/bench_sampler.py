"""The sampler program alone: milliseconds per call and page faults per call, greedy and sampled.

  python scripts/bench_sampler.py [--vocab 49152] [--seqs 32 128] [--reps 30]
  python scripts/bench_sampler.py --variants [--json]    each cond-free program a GPU picks from

--variants: per S, each of tuning.SAMPLER_VARIANTS (sampler_branches="host": the program holds its
parts unconditionally, so the rows' values do not change what it costs) and the cond program, on
greedy rows; --json also prints them as one JSON line (scripts/gpu_check.py reads it).

Per S: `sampler.sample` jitted as the engine's sampler program is (SamplerRows in, packed ints and
floats out), on random [S, V] logits, every row greedy or every row at temperature 1 with seeds of
its own, no penalties, bias, masks or logprobs. Prints the median and best of `--reps` calls, the
minor page faults per call (host memory the run faulted in; jaxsched/platforms/host_malloc.py) and the
program's temporary buffer. Run it with JAXSCHED_HOST_MALLOC=system to see glibc's default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxsched.platforms import host_malloc
from jaxsched.runner.batch import SamplerRows
from jaxsched.runner.sampler import sample
from pallas_kernels import tuning


def rows(S: int, V: int, temperature: float) -> dict:
    """SamplerRows' fields for S plain rows: no filters, penalties, bias entries, masks or logprobs."""
    zi, zf = np.zeros(S, np.int32), np.zeros(S, np.float32)
    fields = {"top_k": zi, "seeds": np.arange(S, dtype=np.int32) * 7919, "sample_index": zi,
              "num_logprobs": zi - 1, "penalty_num": zi, "masked": zi, "pending_token": zi - 1,
              "temperature": np.full(S, temperature, np.float32), "top_p": np.ones(S, np.float32), "min_p": zf,
              "presence_penalty": zf, "frequency_penalty": zf, "repetition_penalty": np.ones(S, np.float32),
              "penalty_ids": np.zeros((S, 64), np.int32), "penalty_counts": np.zeros((S, 64), np.float32),
              "token_mask": np.full((S, (V + 31) // 32), -1, np.int32), "bias_ids": np.full((S, 16), V, np.int32),
              "bias_values": np.zeros((S, 16), np.float32)}
    assert set(fields) == {f.name for f in dataclasses.fields(SamplerRows)}
    return {k: jnp.asarray(v) for k, v in fields.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=49152, help="V (default: the demo model's)")
    p.add_argument("--seqs", type=int, nargs="+", default=[32, 128])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--variants", action="store_true", help="time every sampler variant (see above)")
    p.add_argument("--json", action="store_true", help="with --variants: one JSON line at the end")
    ns = p.parse_args()
    if ns.variants:
        variants(ns)
        return
    V = ns.vocab
    fn = jax.jit(lambda logits, kw: sample(logits, SamplerRows(**kw), 0))
    print(f"V = {V}; host malloc kept: {host_malloc.applied()}")
    for S in ns.seqs:
        logits = jnp.asarray(np.random.default_rng(0).standard_normal((S, V), np.float32))
        for temperature in (0.0, 1.0):
            kw = rows(S, V, temperature)
            temp_mb = fn.lower(logits, kw).compile().memory_analysis().temp_size_in_bytes / 2**20
            for _ in range(3):
                jax.block_until_ready(fn(logits, kw))
            times = []
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(ns.reps):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(logits, kw))
                times.append(time.perf_counter() - t0)
            faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / ns.reps
            kind = "greedy " if temperature == 0 else "sampled"
            print(f"S = {S:4d} {kind}: median {np.median(times) * 1e3:6.2f} ms, best {min(times) * 1e3:6.2f} ms, "
                  f"{faults:6.0f} page faults per call, temporary buffer {temp_mb:.0f} MiB")


def variants(ns) -> None:
    """Median ms per call of each sampler variant and of the cond program, per S, greedy rows."""
    V = ns.vocab
    result = {"vocab": V, "reps": ns.reps, "ms": {}}
    for S in ns.seqs:
        logits = jnp.asarray(np.random.default_rng(0).standard_normal((S, V), np.float32))
        kw = rows(S, V, 0.0)
        for features in (*tuning.SAMPLER_VARIANTS, None):
            name = "cond program" if features is None else "+".join(sorted(features)) or "argmax"
            fn = jax.jit(lambda logits, kw, features=features: sample(logits, SamplerRows(**kw), 5, features))
            compiled = fn.lower(logits, kw).compile()
            jax.block_until_ready(compiled(logits, kw))
            times = []
            for _ in range(ns.reps):
                t0 = time.perf_counter()
                jax.block_until_ready(compiled(logits, kw))
                times.append(time.perf_counter() - t0)
            ms = float(np.median(times) * 1e3)
            result["ms"][f"S={S} {name}"] = round(ms, 4)
            print(f"S = {S:4d} {name:36s} median {ms:8.3f} ms, best {min(times) * 1e3:8.3f} ms", flush=True)
    if ns.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
