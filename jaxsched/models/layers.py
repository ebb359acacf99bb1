"""What every decoder architecture shares: its L layers' weights in one of two layouts, the loop that
runs them, the attention step between a layer's two halves, RMSNorm and rotary embeddings, and the
stacking of checkpoint tensors into those layouts.

An architecture file (llama.py, gemma.py) describes one layer as two halves around attention:
    before(p, h) -> q [T, N, H], k, v [T, K, H]     e.g. norm and the fused q/k/v projection
    after(p, h, o) -> h [T, D]                      o [T, N * H]: o projection, residual, MLP
                                                    (the last layer's: on the sampled rows, [S, D])
where p is that layer's weights (a dict of arrays named as in the architecture's layer spec).
Attention itself (rope, the KV write, paged attention over the pool) holds no weights and runs
between them; `paged_attend` builds it.

The loop is one lax.scan over layers, so a program compiles the attention of one layer instead of
L, which is what keeps warm-up of every bucket short. Weights are either stacked along a leading L
axis (the scan slices them) or held per layer and reached through lax.switch on the layer index (on
a CPU: XLA:CPU copies a sliced weight before every dot; the platform record (jaxsched/platforms/platform.py) says
which layout a platform gets, docs/PERFORMANCE.md why). "unrolled" holds them per layer too but runs
the layers as L copies in the program, with no loop: no dynamic slice of a weight to copy and no
switch (on a GPU a switch reads its index on the host, a sync per layer), for L times the program.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxsched import platforms
from jaxsched.core.kv_groups import kv_groups
from jaxsched.models.model_config import ModelConfig
from jaxsched.models.quantize import MINIMUM, SCALE, dequantize, quantized_dot, scale_of
from jaxsched.parallel.mesh import shard_interleave
from pallas_kernels import backends, paged_attention, write_kv
from pallas_kernels.window import NO_WINDOW

LAYER_WEIGHTS = ("stacked", "per_layer", "unrolled")

# One layer's weights: name -> (shape without the L axis, constant fill, or None for random init).
# Linear weights are [in, out].
LayerSpec = dict[str, tuple[tuple[int, ...], float | None]]
# attend(q, k, v, k_cache, v_cache, layer index) -> (o [T, N * H], k_cache, v_cache)
Attend = Callable[..., tuple[Any, Any, Any]]


def param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, fill: float | None = None) -> nnx.Param:
    """A constant `fill`, or N(0, 0.02) as transformers initialises linear weights (random init is
    for tests and benchmarks: real weights replace it)."""
    if fill is not None:
        return nnx.Param(jnp.full(shape, fill, dtype))
    return nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), shape, jnp.float32).astype(dtype))


def _layer_params(spec: LayerSpec, dtype, rngs: nnx.Rngs, lead: tuple[int, ...]) -> nnx.Dict:
    return nnx.Dict({name: param(rngs, (*lead, *shape), dtype, fill) for name, (shape, fill) in spec.items()})


def _arrays(params: nnx.Dict) -> dict[str, Any]:
    return {name: p[...] for name, p in params.items()}


class DecoderLayers(nnx.Module):
    """All L layers' weights in one layout: "stacked", one dict of arrays with a leading L axis, or
    "per_layer" and "unrolled", L dicts (the two differ in how the layers run, not in the state).
    layout None picks the platform record's layer_weights."""

    def __init__(self, spec: LayerSpec, num_layers: int, dtype, rngs: nnx.Rngs, layout: str | None = None):
        layout = layout or platforms.of(jax.devices()[0].platform).layer_weights
        if layout not in LAYER_WEIGHTS:
            raise ValueError(f"layer_weights must be one of {LAYER_WEIGHTS}, got {layout!r}")
        self.layout = layout
        L = num_layers
        self.stacked = _layer_params(spec, dtype, rngs, (L,)) if layout == "stacked" else None
        self.per_layer = nnx.List([_layer_params(spec, dtype, rngs, ()) for _ in range(L)]) \
            if layout != "stacked" else None

    def __call__(self, h, kv, before: Callable, after: Callable, attend: Attend, rows):
        """h [T, D] through every layer; kv: (k_cache, v_cache) with a leading L axis; rows i32[S]: the
        tokens whose final hidden state is wanted (where a token is sampled). -> (h [S, D] at rows, kv)

        Only `rows` of the last layer's output are read, so with per-layer weights its second half
        (o projection, MLP) runs on those S rows instead of all T (every layer's K and V, and so its
        first half and attention, are still needed for all T). Stacked weights run it on all T: doing
        otherwise there would take a cond in every layer of the scan or a second copy of the layer
        outside it, neither measured on a GPU yet."""
        k_cache, v_cache = kv
        if self.stacked is not None:
            def layer(carry, p):  # p: this layer's slice of the stacked weights
                h, k_cache, v_cache, li = carry
                o, k_cache, v_cache = attend(*before(p, h), k_cache, v_cache, li)
                return (after(p, h, o), k_cache, v_cache, li + 1), None

            (h, k_cache, v_cache, _), _ = jax.lax.scan(
                layer, (h, k_cache, v_cache, jnp.int32(0)), _arrays(self.stacked))
            return h[rows], (k_cache, v_cache)
        # One switch per layer, between two attentions: branch i runs the end of layer i and the start
        # of layer i + 1 with their own arrays (the other layers' pass through untouched); layer 0's
        # start runs before the scan. The halves are jitted so that they trace and lower once for all
        # L branches (each branch calls the same function); XLA still compiles L copies
        # (the platform record's layer_weights: the cost).
        ws = [_arrays(p) for p in self.per_layer]
        L = len(ws)
        if self.layout == "unrolled":
            for i, p in enumerate(ws[:-1]):
                o, k_cache, v_cache = attend(*before(p, h), k_cache, v_cache, jnp.int32(i))
                h = after(p, h, o)
            o, k_cache, v_cache = attend(*before(ws[-1], h), k_cache, v_cache, jnp.int32(L - 1))
            # the last layer's second half on the wanted rows only, as with "per_layer"
            return after(ws[-1], h[rows], o[rows]), (k_cache, v_cache)
        before_once, after_once = jax.jit(before), jax.jit(after)
        qkv0 = before_once(ws[0], h)
        # more wanted rows than tokens (speculative decoding's steps take several rows' logits per
        # token row): the last layer runs on every token and the rows are gathered after it
        gather_after = rows.shape[0] >= h.shape[0]

        def between(i, ws, h, o):
            if i + 1 < L or gather_after:
                h = after_once(ws[i], h, o)
                return (h, *before_once(ws[i + 1], h)) if i + 1 < L else (h, *(jnp.zeros(x.shape, x.dtype)
                                                                                for x in qkv0))
            # the last layer: its second half on the wanted rows only, written to the carry's first
            # S rows (S <= T), the other rows keeping this layer's input, never read. Not scattered
            # back to `rows`: a padding row there names a real token, and where the matmuls skip
            # padding (numba_matmul.row_limits) its result differs from that token's, so a
            # scatter with both could keep either.
            h = jax.lax.dynamic_update_slice(h, after_once(ws[i], h[rows], o[rows]), (0, 0))
            return (h, *(jnp.zeros(x.shape, x.dtype) for x in qkv0))  # after the last layer: unused

        branches = [functools.partial(between, i) for i in range(L)]

        def layer(carry, _):
            h, q, k, v, k_cache, v_cache, li = carry
            o, k_cache, v_cache = attend(q, k, v, k_cache, v_cache, li)
            h, q, k, v = jax.lax.switch(li, branches, ws, h, o)
            return (h, q, k, v, k_cache, v_cache, li + 1), None

        (h, *_, k_cache, v_cache, _), _ = jax.lax.scan(
            layer, (h, *qkv0, k_cache, v_cache, jnp.int32(0)), None, length=L)
        return (h[rows] if gather_after else h[: rows.shape[0]]), (k_cache, v_cache)


