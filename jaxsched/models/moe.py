"""Mixture of experts (Qwen3-MoE, Mixtral): each token's top-k experts by its router, computed on the
tokens grouped by expert, never as a dense pass over every expert and never dropping a token.

  route:        router logits [T, E] -> softmax (float32) -> top-k -> weights f32[T, k], experts i32[T, k];
                the k weights renormalised to sum 1 where the model says so (Qwen3-MoE's
                norm_topk_prob; Mixtral always, which is its softmax over the top-k logits)
  expert MLP:   silu(x @ gate) * (x @ up) @ down, each expert its own [D, 2 F] and [F, D]
  combine:      a token's output is its k experts' outputs weighted by its k weights

The T * k (token, expert) pairs are sorted by expert, and the experts' matmuls run on the sorted rows
in one of two ways (the platform record's grouped_matmul):
  "ragged_dot"  jax.lax.ragged_dot: one grouped matmul per projection, as XLA:GPU runs it;
  "tiles"       the sorted rows padded per expert to tiles of TILE rows, and a loop over the tiles in
                use, each one expert's dots: on a CPU, where jax's ragged_dot is a dense product over
                every expert masked afterwards, so that a step's time follows the experts it uses.

Under tensor parallelism the experts are split over the mesh's "model" axis (expert parallelism):
each device holds E / n experts and computes the pairs routed to its own, and one all-reduce of
[T, D] (where a dense MLP's row-parallel projection has its own) sums the devices' parts. Tokens
are replicated across the axis, so no all-to-all is needed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxsched.models.quantize import MINIMUM, SCALE, dequantize

# rows per tile of the "tiles" grouped matmul: about the pairs an expert gets in a step (N / E), within
# these bounds. Each tile reads (on a CPU: copies) its expert's weights, so a tile much smaller than
# that reads them several times; much larger, and padding rows cost dots (docs/PERFORMANCE.md)
TILE_MIN, TILE_MAX = 8, 128
GROUPED_MATMULS = ("ragged_dot", "tiles")


def route(h, router, k: int, normalize: bool):
    """h [T, D], router [D, E] -> (weights f32[T, k], experts i32[T, k]), as transformers routes: the
    logits in h's dtype, softmax in float32, top-k with ties to the lower expert id."""
    logits = jnp.dot(h, router).astype(jnp.float32)
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def _sorted_pairs(experts, first: int, count: int):
    """The (token, expert) pairs sorted by expert, those of experts [first, first + count) first:
    (order i32[N]: pair ids in that order, key i32[N]: each pair's local expert, count for others,
    sizes i32[count]: pairs per local expert)."""
    local = experts.reshape(-1) - first
    key = jnp.where((local >= 0) & (local < count), local, count)
    order = jnp.argsort(key, stable=True)
    return order, key, jnp.bincount(key, length=count + 1)[:count].astype(jnp.int32)


def _expert_mlp(x, gate_up, down):
    g, u = jnp.split(jnp.dot(x, gate_up), 2, axis=-1)
    return jnp.dot(jax.nn.silu(g) * u, down)


def _ragged(xs, sizes, gate_up, down):
    """xs [N, D] sorted by expert, sizes i32[E] -> [N, D] (rows past sum(sizes): zeros)."""
    g, u = jnp.split(jax.lax.ragged_dot(xs, gate_up, sizes), 2, axis=-1)
    return jax.lax.ragged_dot(jax.nn.silu(g) * u, down, sizes)


