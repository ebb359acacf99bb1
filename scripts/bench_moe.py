"""A mixture-of-experts layer stack against two dense ones: the same active parameters a token (its
MLP as wide as its k experts together) and the same total parameters (as wide as all E experts).
Each model's program (random weights, the platform's layer layout and grouped matmul, "xla"
attention) is timed on a decode step of S rows at a context of C tokens and on a prefill step of T
tokens; the MoE step should cost about what the first dense model's does, far below the second's.

  python scripts/bench_moe.py                       # E = 16, k = 2, D = 512, L = 4 (below)
  python scripts/bench_moe.py --experts 64 --top-k 4 --reps 20
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxsched.models.loader import build_model
from jaxsched.models.model_config import ModelConfig
from jaxsched.runner.batch import BatchDescriptor, flat_sizes
from pallas_kernels import backends


def configs(ns) -> dict[str, ModelConfig]:
    base = ModelConfig("Qwen3MoeForCausalLM", vocab_size=1024, hidden_size=ns.hidden, intermediate_size=0,
                       num_layers=ns.layers, num_heads=8, num_kv_heads=8, head_dim=ns.hidden // 8, rms_norm_eps=1e-6,
                       rope_theta=1e6, rope_scaling=None, max_position_embeddings=4096, tie_word_embeddings=False,
                       qk_norm=True)
    moe = dataclasses.replace(base, num_experts=ns.experts, num_experts_per_tok=ns.top_k,
                              moe_intermediate_size=ns.expert_size)
    return {
        f"moe (E={ns.experts}, k={ns.top_k}, F={ns.expert_size})": moe,
        f"dense, same active (F={ns.top_k * ns.expert_size})": dataclasses.replace(
            base, architecture="Qwen3ForCausalLM", intermediate_size=ns.top_k * ns.expert_size),
        f"dense, same total (F={ns.experts * ns.expert_size})": dataclasses.replace(
            base, architecture="Qwen3ForCausalLM", intermediate_size=ns.experts * ns.expert_size),
    }


def step_batch(T: int, S: int, context: int, P: int, M: int, decode: bool) -> BatchDescriptor:
    """A step of S rows: decode (one token each, at `context`) or one prefill row of T tokens."""
    ni, nf = flat_sizes(T, S)
    b = BatchDescriptor.from_flat(np.zeros(ni, np.int32), np.zeros(nf, np.float32), T, S)
    rng = np.random.default_rng(0)
    b.token_ids[:] = rng.integers(3, 1000, T)
    if decode:
        b.positions[:S] = context - 1
        b.seq_lens[:] = context
        b.query_start_loc[:] = np.arange(S + 1)
        b.logits_indices[:] = np.arange(S)
        b.num_seqs[0] = S
    else:
        b.positions[:] = np.arange(T)
        b.seq_lens[0] = T
        b.query_start_loc[1:] = T
        b.logits_indices[0] = T - 1
        b.num_seqs[0] = 1
    n = -(-max(context, T) // P)
    tables = 1 + np.arange(S * M).reshape(S, M) % (S * n)  # distinct blocks per row, in the pool
    b.block_tables = tables.astype(np.int32)
    rows = np.arange(S) if decode else np.zeros(T, np.int64)  # each token's row
    pos = b.positions[: len(rows)]
    b.slot_mapping[: len(rows)] = b.block_tables[rows, pos // P] * P + pos % P
    return b


def time_model(cfg: ModelConfig, ns) -> dict[str, float]:
    model = build_model(cfg, "float32", None, attention_backend="xla")
    P = 128
    M = -(-max(ns.context, ns.prefill) // P)
    NB = ns.rows * M + 1
    shapes = backends.get("xla").pool_shapes(cfg.num_layers, NB, cfg.num_kv_heads, P, cfg.head_dim)
    kv = tuple(jnp.zeros(s, jnp.float32) for s in shapes)
    def step(kv, flat_i32, block_tables, T, S):
        b = BatchDescriptor.from_flat(flat_i32, jnp.zeros(flat_sizes(T, S)[1], jnp.float32), T, S)
        b.block_tables = block_tables
        return model(kv, b)

    forward = jax.jit(step, donate_argnums=(0,), static_argnums=(3, 4))
    out = {}
    for name, b in (("decode", step_batch(ns.rows, ns.rows, ns.context, P, M, True)),
                    ("prefill", step_batch(ns.prefill, 8, ns.prefill, P, M, False))):
        args = (jnp.asarray(b.flat_i32), jnp.asarray(b.block_tables), b.num_tokens_bucket, b.num_seqs_bucket)
        logits, kv = forward(kv, *args)
        jax.block_until_ready(logits)
        times = []
        for _ in range(ns.reps):
            t0 = time.perf_counter()
            logits, kv = forward(kv, *args)
            jax.block_until_ready(logits)
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1e3
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-size", type=int, default=512, help="each expert's intermediate size")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rows", type=int, default=32, help="decode rows S")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--prefill", type=int, default=512, help="prefill tokens T")
    p.add_argument("--reps", type=int, default=10)
    ns = p.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; decode S={ns.rows} at context {ns.context}, "
          f"prefill T={ns.prefill}; median of {ns.reps} ms")
    for name, cfg in configs(ns).items():
        t = time_model(cfg, ns)
        params = cfg.layer_params / 1e6
        print(f"{name:<40} active {params:7.1f} M/token   decode {t['decode']:8.2f} ms   prefill {t['prefill']:8.2f} ms",
              flush=True)


if __name__ == "__main__":
    main()
