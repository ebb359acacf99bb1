"""How much of the machine a run used: the model FLOPs of a workload, and the float matmul peak
measured here, against which the achieved FLOP/s is read (bench throughput --flops)."""

from __future__ import annotations

import time

import numpy as np


def matmul_peak_gflops(dtype: str = "float32", n: int = 2048, repeats: int = 10) -> float:
    """Best-of-3 GFLOP/s of an n x n x n matmul: the ceiling any model step can reach here."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), dtype)
    b = jnp.ones((n, n), dtype)
    f = jax.jit(lambda a, b: a @ b)
    f(a, b).block_until_ready()
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeats):
            r = f(a, b)
        r.block_until_ready()
        best = max(best, 2 * n**3 * repeats / (time.perf_counter() - t0) / 1e9)
    return best


def model_flops(cfg, prompt_lens: np.ndarray, output_lens: np.ndarray) -> dict[str, float]:
    """Useful FLOPs of the workload: every token fed through the weights once (prompt + output - 1),
    causal attention over each token's context, and the lm_head once per sampled token."""
    D, L, N, H, V = cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.vocab_size
    fed = prompt_lens + output_lens - 1
    matmul = 2.0 * cfg.layer_params * fed.sum()
    # token at position i attends to i + 1 keys: QK^T and PV, 2 FLOPs per MAC, N heads of H dims
    ctx_sum = (fed * (fed + 1) / 2).sum()
    attention = 4.0 * N * H * L * ctx_sum
    lm_head = 2.0 * D * V * output_lens.sum()
    return {"matmul": matmul, "attention": attention, "lm_head": lm_head,
            "total": matmul + attention + lm_head}
