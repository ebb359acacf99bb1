"""Tensor parallelism: how a model's heads and weights are laid out over the "model" axis of a mesh.

One engine runs on a `jax.sharding.Mesh` with axes ("data", "model") over its devices (shape
(1, N): data-parallel cores are separate engine cores on disjoint device groups, core_client.py).
Weights are Megatron-style: the fused q/k/v and gate/up projections are column-parallel (over heads
and the intermediate size), o and down row-parallel (XLA inserts the all-reduce after them), the
embedding and lm_head split over the vocabulary, norms replicated. The KV pool is split on its
KV-head axis and attention runs per shard under shard_map (layers.paged_attend), so kernels need
no collective.

Head counts that do not divide by the shard count are made to, once, when the weights load
(HeadLayout): KV heads are replicated (each shard keeps a copy of the head its query heads read) or
padded with zero heads, whichever leaves fewer KV heads per device, and query heads are padded so
that every shard has the same number; padded heads have zero weights in and out, so outputs are
unchanged. The intermediate size is padded with zero columns the same way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxsched.models.model_config import ModelConfig

MESH_AXES = ("data", "model")

# Layer weight names (layers.decoder_layer_spec) by how they split over "model".
_COLUMN = ("qkv", "gate_up")  # [D, out]: out split
_COLUMN_BIAS = ("qkv_bias", "gate_up_bias")  # [out]
_ROW = ("o_proj", "down")  # [in, D]: in split
_EXPERTS = ("experts_gate_up", "experts_down")  # [E, ...]: whole experts per device (models/moe.py)


@dataclass(frozen=True)
class HeadLayout:
    """The heads a model runs with over `shards` devices, and which checkpoint head each one is.

    q_src[i] is the checkpoint's query head that run head i computes (None: a zero pad head), kv_src
    likewise for KV heads; run query heads [j * G', (j + 1) * G') read run KV head j (G' = N' / K').
    Shard s holds the contiguous range s of both, so K' and N' divide by shards.
    """

    shards: int
    q_src: tuple[int | None, ...]  # N' entries
    kv_src: tuple[int | None, ...]  # K' entries
    ffn: int  # F' >= the checkpoint's F, a multiple of shards (zero columns pad it)

    @property
    def identity(self) -> bool:
        return (self.q_src == tuple(range(len(self.q_src))) and self.kv_src == tuple(range(len(self.kv_src))))

    def apply(self, cfg: ModelConfig) -> ModelConfig:
        """The model config as it runs: N', K' and F'."""
        return dataclasses.replace(cfg, num_heads=len(self.q_src), num_kv_heads=len(self.kv_src),
                                   intermediate_size=self.ffn)

    def describe(self, cfg: ModelConfig) -> str:
        """One log line: what was replicated or padded, if anything."""
        parts = []
        if len(self.kv_src) != cfg.num_kv_heads:
            pads = self.kv_src.count(None)
            how = f"{pads} zero heads added" if pads else "each replicated"
            parts.append(f"KV heads {cfg.num_kv_heads} -> {len(self.kv_src)} ({how})")
        if len(self.q_src) != cfg.num_heads:
            parts.append(f"query heads {cfg.num_heads} -> {len(self.q_src)} (zero heads added)")
        if self.ffn != cfg.intermediate_size:
            parts.append(f"intermediate size {cfg.intermediate_size} -> {self.ffn} (zero columns added)")
        return "; ".join(parts) or "no padding or replication"

    def wrap(self, get: Callable[[str], np.ndarray], cfg: ModelConfig, H: int) -> Callable[[str], np.ndarray]:
        """A getter of Hugging Face-named tensors as the run layout wants them: q/k/v rows and o
        columns picked (zeros for pad heads), gate/up rows and down columns padded to F'. cfg is the
        checkpoint's config."""
        if self.identity and self.ffn == cfg.intermediate_size:
            return get
        F = cfg.intermediate_size

        def pick(w: np.ndarray, src: tuple[int | None, ...], axis: int) -> np.ndarray:
            w = np.moveaxis(w, axis, 0)
            heads = w.reshape(w.shape[0] // H, H, *w.shape[1:])
            out = np.zeros((len(src), *heads.shape[1:]), w.dtype)
            for i, s in enumerate(src):
                if s is not None:
                    out[i] = heads[s]
            return np.moveaxis(out.reshape(len(src) * H, *w.shape[1:]), 0, axis)

        def pad(w: np.ndarray, axis: int) -> np.ndarray:
            widths = [(0, 0)] * w.ndim
            widths[axis] = (0, self.ffn - F)
            return np.pad(w, widths)

        def wrapped(name: str) -> np.ndarray:
            w = get(name)
            if ".self_attn.q_proj." in name:
                return pick(w, self.q_src, 0)
            if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
                return pick(w, self.kv_src, 0)
            if name.endswith(".self_attn.o_proj.weight"):
                return pick(w, self.q_src, 1)
            if ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
                return pad(w, 0)
            if name.endswith(".mlp.down_proj.weight"):
                return pad(w, 1)
            return w

        return wrapped


def head_layout(cfg: ModelConfig, shards: int) -> HeadLayout:
    """The layout of cfg's heads over `shards` devices (module docstring). Two candidates: each KV
    head replicated r = shards / gcd(K, shards) times (its G query heads split over the copies,
    padded to ceil(G / r) each), or K padded with zero heads to a multiple of shards; the one with
    fewer KV heads per device wins (the pool's memory and the bytes attention reads), then the one
    with fewer query heads."""
    N, K, F = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if cfg.num_experts % shards:
        raise ValueError(f"num_experts ({cfg.num_experts}) must be a multiple of tensor_parallel_size ({shards}): "
                         "each device holds whole experts (expert parallelism)")
    G = N // K
    ffn = -(-F // shards) * shards
    r = shards // math.gcd(K, shards)
    g = -(-G // r)
    rep_kv = tuple(k for k in range(K) for _ in range(r))
    rep_q = tuple(k * G + c * g + i if c * g + i < G else None for k in range(K) for c in range(r) for i in range(g))
    Kp = -(-K // shards) * shards
    pad_kv = (*range(K), *[None] * (Kp - K))
    pad_q = (*range(N), *[None] * ((Kp - K) * G))
    candidates = [HeadLayout(shards, rep_q, rep_kv, ffn), HeadLayout(shards, pad_q, pad_kv, ffn)]
    return min(candidates, key=lambda lay: (len(lay.kv_src) // shards, len(lay.q_src)))


def shard_interleave(parts: list[np.ndarray], shards: int) -> np.ndarray:
    """Concatenate `parts` along their last axis so that each of `shards` contiguous column ranges
    holds its own slice of every part: [a_0 b_0 | a_1 b_1 | ...]. A fused projection stored this way
    splits over the "model" axis with each shard computing its own heads of q, k and v (or its own
    gate and up columns); with shards = 1 it is a plain concatenation."""
    split = [np.split(p, shards, axis=-1) for p in parts]
    return np.concatenate([s[i] for i in range(shards) for s in split], axis=-1)


def param_spec(name: str, ndim: int, vocab_split: bool):
    """The PartitionSpec of weight `name` (its key in a model's state dict; a layer weight's name in
    layers.decoder_layer_spec) with `ndim` dimensions: embed / lm_head over the vocabulary (when
    vocab_split), layer weights as _COLUMN / _ROW say (a stacked layout's leading L axis is never
    split), everything else replicated."""
    from jax.sharding import PartitionSpec as P

    if name == "embed":
        return P("model", None) if vocab_split else P()
    if name == "lm_head":
        return P(None, "model") if vocab_split else P()
    lead = (None,) * (ndim - (1 if name in _COLUMN_BIAS else 2))
    if name in _COLUMN:
        return P(*lead, None, "model")
    if name in _COLUMN_BIAS:
        return P(*lead, "model")
    if name in _ROW:
        return P(*lead, "model", None)
    if name in _EXPERTS:
        return P(*(None,) * (ndim - 3), "model", None, None)
    return P()


def place(x, sharding):
    """A host array onto `sharding`: each device receives only its own shard (never a full copy on
    one device), and in a multi-process run each process only its local devices' shards."""
    import jax

    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def make_mesh(devices: list) -> Any:
    """The ("data", "model") mesh of one engine: shape (1, len(devices))."""
    from jax.sharding import Mesh

    return Mesh(np.asarray(devices, dtype=object).reshape(1, len(devices)), MESH_AXES)


def engine_devices(tensor_parallel_size: int, devices=None) -> list:
    """The devices of one engine: `devices` (a data-parallel replica's group) or the first
    tensor_parallel_size of jax.devices(). Raises ValueError when there are too few."""
    import jax

    available = jax.devices()
    if devices is None:
        if tensor_parallel_size > len(available):
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} needs {tensor_parallel_size} devices, but "
                f"{len(available)} {available[0].platform} device(s) are present; lower tensor_parallel_size "
                "(on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N simulates N devices)")
        return available[:tensor_parallel_size]
    devices = list(devices)
    if len(devices) != tensor_parallel_size:
        raise ValueError(f"got {len(devices)} devices for tensor_parallel_size={tensor_parallel_size}")
    return devices