def paged_attend(batch, backend: str, cfg: ModelConfig, cos, sin, page: int, mesh=None,
                 local_rope: tuple[Any, Any] | None = None) -> Attend:
    """The attention step of one layer over the paged KV pool: rope on q and k, write this step's k
    and v into the pool at batch.slot_mapping, attend with `backend` (a pallas_kernels backend name).
    q [T, N, H], k, v [T, K, H]; cos, sin [T, H/2] from rope_cos_sin.

    With a mesh whose "model" axis has several devices, the step runs per shard under shard_map:
    each device's own heads of q/k/v and of the pool (split on K), the batch metadata replicated,
    so neither the write nor the kernel needs a collective (parallel.py).

    cfg: the model as it runs (its heads those of the run layout, parallel.HeadLayout), which gives
    the heads, the attention scale, the sliding window and the layers that use it
    (ModelConfig.layer_window; the others read the whole context), Gemma 2's score soft-capping
    and the KV layer groups; page: the pool's P. A backend's per-step values (AttentionBackend.prepare)
    are computed here, once, outside the layer loop. A layer's window and rope are picked by its
    traced index, so one compiled layer serves both kinds of layer. local_rope: (cos, sin) of the
    sliding layers where they have a rope of their own (Gemma 3).

    With G > 1 KV layer groups (core/kv_groups.py) the batch carries each group's block tables
    [G, S, M] and slot mapping [G, T] (block_table.group_tables), the pool holds pages of Lg
    layers, and layer l reads and writes row slot(l) of its group's pages; a batch built with one
    [S, M] table (tests) runs every layer on it, the pool then [L, NB, ...]."""
    record = backends.get(backend)
    k_transposed = record.k_transposed
    rope_write = record.rope_write
    window, sliding, softcap, sm_scale = cfg.sliding_window, cfg.sliding_layers, cfg.attn_softcap, cfg.sm_scale
    groups = kv_groups(cfg)
    grouped = groups.num_groups > 1 and batch.block_tables.ndim == 3
    meta = None
    if record.prepare is not None:
        N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        n = shards_of(mesh)

        def prepare(block_tables):
            return record.prepare(batch.token_ids.shape[0], N // n, K // n, H, page, block_tables, batch.seq_lens,
                                  batch.query_start_loc, batch.num_seqs)

        meta = jax.vmap(prepare)(batch.block_tables) if grouped else prepare(batch.block_tables)
    if grouped:
        group_of = jnp.asarray(groups.group_of(), jnp.int32)
        slot_of = jnp.asarray(groups.slot_of(), jnp.int32)

    def local(q, k, v, k_cache, v_cache, li, cos, sin, window, slot_mapping, block_tables, seq_lens,
              query_start_loc, num_seqs, meta):
        fused = rope_write(q, k, v, cos, sin, k_cache, v_cache, li, slot_mapping) if rope_write else None
        if fused is None:
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            k_cache, v_cache = write_kv(k_cache, v_cache, li, k, v, slot_mapping, k_transposed=k_transposed)
        else:  # the backend's own kernel for both (AttentionBackend.rope_write)
            q, k_cache, v_cache = fused
        o = paged_attention(q, k_cache, v_cache, li, block_tables, seq_lens, query_start_loc, num_seqs,
                            sm_scale=sm_scale, backend=backend, meta=meta, window=window, softcap=softcap)
        return o, k_cache, v_cache

    if shards_of(mesh) > 1:
        heads, pool, rep = P(None, "model", None), P(None, None, "model"), P()
        # check_vma off: the kernels (custom calls, pallas_call) carry no varying-axes annotations
        local = jax.shard_map(local, mesh=mesh, in_specs=(heads, heads, heads, pool, pool, *(rep,) * 10),
                              out_specs=(heads, pool, pool), check_vma=False)

    def attend(q, k, v, k_cache, v_cache, li):
        c, s, w = cos, sin, window
        if sliding is not None:  # this layer's kind, from its index
            is_sliding = jnp.any(li == jnp.asarray(sliding, jnp.int32))
            if window is not None:
                w = jnp.where(is_sliding, window, NO_WINDOW)
            if local_rope is not None:
                c, s = jnp.where(is_sliding, local_rope[0], cos), jnp.where(is_sliding, local_rope[1], sin)
        row, slot_mapping, block_tables, m = li, batch.slot_mapping, batch.block_tables, meta
        if grouped:  # this layer's group: its table, its pages' row for the layer
            g = group_of[li]
            row, slot_mapping, block_tables = slot_of[li], slot_mapping[g], block_tables[g]
            m = None if meta is None else jax.tree.map(lambda x: x[g], meta)
        o, k_cache, v_cache = local(q, k, v, k_cache, v_cache, row, c, s, w, slot_mapping, block_tables,
                                    batch.seq_lens, batch.query_start_loc, batch.num_seqs, m)
        T, N, H = o.shape
        return o.reshape(T, N * H), k_cache, v_cache

    return attend


