"""XLA:CPU switches on the demo model's layer shapes: GFLOP/s of a jitted stack of Llama-like layers
(RMS norm, attention projections, SwiGLU MLP; no attention itself) under each XLA_FLAGS setting.

    python scripts/bench_xla_flags.py [--layers 8] [--rows 8,64,512] [--flag= --flag=--xla_cpu_use_xnnpack=true ...]

Each setting runs in its own process (XLA reads XLA_FLAGS once, at start), after one warm-up call;
a row is the median of --repeats calls. Run every setting twice: on a shared VM the spread between
runs of the same setting is what a difference must beat.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

DEFAULT_FLAGS = ["", "--xla_cpu_use_onednn=true", "--xla_cpu_use_xnnpack=true", "--xla_cpu_enable_fast_math=true",
                 "--xla_cpu_prefer_vector_width=512", "--xla_cpu_use_thunk_runtime=false"]


def measure(layers: int, rows: list[int], repeats: int, d: int, f: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    def norm(x):
        return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5)

    def model(x, ws):
        for wq, wo, w1, w3, w2 in ws:
            x = x + (norm(x) @ wq) @ wo
            h = norm(x)
            x = x + (jax.nn.silu(h @ w1) * (h @ w3)) @ w2
        return x

    fn = jax.jit(model)
    rng = np.random.default_rng(0)
    shapes = [(d, d), (d, d), (d, f), (d, f), (f, d)]
    ws = [tuple(jnp.asarray(rng.standard_normal(s, dtype=np.float32) * 0.02) for s in shapes) for _ in range(layers)]
    for t in rows:
        x = jnp.asarray(rng.standard_normal((t, d), dtype=np.float32))
        fn(x, ws).block_until_ready()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(x, ws).block_until_ready()
            times.append(time.perf_counter() - t0)
        sec = float(np.median(times))
        flops = 2 * t * layers * (2 * d * d + 3 * d * f)
        print(f"T={t:<5d} {sec * 1e3:9.2f} ms {flops / sec / 1e9:8.1f} GFLOP/s", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rows", default="8,64,512", help="T values: rows per call")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--hidden", type=int, default=576, help="D (the demo model's)")
    p.add_argument("--intermediate", type=int, default=1536, help="F (the demo model's)")
    p.add_argument("--flag", action="append", default=None, dest="flags", metavar="XLA_FLAGS",
                   help="a setting to compare, written --flag=SETTING (--flag= is the default); repeatable "
                        "(default: the default and five switches)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args()
    rows = [int(r) for r in ns.rows.split(",")]
    if ns.child:
        measure(ns.layers, rows, ns.repeats, ns.hidden, ns.intermediate)
        return 0
    for flags in ns.flags or DEFAULT_FLAGS:
        print(f"== XLA_FLAGS={flags!r}", flush=True)
        env = {**os.environ, "XLA_FLAGS": flags}
        subprocess.run([sys.executable, __file__, "--child", "--layers", str(ns.layers), "--rows", ns.rows,
                        "--repeats", str(ns.repeats), "--hidden", str(ns.hidden),
                        "--intermediate", str(ns.intermediate)], env=env, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
