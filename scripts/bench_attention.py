"""Time the attention backends on CPU for decode-only and prefill steps at the demo model's shapes.

Usage: python scripts/bench_attention.py [--backend xla] [--seqs 128] [--ctx 400] [--prefill 2048]
                                        [--kv-cache-dtype float32|bfloat16] [--block-size 128]
Prints one line per case: milliseconds per layer (a call runs a 30-layer scan, as the engine's step
does, over a pool of 2 layers) and effective KV GB/s.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxsched import platforms
from pallas_kernels import backends
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.pool_storage import to_pool


def build(rng, seqs, q_lens, ctx, NB, K, P, H, N, M):
    S = len(q_lens)
    bt = np.zeros((S, M), np.int32)
    seq_lens = np.zeros(S, np.int32)
    qsl = np.zeros(S + 1, np.int32)
    perm = rng.permutation(NB - 1) + 1
    used = 0
    for i in range(seqs):
        sl = ctx[i] + q_lens[i]
        nb = -(-sl // P)
        bt[i, :nb] = perm[used : used + nb]
        used += nb
        seq_lens[i] = sl
        qsl[i + 1] = qsl[i] + q_lens[i]
    qsl[seqs + 1 :] = qsl[seqs]
    return bt, seq_lens, qsl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="xla", choices=tuple(backends.BACKENDS))
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=400)
    ap.add_argument("--prefill", type=int, default=2048, help="tokens of a prefill-only step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-cache-dtype", default="float32", choices=("float32", "bfloat16", "fp8", "fp8_e5m2"))
    ap.add_argument("--block-size", type=int, default=None, help="tokens per page; default: the engine's")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    L, K, H, N = 2, 3, 64, 9
    backend = backends.get(args.backend)
    P = args.block_size or backend.default_block_size
    M = -(-1024 // P)
    NB = args.seqs * M + 1
    storage = backend.pool_dtype(args.kv_cache_dtype)  # as the engine stores it
    k_shape, v_shape = backend.pool_shapes(L, NB, K, P, H)
    kc = to_pool(jnp.asarray(rng.standard_normal(k_shape, dtype=np.float32)), storage)
    vc = to_pool(jnp.asarray(rng.standard_normal(v_shape, dtype=np.float32)), storage)
    LAYERS = 30  # the demo model's depth: one call runs a layer scan, as the engine's step does

    def layers(q, kc, vc, bt, sl, qsl, ns):
        def one(carry, i):  # each layer's query depends on the previous output, as in the model
            o = paged_attention(q + carry, kc, vc, i % L, bt, sl, qsl, ns, sm_scale=H**-0.5,
                                backend=args.backend)
            return carry + 1e-9 * o.sum(), None
        return jax.lax.scan(one, jnp.float32(0), jnp.arange(LAYERS, dtype=jnp.int32))[0]

    # compiled with the XLA options the engine's step uses (the platform record's)
    fn = jax.jit(layers, compiler_options=platforms.of(jax.devices()[0].platform).step_compiler_options(args.backend))
    cases = {
        f"decode S={args.seqs} ctx={args.ctx}": ([1] * args.seqs, [args.ctx - 1] * args.seqs, args.seqs),
        f"prefill T={args.prefill} (4 prompts)": ([args.prefill // 4] * 4 + [0] * 4, [0] * 8, 4),
        f"mixed: 1 chunk of 512 + {args.seqs - 1} decodes": (
            [512] + [1] * (args.seqs - 1), [256] + [args.ctx - 1] * (args.seqs - 1), args.seqs),
    }
    for name, (q_lens, ctx, n) in cases.items():
        bt, seq_lens, qsl = build(rng, n, q_lens, ctx, NB, K, P, H, N, M)
        T = max(16, int(2 ** np.ceil(np.log2(max(sum(q_lens), 1)))))
        q = jnp.asarray(rng.standard_normal((T, N, H), dtype=np.float32))
        a = (q, kc, vc, jnp.asarray(bt), jnp.asarray(seq_lens), jnp.asarray(qsl), jnp.asarray([n], np.int32))
        fn(*a).block_until_ready()
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            r = fn(*a)
        r.block_until_ready()
        dt = (time.perf_counter() - t0) / args.repeats / LAYERS
        kv_bytes = sum(int(s) for s in seq_lens) * K * H * kc.dtype.itemsize * 2
        print(f"{name}: {dt * 1e3:.2f} ms/layer, KV {kv_bytes / dt / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