def embed_tokens(embed, token_ids, mesh=None, scale=None, dtype=None):
    """embed [V, D] at token_ids i32[T] -> [T, D]. With the vocabulary split over the mesh's "model"
    axis, each shard looks up the ids in its own range and the shards' partial rows are summed (one
    all-reduce of [T, D]), so the table is never gathered whole. A quantized table (quantize.py)
    comes with `scale` f32[V], one per row, or (scale, minimum) [V, D / GROUP] of a grouped one, and
    its rows are dequantized to `dtype`."""
    def rows_of(table, ids, s):
        if s is None:
            return table[ids]
        return _rows(table[ids], tuple(a[ids] for a in s) if isinstance(s, tuple) else s[ids], dtype)

    if shards_of(mesh) == 1 or embed.shape[0] % shards_of(mesh):
        return rows_of(embed, token_ids, scale)

    def local(table, ids, s=None):
        V_local = table.shape[0]
        start = jax.lax.axis_index("model") * V_local
        inside = (ids >= start) & (ids < start + V_local)
        rows = rows_of(table, jnp.where(inside, ids - start, 0), s)
        return jax.lax.psum(jnp.where(inside[:, None], rows, jnp.zeros((), rows.dtype)), "model")

    args, specs = (embed, token_ids), (P("model", None), P())
    if scale is not None:
        args, specs = (*args, scale), (*specs, P("model"))
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)(*args)


