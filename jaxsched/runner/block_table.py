"""The requests' block tables, kept on the device and sent to it as changes.

A step's attention needs each row's block table, i32[S, M] with M = max_model_len / P. Sent whole
each step it grows with max_model_len, not with the step: at 131,072 tokens, 16-token pages and
128 rows, 4 MiB a step before the model runs. Instead the table lives on the device, one row per
*slot*, and a step carries only what changed since the last one (as vLLM's GPU model runner v2
stages block table writes):

  table     i32[R + 1, M] on the device, donated to every model program and updated in place;
            slot 0 is the null slot (all zeros, the null page), slots 1..R belong to requests
  row_slots i32[S]  the slot of each row of the step (padding rows: the null slot)
  writes    i32[C]  flat indices slot * M + column of the entries that changed
  values    i32[C]  their new block ids; padding entries write 0 at index 0 (the null slot's first
            entry, which holds 0), so a zeroed buffer is a step without changes

The program applies the writes, then gathers table[row_slots] -> [S, M] once, outside the layer
loop. C is a fixed capacity per bucket pair (write_capacity): every block a step's own tokens can
enter fits; the rare step that changes more (a long prefix-cache hit, a swap-in) sends the rest
first through a program of its own, in chunks of OVERFLOW_CHUNK.

With sliding-window layer groups (core/kv_groups.py) a request's list holds G pages per block,
block i of group g at i * G + g, and so does its row: the table is i32[R + 1, M * G], and the
program splits the rows it gathers into each group's [S, M] table. A sliding group's pages that the
window has passed are freed by the block manager, their entries set to the null page in its list;
the row's `blocks_trimmed` says how many blocks that holds, and the entries are zeroed here as it
grows. Several new tokens per row (speculative decoding) are just more new blocks.

A request keeps its slot while it holds blocks: until it finishes, or is preempted or swapped out.
The block manager only ever appends to a request's block list, and gives a request a new list
object when it allocates again after a free, so the host tells changes apart cheaply: the same
list with more entries sends its new ones; another list (a request back from preemption or swap)
is written whole, and the entries past its end that the slot held before are zeroed, so unused
entries always read the null page. A host mirror of the table keeps the slot mapping's lookups on
the host and lets tests check that the device has what the block manager says.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

NULL_SLOT = 0
OVERFLOW_CHUNK = 4096  # writes per call of the overflow program (model_runner.ModelRunner)


def write_capacity(T: int, S: int) -> int:
    """C, the writes a (T, S) step carries in its own buffer: one per token and one per row, so
    every block this step's tokens enter fits (P >= 8 makes that T / 8 + S at most), and a prefix
    hit or a zeroed tail of up to T - T / 8 entries more."""
    return T + S


class BlockTables:
    """The host's side: which slot each request has, the mirror of the device table, and the writes
    not yet sent."""

    def __init__(self, num_slots: int, max_blocks: int, groups: int = 1, sliding: tuple[int, ...] = ()) -> None:
        """max_blocks: a row's entries, M * G; groups: G; sliding: the groups whose pages are freed
        once the window passes them."""
        self.M = max_blocks
        self.G, self.sliding = groups, sliding
        self.mirror = np.zeros((num_slots + 1, max_blocks), np.int32)  # i32[R + 1, M]
        self._slot: dict[str, int] = {}  # request id -> its slot
        self._free = list(range(num_slots, 0, -1))  # pop() hands out 1, 2, ...
        self._list: list[Sequence[int] | None] = [None] * (num_slots + 1)  # the block list each slot holds
        self._written = [0] * (num_slots + 1)  # its entries written (the rest of the row is 0)
        self._trimmed = [0] * (num_slots + 1)  # its blocks whose sliding entries are zeroed
        self._writes: list[np.ndarray] = []  # flat indices not yet sent
        self._values: list[np.ndarray] = []

    def release(self, request_ids: Iterable[str]) -> None:
        """Free the slots of requests that no longer hold blocks (finished, preempted, swapped out).
        Their rows keep their entries until the slot's next owner overwrites or zeroes them."""
        for rid in request_ids:
            slot = self._slot.pop(rid, None)
            if slot is not None:
                self._free.append(slot)

    def place(self, rows) -> np.ndarray:
        """The slots of a step's rows (ScheduledRequests, in batch order), i32[n], staging the writes
        that bring each slot's row up to the row's block list."""
        slots = np.empty(len(rows), np.int32)
        for i, row in enumerate(rows):
            rid = row.request.request_id
            slot = self._slot.get(rid)
            if slot is None:
                slot = self._take(rid, rows)
            slots[i] = slot
            self.sync(slot, row.block_ids, row.blocks_trimmed)
        return slots

    def sync(self, slot: int, blocks: Sequence[int], trimmed: int = 0) -> None:
        """Stage the writes that make `slot`'s row hold `blocks` (then zeros), of which the first
        `trimmed` blocks' sliding entries are the null page."""
        n, done = len(blocks), self._written[slot]
        if blocks is self._list[slot]:
            if n > done:
                self._stage(slot, done, np.asarray(blocks[done:], np.int32))
                self._written[slot] = n
            if trimmed > self._trimmed[slot]:  # pages the window passed since: zeroed in place
                cols = np.array([i * self.G + g for i in range(self._trimmed[slot], trimmed) for g in self.sliding],
                                np.int32)
                self.mirror[slot, cols] = 0
                self._writes.append(slot * self.M + cols)
                self._values.append(np.zeros(cols.size, np.int32))
                self._trimmed[slot] = trimmed
            return
        # another list: written whole, and the old entries past its end zeroed
        new = np.zeros(max(n, done), np.int32)
        new[:n] = blocks
        self._stage(slot, 0, new)
        self._list[slot], self._written[slot], self._trimmed[slot] = blocks, n, trimmed

    def _stage(self, slot: int, start: int, values: np.ndarray) -> None:
        if values.size > self.M - start:
            raise ValueError(f"a block table of {start + values.size} blocks does not fit M = {self.M}")
        self.mirror[slot, start : start + values.size] = values
        self._writes.append(np.arange(slot * self.M + start, slot * self.M + start + values.size, dtype=np.int32))
        self._values.append(values)

    def _take(self, rid: str, rows) -> int:
        """A slot for `rid`: a free one, or else one whose request is not in this step (its owner
        left without being released; it gets a slot again, written whole, when it next runs)."""
        if not self._free:
            here = {row.request.request_id for row in rows}
            owner = next(r for r in self._slot if r not in here)
            self.release([owner])
        slot = self._free.pop()
        self._slot[rid] = slot
        return slot

    def take_writes(self, writes: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Move the staged writes into a step's buffers (zeroed: padding writes 0 at 0); those past
        their capacity are returned as (indices, values), to be applied before the step."""
        if not self._writes:
            return None
        idx = np.concatenate(self._writes)
        val = np.concatenate(self._values)
        self._writes, self._values = [], []
        C = writes.size
        writes[: min(C, idx.size)] = idx[:C]
        values[: min(C, idx.size)] = val[:C]
        return (idx[C:], val[C:]) if idx.size > C else None

    def reset(self) -> None:
        """Forget every slot and write (after a failed step, whose table the device may have lost:
        the caller gives the device a zeroed table)."""
        R = len(self._list) - 1
        self.__init__(R, self.M, self.G, self.sliding)

    def check(self, rows, slots: np.ndarray) -> None:
        """The mirror holds each row's block list, then zeros (tests: the verify-pack mode)."""
        for row, slot in zip(rows, slots.tolist()):
            n = len(row.block_ids)
            if list(self.mirror[slot, :n]) != list(row.block_ids) or self.mirror[slot, n:].any():
                raise AssertionError(f"slot {slot} of request {row.request.request_id!r} does not hold its "
                                     f"block list")


def apply_writes(table, writes, values):
    """The device table (a jax array, i32[R + 1, M]) with a step's writes applied (its i32[C]
    flat indices and values). Padding entries all write 0 at index 0, the null slot's own value."""
    return table.reshape(-1).at[writes].set(values).reshape(table.shape)


def step_block_tables(table, batch):
    """Inside a model program: (the table with the step's writes, the rows' block tables [S, M * G])."""
    table = apply_writes(table, batch.table_writes, batch.table_values)
    return table, table[batch.row_slots]


def group_tables(rows, batch, groups: int, block_size: int):
    """Inside a model program, with G > 1 layer groups: the rows' tables [S, M * G] -> each group's
    block tables i32[G, S, M] and slot mapping i32[G, T] (a token's page in each group; padding
    tokens the null page's first slot, as the host's slot_mapping has them)."""
    import jax.numpy as jnp  # the host side of this module is numpy alone

    S, MG = rows.shape
    tables = rows.reshape(S, MG // groups, groups).transpose(2, 0, 1)
    T = batch.positions.shape[0]
    qsl = batch.query_start_loc
    # each token's row: the count of rows that start at or before it (a scatter and a cumsum, no
    # search loop); tokens past the real ones are padding
    starts = jnp.zeros(T + 1, jnp.int32).at[qsl[1:]].add(1)
    row = jnp.clip(jnp.cumsum(starts)[:T], 0, S - 1)
    real = jnp.arange(T, dtype=jnp.int32) < qsl[batch.num_seqs[0]]
    pos = batch.positions
    pages = tables[:, row, pos // block_size]  # [G, T]
    return tables, jnp.where(real[None, :], pages * block_size + pos % block_size, 0)
