"""What applying a token bitmask costs inside the jitted sampler, by how it is written.

  python scripts/bench_token_mask.py [--vocab 49152] [--seqs 8 32 64]

Per S: the greedy choice alone; the mask applied unconditionally; inside a lax.cond that returns
the logits (its identity branch copies them when off); and inside a lax.cond that returns the chosen
ids (sampler.py's way), off and on. Median of 30 runs, milliseconds.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxsched.runner.sampler import apply_token_mask, argmax_rows


def _median_ms(fn, *args) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=49152, help="V (default: the demo model's)")
    p.add_argument("--seqs", type=int, nargs="+", default=[8, 32, 64])
    ns = p.parse_args()
    V = ns.vocab
    variants = {
        "argmax only": lambda x, m, on: argmax_rows(x),
        "unconditional": lambda x, m, on: argmax_rows(apply_token_mask(x, m)),
        "cond -> logits": lambda x, m, on: argmax_rows(jax.lax.cond(on, lambda x: apply_token_mask(x, m),
                                                                    lambda x: x, x)),
        "cond -> ids": lambda x, m, on: jax.lax.cond(on, lambda x: argmax_rows(apply_token_mask(x, m)),
                                                     argmax_rows, x),
    }
    print(f"V = {V}; ms per call (median of 30); 'off' / 'on': no row / every row constrained")
    for S in ns.seqs:
        x = jnp.asarray(np.random.default_rng(0).standard_normal((S, V), np.float32))
        m = jnp.asarray(np.full((S, (V + 31) // 32), -1, np.int32))
        cells = []
        for name, f in variants.items():
            fn = jax.jit(f)
            off = _median_ms(fn, x, m, jnp.asarray(False))
            on = _median_ms(fn, x, m, jnp.asarray(True))
            cells.append(f"{name} {off:.2f} / {on:.2f}")
        print(f"S = {S:3d}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