def token_rows(model, token_ids, dtype):
    """The model's embeddings of token_ids i32[T] -> [T, D] in `dtype`: from its table (embed_tokens),
    or, where untie_lm_head moved the table into a packed lm_head, from the head's panels (row v of
    the table is column v of the head: panel v // NR, lane v % NR, with its scales)."""
    if model.embed is not None:
        return embed_tokens(model.embed[...], token_ids, model.mesh, scale_of(model, "embed"), dtype)
    from pallas_kernels.numba_matmul import NR

    panel, lane = token_ids // NR, token_ids % NR
    rows = model.lm_head[...][panel, :, lane]
    s = scale_of(model, "lm_head")
    if s is None:
        return rows
    if isinstance(s, tuple):  # packed [P, D / GROUP, NR] like the head
        return _rows(rows, tuple(a[panel, :, lane] for a in s), dtype)
    return _rows(rows, s[token_ids], dtype)


def _rows(rows, s, dtype):
    """Quantized table rows [T, D] with their scales (f32[T], or (scale, minimum) [T, D / GROUP])
    dequantized to `dtype`."""
    if isinstance(s, tuple):
        return dequantize(rows.T, s[0].T, dtype, minimum=s[1].T).T
    return (rows.astype(jnp.float32) * s[:, None]).astype(dtype)


def logits_weight(model):
    """(w [D, V], its scales as quantize.scale_of gives them) of the model's logits: its lm_head, or
    the tied table's transpose, whose grouped scales transpose with it."""
    if model.lm_head is not None:
        return model.lm_head[...], scale_of(model, "lm_head")
    s = scale_of(model, "embed")
    return model.embed[...].T, (tuple(a.T for a in s) if isinstance(s, tuple) else s)


def vocab_logits(hs, w, mesh=None, scale=None):
    """hs [S, D] @ w [D, V] -> logits f32[S, V]. With w's vocabulary split over the mesh's "model"
    axis, each shard computes its own columns and the [S, V] rows are gathered whole: only logits
    cross between devices, never the weight (left to itself, XLA gathered the weight instead to
    produce the replicated logits the sampler reads: docs/PERFORMANCE.md, "Several devices (simulated on the CPU)").
    A w packed by pack_linear_weights (one device) goes through numba_matmul's kernel. A quantized
    w (quantize.py) comes with `scale` f32[V], or (scale, minimum) [D / GROUP, V] of a grouped one."""
    grouped = isinstance(scale, tuple)
    if w.ndim == 3:
        from pallas_kernels import numba_matmul

        return numba_matmul.matmul(hs.astype(jnp.float32), w, *(scale if grouped else (scale,)))

    def dot(h, w, s=None):
        if s is None:
            return jnp.dot(h, w, preferred_element_type=jnp.float32)
        if isinstance(s, tuple):
            return quantized_dot(h, w, s[0], jnp.float32, minimum=s[1])
        return quantized_dot(h, w, s, jnp.float32)

    if shards_of(mesh) == 1 or w.shape[1] % shards_of(mesh):
        return dot(hs, w, scale)

    def local(h, w, s=None):
        return jax.lax.all_gather(dot(h, w, s), "model", axis=1, tiled=True)

    args, specs = (hs, w), (P(), P(None, "model"))
    if scale is not None:
        args, specs = (*args, scale), (*specs, P(None, "model") if grouped else P("model"))
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)(*args)


