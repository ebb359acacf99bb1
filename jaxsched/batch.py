"""What goes to the device each step: the BatchDescriptor, and pack() that builds it.

pack() turns a SchedulerOutput into fixed-shape arrays (T tokens, S sequences, both buckets) written
into two preallocated flat numpy buffers, one int32 and one float32. Every field of the descriptor
is a view into them, so a step costs exactly two host-to-device copies whatever the field count;
the jitted step rebuilds the same descriptor on the device from the flat arrays (slicing there is
free). Padding tokens point at slot 0 of the null page; padding rows have no tokens, length 0 and
an all-null block table.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields

import numpy as np

from jaxsched.block_manager import BlockManager
from jaxsched.scheduler import SchedulerOutput

# Field name -> (dtype, shape as a function of (T, S, M)). Order is the layout of the flat buffers.
_I32_FIELDS: dict[str, object] = {
    "token_ids": lambda T, S, M: (T,),  # i32[T]     new tokens, request after request
    "positions": lambda T, S, M: (T,),  # i32[T]     their positions in their sequences
    "slot_mapping": lambda T, S, M: (T,),  # i32[T]  block * P + offset; padding -> 0 (null page)
    "query_start_loc": lambda T, S, M: (S + 1,),  # i32[S+1] where each request's tokens start in T
    "seq_lens": lambda T, S, M: (S,),  # i32[S]      KV length of each request after this step
    "block_tables": lambda T, S, M: (S, M),  # i32[S, M] each request's blocks; unused -> 0
    "logits_indices": lambda T, S, M: (S,),  # i32[S] index in T of each request's last new token
    "num_seqs": lambda T, S, M: (1,),  # i32[1]      real requests; rows past it are padding
    "top_k": lambda T, S, M: (S,),  # i32[S]         0 = off
    "seeds": lambda T, S, M: (S,),  # i32[S]         per-request sampling seed
    "sample_index": lambda T, S, M: (S,),  # i32[S]  output index of the token sampled this step
    "num_logprobs": lambda T, S, M: (S,),  # i32[S]  -1 = no logprobs
}
_F32_FIELDS: dict[str, object] = {
    "temperature": lambda T, S, M: (S,),  # f32[S]   0 = greedy
    "top_p": lambda T, S, M: (S,),  # f32[S]
    "min_p": lambda T, S, M: (S,),  # f32[S]
}


def _layout(fields_: dict[str, object], T: int, S: int, M: int) -> list[tuple[str, int, tuple[int, ...]]]:
    out, offset = [], 0
    for name, shape_fn in fields_.items():
        shape = shape_fn(T, S, M)
        out.append((name, offset, shape))
        offset += int(np.prod(shape))
    return out


def flat_sizes(T: int, S: int, M: int) -> tuple[int, int]:
    """Lengths of the int32 and float32 flat buffers for a (T, S) bucket."""
    i = _layout(_I32_FIELDS, T, S, M)[-1]
    f = _layout(_F32_FIELDS, T, S, M)[-1]
    return i[1] + int(np.prod(i[2])), f[1] + int(np.prod(f[2]))


@dataclass
class BatchDescriptor:
    """One step's inputs. numpy views on the host, jax arrays inside the jitted step.

    Shapes use the glossary: T tokens (bucket), S sequences (bucket), M max blocks per sequence.
    """

    token_ids: object  # i32[T]
    positions: object  # i32[T]
    slot_mapping: object  # i32[T]
    query_start_loc: object  # i32[S + 1]
    seq_lens: object  # i32[S]
    block_tables: object  # i32[S, M]
    logits_indices: object  # i32[S]
    num_seqs: object  # i32[1]
    top_k: object  # i32[S]
    seeds: object  # i32[S]
    sample_index: object  # i32[S]
    num_logprobs: object  # i32[S]
    temperature: object  # f32[S]
    top_p: object  # f32[S]
    min_p: object  # f32[S]
    flat_i32: object = None  # the int32 buffer every int field views (host only)
    flat_f32: object = None  # the float32 buffer every float field views (host only)

    @property
    def num_tokens_bucket(self) -> int:  # T
        return int(self.token_ids.shape[0])

    @property
    def num_seqs_bucket(self) -> int:  # S
        return int(self.seq_lens.shape[0])

    @classmethod
    def from_flat(cls, flat_i32, flat_f32, T: int, S: int, M: int) -> BatchDescriptor:
        """Rebuild the descriptor from the flat buffers (numpy or jax arrays alike)."""
        kw = {}
        for name, off, shape in _layout(_I32_FIELDS, T, S, M):
            kw[name] = flat_i32[off : off + int(np.prod(shape))].reshape(shape)
        for name, off, shape in _layout(_F32_FIELDS, T, S, M):
            kw[name] = flat_f32[off : off + int(np.prod(shape))].reshape(shape)
        return cls(**kw, flat_i32=flat_i32, flat_f32=flat_f32)


assert [f.name for f in fields(BatchDescriptor)][: len(_I32_FIELDS) + len(_F32_FIELDS)] == [
    *_I32_FIELDS,
    *_F32_FIELDS,
], "BatchDescriptor fields and the flat layout must list the same names in the same order"


class BatchPacker:
    """Owns the preallocated flat buffers (sized for the largest bucket) and fills them each step."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, block_size: int) -> None:
        self.M = max_blocks_per_seq
        self.P = block_size
        n_i32, n_f32 = flat_sizes(max_tokens, max_seqs, max_blocks_per_seq)
        self._i32 = np.zeros(n_i32, np.int32)
        self._f32 = np.zeros(n_f32, np.float32)

    def pack(self, out: SchedulerOutput, block_manager: BlockManager) -> BatchDescriptor:
        T, S, M, P = out.token_bucket, out.seq_bucket, self.M, self.P
        n_i32, n_f32 = flat_sizes(T, S, M)
        b = BatchDescriptor.from_flat(self._i32[:n_i32], self._f32[:n_f32], T, S, M)
        b.flat_i32[:] = 0
        b.flat_f32[:] = 0
        n = out.num_seqs
        reqs = out.requests
        lens = np.asarray(out.num_new_tokens, np.int32)
        total = int(lens.sum())
        starts = np.fromiter((r.num_computed_tokens for r in reqs), np.int32, n)

        qsl = b.query_start_loc
        np.cumsum(lens, out=qsl[1 : n + 1])
        qsl[n + 1 :] = total  # padding rows: empty ranges at the end
        b.seq_lens[:n] = starts + lens
        b.logits_indices[:n] = qsl[1 : n + 1] - 1
        b.num_seqs[0] = n

        # Token ids: one list slice per request, never a per-token Python loop.
        b.token_ids[:total] = np.fromiter(
            itertools.chain.from_iterable(
                r.token_slice(s, s + k) for r, s, k in zip(reqs, starts.tolist(), out.num_new_tokens)
            ),
            np.int32,
            total,
        )
        rows = np.repeat(np.arange(n, dtype=np.int32), lens)
        pos = b.positions
        pos[:total] = np.arange(total, dtype=np.int32) + np.repeat(starts - qsl[:n], lens)

        bt = b.block_tables
        for i, r in enumerate(reqs):
            blocks = block_manager.block_ids(r.request_id)
            bt[i, : len(blocks)] = blocks
        p = pos[:total]
        b.slot_mapping[:total] = bt[rows, p // P] * P + p % P

        for i, r in enumerate(reqs):
            sp = r.sampling_params
            b.temperature[i] = sp.temperature
            b.top_p[i] = sp.top_p
            b.min_p[i] = sp.min_p
            b.top_k[i] = max(0, sp.top_k)
            b.seeds[i] = r.sample_seed
            b.sample_index[i] = r.num_output_tokens
            b.num_logprobs[i] = -1 if sp.logprobs is None else sp.logprobs
        b.top_p[n:] = 1.0
        b.num_logprobs[n:] = -1
        return b