def tile_rows(N: int, E: int) -> int:
    """The tile of N pairs over E experts: N / E rounded up to a power of two, within the bounds."""
    return min(TILE_MAX, max(TILE_MIN, 1 << max(0, -(-N // E) - 1).bit_length()))


def _tiles(xs, sizes, gate_up, down):
    """The same as _ragged by tiles of one expert each, looping over the tiles in use."""
    N, D = xs.shape
    E = sizes.shape[0]
    TILE = tile_rows(N, E)
    tiles = (sizes + TILE - 1) // TILE  # per expert
    tile_end = jnp.cumsum(tiles)
    first_tile = tile_end - tiles
    first_row = jnp.cumsum(sizes) - sizes  # of each expert in xs
    max_tiles = -(-N // TILE) + E  # any routing fits
    rows = max_tiles * TILE
    expert_of_row = jnp.clip(jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(N), side="right"), 0, E - 1)
    used = jnp.arange(N) < sizes.sum()  # the pairs of these experts (the others sort last)
    dest = jnp.where(used, first_tile[expert_of_row] * TILE + jnp.arange(N) - first_row[expert_of_row], rows)
    xp = jnp.zeros((rows, D), xs.dtype).at[dest].set(xs, mode="drop")
    tile_expert = jnp.clip(jnp.searchsorted(tile_end, jnp.arange(max_tiles), side="right"), 0, E - 1)

    def body(t, yp):
        xt = jax.lax.dynamic_slice_in_dim(xp, t * TILE, TILE)
        e = tile_expert[t]
        return jax.lax.dynamic_update_slice_in_dim(yp, _expert_mlp(xt, gate_up[e], down[e]).astype(yp.dtype),
                                                   t * TILE, 0)

    yp = jax.lax.fori_loop(0, tile_end[-1], body, jnp.zeros((rows, D), xs.dtype))
    return jnp.where(used[:, None], yp[jnp.minimum(dest, rows - 1)], 0)


def experts_mlp(x, weights, experts, gate_up, down, how: str, first=0):
    """x [T, D]; weights f32[T, k], experts i32[T, k] (route); gate_up [E, D, 2 F], down [E, F, D]:
    the experts [first, first + E) -> the weighted sum of each token's experts' outputs [T, D]
    (pairs routed elsewhere add nothing)."""
    T, k = experts.shape
    E = gate_up.shape[0]
    gate_up, down = jnp.asarray(gate_up), jnp.asarray(down)  # indexed by a traced expert id below
    order, key, sizes = _sorted_pairs(experts, first, E)
    xs = x[order // k]
    ys = (_ragged if how == "ragged_dot" else _tiles)(xs, sizes, gate_up, down)
    w = jnp.where(key[order] < E, weights.reshape(-1)[order], 0.0)
    pairs = jnp.zeros((T * k, x.shape[1]), ys.dtype).at[order].set(ys * w[:, None].astype(ys.dtype))
    return pairs.reshape(T, k, -1).sum(axis=1).astype(x.dtype)


def moe_mlp(p: dict, x, k: int, normalize: bool, how: str, mesh=None):
    """The MoE half of a layer on x [T, D] (already normed): route with p["router"], then the experts
    p["experts_gate_up"], p["experts_down"], split over the mesh's "model" axis when it has several
    devices (expert parallelism: each device's own experts, then one all-reduce); plus a shared
    expert where the layer has one (Qwen2-MoE), every token through it, scaled by its own gate."""
    y = _routed(p, x, k, normalize, how, mesh)
    if "shared_gate_up" in p:
        gate = jax.nn.sigmoid(jnp.dot(x, p["shared_gate"]).astype(jnp.float32)).astype(x.dtype)  # [T, 1]
        y = y + gate * _expert_mlp(x, _weight(p, "shared_gate_up", x.dtype), _weight(p, "shared_down", x.dtype))
    return y


def _weight(p: dict, name: str, dtype):
    """p[name], dequantized when quantized (quantize.py: per expert and output channel). The grouped
    matmuls take float weights: a quantized MoE holds its experts in 8 bits and dequantizes them in
    the step, before the grouped matmul (a fused dequantizing grouped matmul is not written yet)."""
    return dequantize(p[name], p.get(name + SCALE), dtype, minimum=p.get(name + MINIMUM))


def _routed(p: dict, x, k: int, normalize: bool, how: str, mesh):
    weights, experts = route(x, p["router"], k, normalize)
    gate_up, down = _weight(p, "experts_gate_up", x.dtype), _weight(p, "experts_down", x.dtype)
    n = 1 if mesh is None else mesh.shape["model"]
    if n == 1:
        return experts_mlp(x, weights, experts, gate_up, down, how)

    def local(x, weights, experts, gate_up, down):
        first = jax.lax.axis_index("model") * gate_up.shape[0]
        return jax.lax.psum(experts_mlp(x, weights, experts, gate_up, down, how, first), "model")

    split = P("model", None, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), split, split), out_specs=P(),
                         check_vma=False)(x, weights, experts, gate_up, down)