def shards_of(mesh) -> int:
    """The "model" axis size of an engine's mesh (1 without one)."""
    return 1 if mesh is None else mesh.shape["model"]


def linear(p: dict, x, name: str, bias: str = ""):
    """x @ p[name], plus p[bias] when the layer has that bias. A weight packed by
    pack_linear_weights ([N / NR, K, NR]) goes through numba_matmul's kernel; a quantized one
    (quantize.py: p[name + SCALE] beside it, and p[name + MINIMUM] for a grouped one) is
    dequantized inside the matmul."""
    w, s, lowest = p[name], p.get(name + SCALE), p.get(name + MINIMUM)
    if w.ndim == 3:
        from pallas_kernels import numba_matmul  # numba is imported only where it is used

        y = numba_matmul.matmul(x, w, s, lowest)
    elif s is not None:
        y = quantized_dot(x, w, s, minimum=lowest)
    else:
        y = x @ w
    return y + p[bias] if bias in p else y


LINEAR_WEIGHTS = ("qkv", "o_proj", "gate_up", "down")  # the layer spec's weights that linear() reads


def untie_lm_head(model) -> bool:
    """Give a model whose lm_head is its embedding (tied: `lm_head` None, logits against embed.T)
    its own [D, V] copy of it, where numba_matmul can pack that copy; True if it did. For engines
    with packed matmuls (runner.py): the logits then run in the packed kernel instead of XLA's dot
    over the transposed table (which ran at half its speed for a decode step's rows:
    docs/PERFORMANCE.md, "Weight quantization and the fp8 KV cache, demo model"). The table moves
    rather than being copied: token_rows reads the embeddings from the head's panels (a gather of T
    rows of D values), so the table is held once."""
    from pallas_kernels import numba_matmul

    if getattr(model, "lm_head", False) is not None or getattr(model, "embed", None) is None:
        return False
    head = model.embed[...].T
    if not numba_matmul.packable(head):
        return False
    model.lm_head = nnx.data(nnx.Param(head))  # None made it a static attribute
    if getattr(model, "embed" + SCALE, None) is not None:  # a quantized table: its rows' scales go along
        model.lm_head_scale = nnx.data(nnx.Param(model.embed_scale[...].T))
    if getattr(model, "embed" + MINIMUM, None) is not None:  # and a grouped one's minimums
        model.lm_head_min = nnx.data(nnx.Param(model.embed_min[...].T))
    for name in ("embed", "embed" + SCALE, "embed" + MINIMUM):
        setattr(model, name, None)
    return True


def pack_linear_weights(state):
    """A model's state (nnx.split) with every layer's linear weights and the lm_head that
    numba_matmul can take (float32, columns a multiple of its panel) packed for it, the rest
    untouched. For engines where the platform record's packed_matmuls says so (runner.py); one weight is packed at
    a time, and the unpacked array is dropped as its packed one replaces it. A grouped int8
    weight's scales and minimums f16[K / GROUP, N] (quantize.py) are packed the same way."""
    from pallas_kernels import numba_matmul

    groups = tuple(n + suffix for n in LINEAR_WEIGHTS for suffix in (SCALE, MINIMUM))
    head_groups = ["lm_head" + SCALE], ["lm_head" + MINIMUM]

    def pack(path, x):
        keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
        names = [k for k in keys if isinstance(k, str)]
        linear = names[:1] == ["layers"] and any(n in LINEAR_WEIGHTS for n in names[-2:])
        grouping = x.ndim == 2 and ((names[:1] == ["layers"] and any(n in groups for n in names[-2:]))
                                    or names[:1] in head_groups)
        if grouping and x.shape[1] % numba_matmul.NR == 0:  # packable just when its weight is
            packed = numba_matmul.pack(np.asarray(x))
            return jax.device_put(packed, x.sharding) if isinstance(x, jax.Array) else jnp.asarray(packed)
        if (linear or names[:1] == ["lm_head"]) and numba_matmul.packable(x):
            packed = numba_matmul.pack(np.asarray(x))
            # where the weight was (a data-parallel replica's weights live on its own device)
            return jax.device_put(packed, x.sharding) if isinstance(x, jax.Array) else jnp.asarray(packed)
        return x

    return jax.tree_util.tree_map_with_path(pack, state)


