"""What this CPU can do, as the engine's step meets it: f32 matmul GFLOP/s on the demo model's
weight shapes (XLA, numpy's BLAS, torch's oneDNN when torch is installed, and the "numba" backend's
packed kernel, each in a process of its own), and the read bandwidth a numba loop reaches streaming a large array (what the decode
attention kernel's KV reads can be compared with: scripts/bench_attention.py).

    python scripts/bench_cpu_roofline.py [--rows 8,32,128,512,2048] [--libs jax,numpy,torch,packed]

Each cell is the median of --repeats calls, after one warm-up. The machines here are VMs: compare
libraries within one run, not across days.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

D, F = 576, 1536  # the demo model's hidden and MLP sizes
SHAPES = [(D, 3 * D), (D, D), (D, 2 * F), (F, D)]  # fused qkv (as wide), o, fused gate/up, down


def matmuls(lib: str, rows: list[int], repeats: int) -> None:
    import numpy as np

    if lib == "torch":
        import torch

        torch.set_num_threads(os.cpu_count() or 1)
        conv, mm = torch.from_numpy, torch.mm
    elif lib == "jax":
        import jax
        import jax.numpy as jnp

        dot = jax.jit(jnp.dot)
        conv, mm = jnp.asarray, lambda a, b: dot(a, b).block_until_ready()
    elif lib == "packed":  # the "numba" backend's weight matmul, on a weight packed once (numba_matmul.py)
        from pallas_kernels import numba_matmul as nm

        def mm(a, wp):
            out = np.empty((a.shape[0], wp.shape[0] * nm.NR), np.float32)
            none = np.empty((a.shape[0], 0), np.float32)
            empty = np.empty(0, np.float32)  # no scales: a float32 weight
            nm.packed_matmul(a, wp, out, none, none, a.shape[0], empty, empty)

        conv, conv_w = (lambda x: x), nm.pack
    else:
        conv, mm = (lambda x: x), np.dot
    if lib != "packed":
        conv_w = conv
    rng = np.random.default_rng(0)
    for t in rows:
        cells = []
        for k, n in SHAPES:
            a = conv(rng.standard_normal((t, k), dtype=np.float32))
            b = conv_w(rng.standard_normal((k, n), dtype=np.float32))
            mm(a, b)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                mm(a, b)
                times.append(time.perf_counter() - t0)
            cells.append(2 * t * k * n / float(np.median(times)) / 1e9)
        print(f"{lib:6s} T={t:<5d}" + "".join(f"{c:9.0f}" for c in cells), flush=True)


def bandwidth(mib: int) -> None:
    import numpy as np
    from numba import njit, prange

    @njit(parallel=True, fastmath=True)
    def read_all(a):
        total = 0.0
        for i in prange(a.size):
            total += a[i]
        return total

    @njit(fastmath=True)
    def read_one(a):
        total = 0.0
        for i in range(a.size):
            total += a[i]
        return total

    a = np.ones(mib * 2**20 // 4, np.float32)
    for fn, name in ((read_all, "all threads"), (read_one, "one thread")):
        fn(a)
        best = min(_timed(fn, a) for _ in range(5))
        print(f"read {mib} MiB, {name}: {a.nbytes / best / 1e9:.1f} GB/s", flush=True)


def _timed(fn, a) -> float:
    t0 = time.perf_counter()
    fn(a)
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="8,32,128,512,2048", help="T values: rows of the activations")
    p.add_argument("--libs", default="jax,numpy,torch,packed")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--mib", type=int, default=2048, help="array size of the bandwidth probe")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.child == "bandwidth":
        bandwidth(args.mib)
        return 0
    if args.child:
        matmuls(args.child, rows, args.repeats)
        return 0
    print("GFLOP/s   " + "".join(f"{f'{k}x{n}':>9s}" for k, n in SHAPES), flush=True)
    for lib in args.libs.split(",") + ["bandwidth"]:
        cmd = [sys.executable, __file__, "--child", lib, "--rows", args.rows, "--repeats", str(args.repeats),
               "--mib", str(args.mib)]
        if subprocess.run(cmd, check=False).returncode:
            print(f"{lib}: failed (not installed?)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