def qkv_projection(p: dict, x, N: int, K: int, H: int, shards: int = 1):
    """The fused q/k/v projection of x [T, D] -> q [T, N, H], k, v [T, K, H]. A weight packed by
    pack_linear_weights, without a bias, on one shard, goes through numba_matmul.matmul_split, which
    writes q, k and v to buffers of their own: the kernels after it take them as they are, where the
    slices of one [T, (N + 2 K) H] output were copies (docs/PERFORMANCE.md, "Decisions in the code")."""
    w = p["qkv"]
    if w.ndim == 3 and "qkv_bias" not in p and shards == 1:
        from pallas_kernels import numba_matmul

        if (N * H) % numba_matmul.NR == 0 and (K * H) % numba_matmul.NR == 0:
            q, k, v = numba_matmul.matmul_split(x, w, (N * H, K * H, K * H), p.get("qkv" + SCALE),
                                                p.get("qkv" + MINIMUM))
            T = x.shape[0]
            return q.reshape(T, N, H), k.reshape(T, K, H), v.reshape(T, K, H)
    return split_qkv(linear(p, x, "qkv", "qkv_bias"), N, K, H, shards)


def split_qkv(qkv, N: int, K: int, H: int, shards: int = 1):
    """The fused projection's output [T, (N + 2 K) H] -> q [T, N, H], k, v [T, K, H]. Its columns
    are in `shards` contiguous groups, each [q k v] of that shard's heads (parallel.shard_interleave),
    so the split never moves data between shards."""
    T = qkv.shape[0]
    n, k = N // shards, K // shards
    x = qkv.reshape(T, shards, (n + 2 * k) * H)
    return (x[..., : n * H].reshape(T, N, H), x[..., n * H : (n + k) * H].reshape(T, K, H),
            x[..., (n + k) * H :].reshape(T, K, H))


def split_gate_up(x, shards: int = 1):
    """The fused gate/up output [T, 2 F] (in `shards` groups of [gate up]) -> gate, up [T, F]."""
    T = x.shape[0]
    g, u = jnp.split(x.reshape(T, shards, x.shape[1] // shards), 2, axis=-1)
    return g.reshape(T, -1), u.reshape(T, -1)


def silu_gate_up(p: dict, x, shards: int = 1):
    """silu(gate) * up [T, F] of the fused gate/up projection of x. A weight packed by
    pack_linear_weights, without a bias, goes through numba_matmul's fused kernel, where the
    [T, 2 F] projection is never written out."""
    w = p["gate_up"]
    if w.ndim == 3 and "gate_up_bias" not in p and w.shape[0] % 2 == 0:
        from pallas_kernels import numba_matmul

        return numba_matmul.matmul_silu_mul(x, w, p.get("gate_up" + SCALE), p.get("gate_up" + MINIMUM))
    g, u = split_gate_up(linear(p, x, "gate_up", "gate_up_bias"), shards)
    return jax.nn.silu(g) * u


def rms_norm(x, weight, eps: float):
    """HF's LlamaRMSNorm: normalise in float32, scale in the weight's dtype."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight * x32.astype(weight.dtype)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig):
    """Inverse frequencies f32[H/2], with the configured scaling applied."""
    H = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    sc = dict(cfg.rope_scaling or ())
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / sc["factor"]
    if kind == "llama3":
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return jnp.where(medium, smoothed, scaled)
    raise ValueError(f"rope scaling type {kind!r} is not supported; supported: default, linear, llama3")


def rope_cos_sin(cfg: ModelConfig, positions):
    """cos, sin f32[T, H/2] of positions i32[T]."""
    angles = positions.astype(jnp.float32)[:, None] * rope_inv_freq(cfg)[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """HF's rotate-half convention. x [T, heads, H]; cos, sin [T, H/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


# put(weight name, host array) -> the weight on the device(s), in the model's dtype: the loader's
# placer (loader.placer), which puts each tensor into its shards as soon as it is read, so the host
# holds one tensor at a time and no device ever a whole copy of a split one
Put = Callable[[str, np.ndarray], Any]


def layers_from_checkpoint(per_name: dict[str, Callable[[int], np.ndarray]], num_layers: int, put: Put,
                           layout: str) -> dict[str, Any]:
    """DecoderLayers' pure state dict: per_name maps each name of the layer spec to a function of
    the layer index that reads that weight from a checkpoint (already [in, out], fused)."""
    L = num_layers
    if layout != "stacked":
        return {"per_layer": {i: {n: put(n, fn(i)) for n, fn in per_name.items()} for i in range(L)}}

    def stack(name: str, fn: Callable[[int], np.ndarray]):
        first = fn(0)
        out = np.empty((L, *first.shape), np.float32)  # filled in place: one host copy at a time
        out[0] = first
        for i in range(1, L):
            out[i] = fn(i)
        return put(name, out)

    return {"stacked": {n: stack(n, fn) for n, fn in per_name.items()}}


# -- the pre-norm decoder layer as Hugging Face names its weights (Llama family, Gemma) -------------
def decoder_layer_spec(cfg: ModelConfig, norm_fill: float = 1.0) -> LayerSpec:
    """One layer's weights: norms (initialised to `norm_fill`: 1 for w, 0 for Gemma's 1 + w), fused
    q/k/v, q/k norms (cfg.qk_norm), o, fused gate/up and down, with the biases the config asks for,
    and Gemma 2's feed-forward norms (cfg.sandwich_norms)."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    spec: LayerSpec = {"input_norm": ((D,), norm_fill), "qkv": ((D, (N + 2 * K) * H), None)}
    if cfg.qkv_bias:
        spec["qkv_bias"] = (((N + 2 * K) * H,), 0.0)
    if cfg.qk_norm:
        spec["q_norm"] = ((H,), norm_fill)
        spec["k_norm"] = ((H,), norm_fill)
    spec["o_proj"] = ((N * H, D), None)
    if cfg.o_bias:
        spec["o_bias"] = ((D,), 0.0)
    spec["post_norm"] = ((D,), norm_fill)
    if cfg.sandwich_norms:
        spec["pre_ff_norm"] = ((D,), norm_fill)
        spec["post_ff_norm"] = ((D,), norm_fill)
    if cfg.num_experts:  # models/moe.py: the router and every expert's fused gate/up and down
        E, Fe = cfg.num_experts, cfg.moe_intermediate_size
        spec["router"] = ((D, E), None)
        spec["experts_gate_up"] = ((E, D, 2 * Fe), None)
        spec["experts_down"] = ((E, Fe, D), None)
        if Fs := cfg.shared_expert_intermediate_size:  # Qwen2-MoE's shared expert and its gate
            spec["shared_gate_up"] = ((D, 2 * Fs), None)
            spec["shared_down"] = ((Fs, D), None)
            spec["shared_gate"] = ((D, 1), None)
        return spec
    spec["gate_up"] = ((D, 2 * F), None)
    if cfg.mlp_bias:
        spec["gate_up_bias"] = ((2 * F,), 0.0)
    spec["down"] = ((F, D), None)
    if cfg.mlp_bias:
        spec["down_bias"] = ((D,), 0.0)
    return spec


def hf_decoder_weights(cfg: ModelConfig, get: Callable[[str], np.ndarray], put: Put, layout: str,
                       shards: int = 1, experts: tuple[str, str, str, str] | None = None) -> dict[str, Any]:
    """HF-named tensors (`get`) -> the pure state dict of a model made of decoder_layer_spec layers
    (embed, layers in `layout`, norm, lm_head unless tied), each tensor placed by `put`; linear
    weights [in, out], fused with their columns grouped per shard (parallel.shard_interleave).
    experts: an MoE layer's names under model.layers.{i}. (router, then each expert's gate, up and
    down with {j} for the expert), read into the stacked [E, ...] weights of models/moe.py."""
    def lw(i: int, name: str) -> np.ndarray:
        return get(f"model.layers.{i}.{name}")

    def fused(i: int, names: list[str]) -> np.ndarray:
        return fused_linear(get, [f"model.layers.{i}.{n}.weight" for n in names], shards)

    def fused_bias(i: int, names: list[str]) -> np.ndarray:
        return shard_interleave([lw(i, f"{n}.bias") for n in names], shards)

    # spec name -> that weight of layer i
    per_name: dict[str, Callable[[int], np.ndarray]] = {
        "input_norm": lambda i: lw(i, "input_layernorm.weight"),
        "qkv": lambda i: fused(i, [f"self_attn.{p}_proj" for p in "qkv"]),
        "o_proj": lambda i: lw(i, "self_attn.o_proj.weight").T,
        "post_norm": lambda i: lw(i, "post_attention_layernorm.weight"),
    }
    if experts is None:
        per_name["gate_up"] = lambda i: fused(i, ["mlp.gate_proj", "mlp.up_proj"])
        per_name["down"] = lambda i: lw(i, "mlp.down_proj.weight").T
    else:
        router, gate, up, down = experts
        E = range(cfg.num_experts)
        per_name["router"] = lambda i: lw(i, f"{router}.weight").T
        # an expert stays whole on one device (expert parallelism): its gate/up columns in one group
        per_name["experts_gate_up"] = lambda i: np.stack([fused_linear(
            get, [f"model.layers.{i}.{gate.format(j=j)}.weight", f"model.layers.{i}.{up.format(j=j)}.weight"])
            for j in E])
        per_name["experts_down"] = lambda i: np.stack([lw(i, f"{down.format(j=j)}.weight").T for j in E])
        if cfg.shared_expert_intermediate_size:  # replicated over devices: whole, one group
            per_name["shared_gate_up"] = lambda i: fused_linear(
                get, [f"model.layers.{i}.mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up")])
            per_name["shared_down"] = lambda i: lw(i, "mlp.shared_expert.down_proj.weight").T
            per_name["shared_gate"] = lambda i: lw(i, "mlp.shared_expert_gate.weight").T
    if cfg.qkv_bias:
        per_name["qkv_bias"] = lambda i: fused_bias(i, [f"self_attn.{p}_proj" for p in "qkv"])
    if cfg.o_bias:
        per_name["o_bias"] = lambda i: lw(i, "self_attn.o_proj.bias")
    if cfg.qk_norm:
        per_name["q_norm"] = lambda i: lw(i, "self_attn.q_norm.weight")
        per_name["k_norm"] = lambda i: lw(i, "self_attn.k_norm.weight")
    if cfg.sandwich_norms:
        per_name["pre_ff_norm"] = lambda i: lw(i, "pre_feedforward_layernorm.weight")
        per_name["post_ff_norm"] = lambda i: lw(i, "post_feedforward_layernorm.weight")
    if cfg.mlp_bias:
        per_name["gate_up_bias"] = lambda i: fused_bias(i, ["mlp.gate_proj", "mlp.up_proj"])
        per_name["down_bias"] = lambda i: lw(i, "mlp.down_proj.bias")
    pure: dict[str, Any] = {
        "embed": put("embed", get("model.embed_tokens.weight")),
        "layers": layers_from_checkpoint(per_name, cfg.num_layers, put, layout),
        "norm": put("norm", get("model.norm.weight")),
    }
    if not cfg.tie_word_embeddings:
        pure["lm_head"] = put("lm_head", get("lm_head.weight").T)
    return pure


def fused_linear(get: Callable[[str], np.ndarray], names: list[str], shards: int = 1) -> np.ndarray:
    """HF linear weights [out, in] of `names`, transposed and concatenated: [in, sum of outs], so
    that one matmul computes them all (fewer, larger dots run faster on every backend); columns
    grouped per shard (parallel.shard_interleave)."""
    return shard_interleave([get(n).T for n in names], shards)
