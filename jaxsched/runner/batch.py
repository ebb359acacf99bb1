"""What goes to the device each step: the BatchDescriptor, and pack() that builds it.

pack() turns a SchedulerOutput into fixed-shape arrays (T tokens, S sequences, both buckets) written
into two preallocated flat numpy buffers, one int32 and one float32. Every field of the descriptor
is a view into them, so a step costs exactly two host-to-device copies whatever the field count;
the jitted step rebuilds the same descriptor on the device from the flat arrays (slicing there is
free). Padding tokens point at slot 0 of the null page; padding rows have no tokens, length 0 and
the null slot's all-null block table. The block tables themselves stay on the device and travel
as changes (block_table.py), so nothing a step sends grows with max_model_len.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field, fields

import numpy as np

from jaxsched import envs
from jaxsched.core.kv_groups import FULL_ATTENTION, KVGroups
from jaxsched.core.limits import MAX_LOGIT_BIAS
from jaxsched.core.request import INT32_MAX, Request, SamplingParams
from jaxsched.core.scheduler import ScheduledRequest, SchedulerOutput
from jaxsched.runner.block_table import BlockTables, write_capacity
from jaxsched.runner.penalties import PENALTY_CAPACITY, PenaltyTables, masked_token_ids, tracks_outputs
from jaxsched.structured.grammar import TokenConstraint, fill_rows, mask_words


def _flat(kind: str, shape):
    """A field that views the `kind` ("i32" / "f32") flat buffer; shape(T, S) gives its shape."""
    return field(metadata={"flat": kind, "shape": shape})


def _tokens(T: int, S: int) -> tuple[int, ...]:
    return (T,)


def _rows(T: int, S: int) -> tuple[int, ...]:
    return (S,)


def _writes(T: int, S: int) -> tuple[int, ...]:
    return (write_capacity(T, S),)


@dataclass
class BatchDescriptor:
    """One step's inputs. numpy views on the host, jax arrays inside the jitted step.

    Shapes use the glossary: T tokens (bucket), S sequences (bucket), M max blocks per sequence,
    C block table writes (block_table.write_capacity). The fields made with _flat are, in this
    order, the layout of the two flat buffers.
    """

    token_ids: object = _flat("i32", _tokens)  # i32[T]  new tokens, request after request
    positions: object = _flat("i32", _tokens)  # i32[T]  their positions in their sequences
    # i32[T]  block * P + offset; padding -> 0 (null page). With G > 1 layer groups: the first group's
    # pages on the host, every group's, i32[G, T], inside the program (block_table.group_tables)
    slot_mapping: object = _flat("i32", _tokens)
    query_start_loc: object = _flat("i32", lambda T, S: (S + 1,))  # i32[S + 1] where each request's tokens start
    seq_lens: object = _flat("i32", _rows)  # i32[S]  KV length of each request after this step
    row_slots: object = _flat("i32", _rows)  # i32[S]  each row's slot in the device block table; padding -> 0
    table_writes: object = _flat("i32", _writes)  # i32[C]  flat indices of the table entries this step changes
    table_values: object = _flat("i32", _writes)  # i32[C]  their block ids (padding: 0 at 0)
    logits_indices: object = _flat("i32", _rows)  # i32[S]  index in T of each request's last new token
    num_seqs: object = _flat("i32", lambda T, S: (1,))  # i32[1]  real requests; rows past it are padding
    top_k: object = _flat("i32", _rows)  # i32[S]  0 = off
    seeds: object = _flat("i32", _rows)  # i32[S]  per-request sampling seed
    sample_index: object = _flat("i32", _rows)  # i32[S]  output index of the token sampled this step
    num_logprobs: object = _flat("i32", _rows)  # i32[S]  -1 = no logprobs
    penalty_num: object = _flat("i32", _rows)  # i32[S]  valid entries of the row's penalty table; 0 = none
    masked: object = _flat("i32", _rows)  # i32[S]  1: the row's token_mask applies (a constrained request)
    # i32[S]  j + 1: this penalised row's table lacks the token the previous step sampled for its
    # row j, which only the device has yet (overlapped scheduling): the sampler folds it in; 0 = none
    pending_src: object = _flat("i32", _rows)
    # i32[T]  0: the token id is in token_ids; j + 1: it is the token the previous step sampled for
    # its row j, which only the device has yet (overlapped scheduling)
    from_prev: object = _flat("i32", _tokens)
    # i32[S]  proposals (speculative decoding) among the row's tokens, its last ones: a program of
    # width Q takes the row's logits at its last num_spec + 1 tokens (and Q - 1 - num_spec copies of the last)
    num_spec: object = _flat("i32", _rows)
    # i32[T]  in a step with a row owing prompt logprobs: the prompt token each token's logits
    # score (the next one), -1 where none is owed; read by the prompt logprobs programs only
    prompt_targets: object = _flat("i32", _tokens)
    temperature: object = _flat("f32", _rows)  # f32[S]  0 = greedy
    top_p: object = _flat("f32", _rows)  # f32[S]
    min_p: object = _flat("f32", _rows)  # f32[S]
    presence_penalty: object = _flat("f32", _rows)  # f32[S]
    frequency_penalty: object = _flat("f32", _rows)  # f32[S]
    repetition_penalty: object = _flat("f32", _rows)  # f32[S]
    # i32[S, M] each row's blocks (unused -> 0, the null page): table[row_slots] inside the model's
    # program (block_table.py), i32[G, S, M] with G > 1 layer groups; None on the host, which never
    # builds the whole table
    block_tables: object = None
    # host only: the block table writes past C, (indices, values), applied before the step
    table_overflow: tuple[np.ndarray, np.ndarray] | None = None
    # The penalty tables are not in the flat buffers: W is sized for the longest possible history
    # (up to max_model_len), so they go to the device only in steps where a request uses them.
    penalty_ids: object = None  # i32[S, W] distinct prompt/output token ids of each penalised row
    penalty_counts: object = None  # f32[S, W] output count of each; MASKED (-1) = blocked by min_tokens
    # i32[S] inside the sampler: the token pending_src names (-1 = none), for the penalty tables;
    # None on the host and in batches built by hand (nothing to fold in)
    pending_token: object = None
    has_penalties: bool = False  # host only: whether any row of this step uses them
    # Token constraints and logit_bias (grammar.py), sent like the penalty tables: only in steps
    # where a row uses them (None: the sampler skips that stage, as in tests that build a batch by hand).
    token_mask: object = None  # i32[S, VW] bit t % 32 of word t // 32 allows token t; all ones = free
    bias_ids: object = None  # i32[S, LB] token ids whose logits get a bias; V (out of range) = no entry
    bias_values: object = None  # f32[S, LB] the bias added to each
    has_mask: bool = False  # host only: whether any row of this step is constrained
    width: int = 1  # host only: Q, the logits positions per row (SchedulerOutput.width)
    prompt_logprobs: bool = False  # host only: the step runs the prompt logprobs programs
    has_bias: bool = False  # host only: whether any row of this step has a logit_bias
    # host only: a constrained row's next mask needs the token this step samples, so the next step
    # must wait for it (penalty tables need not: the device folds the pending token in, pending_src)
    needs_tokens: bool = False
    # host only: request id -> why its row could not be stored; such a row runs with neutral values
    # and the engine fails that request (and only it) after the step
    rejected: dict[str, str] = field(default_factory=dict)
    flat_i32: object = None  # the int32 buffer every int field views (host only)
    flat_f32: object = None  # the float32 buffer every float field views (host only)

    @property
    def num_tokens_bucket(self) -> int:  # T
        return int(self.token_ids.shape[0])

    @property
    def num_seqs_bucket(self) -> int:  # S
        return int(self.seq_lens.shape[0])

    @classmethod
    def from_flat(cls, flat_i32, flat_f32, T: int, S: int, penalty_ids=None,
                  penalty_counts=None, token_mask=None, bias_ids=None, bias_values=None) -> BatchDescriptor:
        """Rebuild the descriptor from the flat buffers (numpy or jax arrays alike), plus the
        penalty tables (fresh zero tables of PENALTY_CAPACITY columns when not given) and the
        constraint tables (absent when not given)."""
        if penalty_ids is None:
            penalty_ids = np.zeros((S, PENALTY_CAPACITY), np.int32)
            penalty_counts = np.zeros((S, PENALTY_CAPACITY), np.float32)
        kw = {"penalty_ids": penalty_ids, "penalty_counts": penalty_counts, "token_mask": token_mask,
              "bias_ids": bias_ids, "bias_values": bias_values}
        for name, start, stop, shape in _layout("i32", T, S):
            kw[name] = flat_i32[start:stop].reshape(shape)
        for name, start, stop, shape in _layout("f32", T, S):
            kw[name] = flat_f32[start:stop].reshape(shape)
        return cls(**kw, flat_i32=flat_i32, flat_f32=flat_f32)


@functools.cache
def _layout(which: str, T: int, S: int) -> tuple[tuple[str, int, int, tuple[int, ...]], ...]:
    """(name, start, stop, shape) of each field of the "i32" or "f32" buffer; cached per bucket
    because pack() runs every step."""
    out, offset = [], 0
    for f in fields(BatchDescriptor):
        if f.metadata.get("flat") == which:
            shape = f.metadata["shape"](T, S)
            size = int(np.prod(shape))
            out.append((f.name, offset, offset + size, shape))
            offset += size
    return tuple(out)


# The int32 row fields the sampler reads, in the order the model program passes them on. The
# sampler is a program of its own, compiled per S alone (runner.py), so it cannot take the int32
# buffer, whose length depends on T: the model program hands it these as one i32[7 S] array. The
# float32 buffer holds sampler fields only, each [S], so it goes to the sampler program as it is.
# pending_token is no buffer field: the model program takes it from the previous step's sampled ids
# (pending_src names the row).
SAMPLER_I32 = ("top_k", "seeds", "sample_index", "num_logprobs", "penalty_num", "masked", "pending_token")


@dataclass
class SamplerRows:
    """What the sampler reads of a step: BatchDescriptor's row fields and tables of the same names,
    rebuilt inside the sampler program (S rows; shapes as in BatchDescriptor)."""

    top_k: object
    seeds: object
    sample_index: object
    num_logprobs: object
    penalty_num: object
    masked: object
    pending_token: object
    temperature: object
    top_p: object
    min_p: object
    presence_penalty: object
    frequency_penalty: object
    repetition_penalty: object
    penalty_ids: object
    penalty_counts: object
    token_mask: object
    bias_ids: object
    bias_values: object

    @classmethod
    def from_flat(cls, rows_i32, flat_f32, S: int, penalty_ids, penalty_counts, token_mask, bias_ids,
                  bias_values) -> SamplerRows:
        """rows_i32: i32[7 S], SAMPLER_I32's fields one after the other; flat_f32: the step's float32
        buffer."""
        kw = {name: rows_i32[i * S : (i + 1) * S] for i, name in enumerate(SAMPLER_I32)}
        for name, start, stop, shape in _layout("f32", 0, S):  # row fields only: T does not matter
            kw[name] = flat_f32[start:stop].reshape(shape)
        return cls(**kw, penalty_ids=penalty_ids, penalty_counts=penalty_counts, token_mask=token_mask,
                   bias_ids=bias_ids, bias_values=bias_values)


def flat_sizes(T: int, S: int) -> tuple[int, int]:
    """Lengths of the int32 and float32 flat buffers for a (T, S) bucket."""
    return _layout("i32", T, S)[-1][2], _layout("f32", T, S)[-1][2]


class BatchPacker:
    """Owns the preallocated flat buffers (sized for the largest bucket) and fills them each step."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, block_size: int,
                 penalty_capacity: int = PENALTY_CAPACITY, vocab_size: int = 0, grammar_executor=None,
                 groups: KVGroups = FULL_ATTENTION) -> None:
        """vocab_size: V, the width of the token masks and the logit_bias tables' "no entry" id;
        0 packs no constraint tables (the sampler then skips those stages). groups: the model's KV
        layer groups (core/kv_groups.py): a row's block list holds G pages per block."""
        self.P = block_size
        self.G = groups.num_groups
        self.V = vocab_size
        self.grammar_executor = grammar_executor  # a callable giving llguidance's thread pool, or None
        n_i32, n_f32 = flat_sizes(max_tokens, max_seqs)
        VW = mask_words(vocab_size) if vocab_size else 1
        # Two sets of buffers, used in turns: a CPU device may read a step's numpy input in place
        # (zero copy) while it runs, and with overlapped scheduling the next step is packed then.
        self._buffers = [(np.zeros(n_i32, np.int32), np.zeros(n_f32, np.float32),
                          np.zeros((max_seqs, penalty_capacity), np.int32),  # rows past penalty_num are
                          np.zeros((max_seqs, penalty_capacity), np.float32),  # never read: no clearing
                          np.zeros((max_seqs, VW), np.int32),
                          np.zeros((max_seqs, MAX_LOGIT_BIAS), np.int32),
                          np.zeros((max_seqs, MAX_LOGIT_BIAS), np.float32))
                         for _ in range(2)]
        self._turn = 0
        self.max_seqs = max_seqs
        self.penalties = PenaltyTables(penalty_capacity)
        # one slot per row a step can have
        self.tables = BlockTables(max_seqs, max_blocks_per_seq * self.G, self.G, groups.sliding)
        self._prev_rows: dict[str, int] = {}  # request id -> its row in the last packed step, if it sampled
        # (buffer set, Q) -> penalty tables of a step verifying proposals, S Q rows (_pack_wide_penalties)
        self._wide_penalties: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        # (buffer set, Q) -> token masks of a step verifying a grammar row's proposals, S Q rows
        self._wide_masks: dict[tuple[int, int], np.ndarray] = {}
        # the last packed step, when a next step of the same rows each one token further can be
        # packed from its buffers (_pack_steady); None otherwise
        self._steady: _Steady | None = None
        self._views: dict[tuple[int, int, int], dict[str, np.ndarray]] = {}  # _descriptor's
        self.verify_steady = envs.verify_pack()
        self._scratch: tuple[np.ndarray, ...] | None = None  # _verify's buffers
        self.steady_packs = 0  # steps packed by _pack_steady (for tests and benchmarks)
        self.steady_gathers = 0  # of those, the ones whose rows were fewer than the last step's

    def forget_prev(self) -> None:
        """After a failed step: no pending token will come from the steps packed so far, and the
        device's block table is a fresh one of zeros (ModelRunner.recover_pool)."""
        self._prev_rows = {}
        self._steady = None
        self.tables.reset()

    def end_requests(self, out: SchedulerOutput) -> None:
        """Let go of what the requests that left the running batch with this step's decisions
        (finished, aborted, preempted, swapped out) held: their block table slots and penalty
        tables. pack() calls it; a step without rows calls it alone."""
        self.tables.release(itertools.chain(out.finished_ids, out.preempted, out.swapped_out))
        self.penalties.forget(out.finished_ids)

    def pack(self, out: SchedulerOutput) -> BatchDescriptor:
        """The step's arrays. A request whose values do not fit them (which make_request's checks
        should make impossible) cannot fail the step for the others: its row runs with neutral
        sampling values (and 0 for a token id that does not fit), and the batch names it in
        `rejected`."""
        rows = list(out.scheduled.values())
        buffers = self._buffers[self._turn]  # both tries fill the same set: the other may be in use
        self.end_requests(out)
        if self._steady is not None:
            try:
                b = self._pack_steady(out, rows, buffers)
            except (OverflowError, ValueError):  # a value that does not fit: the full pack names the row
                if self.verify_steady and self._full_pack_fits(out, rows):
                    raise  # not a value that does not fit: the steady path itself failed
                b = None
            if b is not None:
                if self.verify_steady:
                    self._verify(out, rows, b)
                b.table_overflow = self.tables.take_writes(b.table_writes, b.table_values)
                self._turn ^= 1
                self.steady_packs += 1
                if len(self._prev_rows) != len(rows):  # rows ended since the last step
                    self._prev_rows = {row.request.request_id: i for i, row in enumerate(rows)}
                return b
        try:
            b = self._pack(out, rows, {}, buffers)
        except (OverflowError, ValueError):  # numpy: a Python int out of bounds for int32
            bad = {i: why for i, row in enumerate(rows) if (why := unstorable(row.request)) is not None}
            if not bad:
                raise
            b = self._pack(out, rows, bad, buffers)
            b.rejected = {rows[i].request.request_id: why for i, why in bad.items()}
        # the writes both tries staged (block_table.py): a try that raised staged some already
        b.table_overflow = self.tables.take_writes(b.table_writes, b.table_values)
        self._steady = _Steady.after(out, rows, b, self._turn)
        self._turn ^= 1
        self._prev_rows = {row.request.request_id: i for i, row in enumerate(rows) if row.samples}
        return b

    def _pack_steady(self, out: SchedulerOutput, rows: list[ScheduledRequest],
                     buffers: tuple[np.ndarray, ...]) -> BatchDescriptor | None:
        """Steady decoding, packed from the last step's buffers: the last step's rows, or those of
        them still running, in the same order, each with one new token right after the last step's.
        The rows' fields are copied (or gathered) from the last step's buffers; only those that move
        per token are written (positions, lengths, slots, output indices, the token ids or from_prev,
        a block table row that grew). None when the step is not such a step (pack() then packs it in
        full). A row's sampling values are the last step's: they are read, and checked to fit, when
        the row is packed in full (SamplingParams are frozen). What it gives equals the full pack's
        arrays (`verify_steady` compares every step; the tests turn it on). Updates the record to
        this step's rows."""
        st = self._steady
        n = len(rows)
        if not n or out.has_block_moves:
            return None
        reqs = [row.request for row in rows]
        if n == st.n and all(a is b for a, b in zip(reqs, st.reqs)):
            keep = None  # the same rows
        else:  # rows ended since: the others keep their order
            where = {id(r): i for i, r in enumerate(st.reqs)}
            ks = [where.get(id(r), -1) for r in reqs]
            if ks[0] < 0 or any(a >= b for a, b in itertools.pairwise(ks)):
                return None
            keep = np.array(ks, np.int32)
        # the engine sets a request's constraint before it runs; one attached later (tests/test_hostile.py)
        # must still get its mask row
        if not all(row.num_new_tokens == 1 and row.samples and row.from_prev is st.from_prev
                   and row.request.constraint is None for row in rows):
            return None
        seq_lens = np.fromiter((r.num_computed_tokens for r in reqs), np.int32, n)
        last_lens, last_blocks = (st.seq_lens, st.n_blocks) if keep is None else (st.seq_lens[keep], st.n_blocks[keep])
        if not (seq_lens == last_lens + 1).all():
            return None
        T, S, P = out.token_bucket, out.seq_bucket, self.P
        b = self._descriptor(buffers, T, S)
        if keep is None and (T, S) == (st.T, st.S):  # the same layout: the last step's buffers as they are
            last = self._descriptor(self._buffers[st.turn], T, S)
            b.flat_i32[:] = last.flat_i32
            b.flat_f32[:] = last.flat_f32
        else:
            old = self._descriptor(self._buffers[st.turn], st.T, st.S)
            k = np.arange(n) if keep is None else keep
            b.flat_i32[:] = 0
            b.flat_f32[:] = 0
            for name in _ROW_VALUES:
                getattr(b, name)[:n] = getattr(old, name)[k]
            b.top_p[n:] = 1.0
            b.num_logprobs[n:] = -1
            b.query_start_loc[: n + 1] = np.arange(n + 1, dtype=np.int32)
            b.query_start_loc[n + 1 :] = n
            b.logits_indices[:n] = np.arange(n, dtype=np.int32)
            b.num_seqs[0] = n
        b.table_writes[:] = 0  # the last step's writes are on the device
        b.table_values[:] = 0
        b.seq_lens[:n] = seq_lens
        pos = b.positions[:n]
        pos[:] = seq_lens - 1
        b.sample_index[:n] = [row.output_index for row in rows]
        if st.from_prev:  # each row's token is the one the last step sampled in its row there
            b.from_prev[:n] = np.arange(1, n + 1, dtype=np.int32) if keep is None else keep + 1
        else:
            b.token_ids[:n] = [r.token_slice(p, p + 1)[0] for r, p in zip(reqs, pos.tolist())]
        n_blocks = np.fromiter((len(row.block_ids) for row in rows), np.int32, n)
        changed = n_blocks != last_blocks  # a row that entered a new block
        trimmed = st.trimmed[:0]
        if self.tables.sliding:  # or whose window passed one (only models with sliding windows)
            trimmed = np.fromiter((row.blocks_trimmed for row in rows), np.int32, n)
            changed |= trimmed != (st.trimmed if keep is None else st.trimmed[keep])
        slots = b.row_slots[:n]
        for i in np.flatnonzero(changed).tolist():
            self.tables.sync(int(slots[i]), rows[i].block_ids, rows[i].blocks_trimmed)
        b.slot_mapping[:n] = self.tables.mirror[slots, pos // P * self.G] * P + pos % P
        self._steady = _Steady(T, S, n, reqs, self._turn, seq_lens, n_blocks, trimmed, st.from_prev)
        self.steady_gathers += keep is not None
        return b

    def _descriptor(self, buffers: tuple[np.ndarray, ...], T: int, S: int) -> BatchDescriptor:
        """A fresh descriptor over a buffer set's (T, S) views. The views are made once per set and
        bucket pair (slicing twenty-odd fields is a sizeable share of a small step's packing)."""
        key = (id(buffers), T, S)
        kw = self._views.get(key)
        if kw is None:
            n_i32, n_f32 = flat_sizes(T, S)
            i32, f32, pen_ids, pen_counts, mask, bias_ids, bias_values = buffers
            tables = (mask[:S], bias_ids[:S], bias_values[:S]) if self.V else (None, None, None)
            proto = BatchDescriptor.from_flat(i32[:n_i32], f32[:n_f32], T, S, pen_ids[:S], pen_counts[:S],
                                              *tables)
            kw = self._views[key] = {f.name: getattr(proto, f.name) for f in fields(BatchDescriptor)
                                     if f.metadata.get("flat") or f.name in _VIEWS}
        return BatchDescriptor(**kw)

    def _scratch_buffers(self) -> tuple[np.ndarray, ...]:
        if self._scratch is None:  # a third set, kept: _descriptor caches views by buffer set
            self._scratch = tuple(np.zeros_like(x) for x in self._buffers[0])
        return self._scratch

    def _full_pack_fits(self, out: SchedulerOutput, rows: list[ScheduledRequest]) -> bool:
        """Whether the full pack of the step takes every row's values (the check's twin of pack()'s
        fallback: a steady pack that raises where the full pack does not is a bug of its own)."""
        try:
            self._pack(out, rows, {}, self._scratch_buffers())
        except (OverflowError, ValueError):
            return False
        return True

    def _verify(self, out: SchedulerOutput, rows: list[ScheduledRequest], b: BatchDescriptor) -> None:
        """Pack the step in full into a scratch set of buffers and check _pack_steady's arrays equal
        it, but for the block table writes: the steady pack staged them, so the full pack finds
        none to make; the table's mirror is checked against the rows' block lists instead."""
        full = self._pack(out, rows, {}, self._scratch_buffers())
        for name in ("flat_i32", "flat_f32"):
            got, want = getattr(b, name), getattr(full, name)
            layout = _layout(name[-3:], full.num_tokens_bucket, full.num_seqs_bucket)
            bad = [f for f, start, stop, _ in layout if f not in ("table_writes", "table_values")
                   and not np.array_equal(got[start:stop], want[start:stop])]
            if bad:
                raise AssertionError(f"the steady pack differs from the full pack in {bad}")
        self.tables.check(rows, b.row_slots[: len(rows)])

    def _pack(self, out: SchedulerOutput, sched: list[ScheduledRequest], bad: dict[int, str],
              buffers: tuple[np.ndarray, ...]) -> BatchDescriptor:
        T, S, P = out.token_bucket, out.seq_bucket, self.P
        b = self._descriptor(buffers, T, S)
        b.flat_i32[:] = 0
        b.flat_f32[:] = 0
        n = out.num_seqs
        b.width = out.width
        reqs = [row.request for row in sched]
        lens = np.fromiter((row.num_new_tokens for row in sched), np.int32, n)
        total = int(lens.sum())
        # where each row starts: the scheduler counted this step's tokens as computed already, but
        # for the proposals (which follow them)
        starts = np.fromiter((r.num_computed_tokens for r in reqs), np.int32, n) - lens
        known = lens  # the tokens the request holds (proposals are the row's last ones)
        if out.width > 1:
            spec = np.fromiter((len(row.spec_token_ids) for row in sched), np.int32, n)
            b.num_spec[:n] = spec
            starts += spec
            known = lens - spec

        qsl = b.query_start_loc
        np.cumsum(lens, out=qsl[1 : n + 1])
        qsl[n + 1 :] = total  # padding rows: empty ranges at the end
        b.seq_lens[:n] = starts + lens
        b.logits_indices[:n] = qsl[1 : n + 1] - 1
        b.num_seqs[0] = n

        # Token ids: one list slice per request, never a per-token Python loop. A token the host has
        # not read yet (a row's only token, then) is taken on the device from the last step's output.
        slices = [r.token_slice(s, s + k) for r, s, k in zip(reqs, starts.tolist(), known.tolist())]
        if out.width > 1:
            for i, row in enumerate(sched):
                if row.spec_token_ids:
                    slices[i] = slices[i] + list(row.spec_token_ids)
        prev = [i for i, row in enumerate(sched) if row.from_prev]
        src: list[int] = []
        if prev:
            for i in prev:
                j = self._prev_rows.get(reqs[i].request_id)
                if j is None:  # pragma: no cover - a pending token always comes from the last packed step
                    raise RuntimeError(f"request {reqs[i].request_id!r} has a pending token from no step")
                slices[i] = [0]
                src.append(j + 1)
            b.from_prev[qsl[prev]] = src
        for i in bad:  # keep the ids that fit: another request may share this step's blocks of this row
            slices[i] = [t if 0 <= t <= INT32_MAX else 0 for t in slices[i]]
        b.token_ids[:total] = np.fromiter(itertools.chain.from_iterable(slices), np.int32, total)
        rows = np.repeat(np.arange(n, dtype=np.int32), lens)
        pos = b.positions
        pos[:total] = np.arange(total, dtype=np.int32) + np.repeat(starts - qsl[:n], lens)

        if out.prompt_logprobs:
            b.prompt_logprobs = True
            b.prompt_targets[:] = -1
            for i, row in enumerate(sched):
                r = row.request
                if r.sampling_params.prompt_logprobs is None:
                    continue
                # positions p in [start, hi) score prompt token p + 1
                hi = min(row.start + row.num_new_tokens, r.num_prompt_tokens - 1)
                if hi > row.start:
                    at = int(qsl[i])
                    b.prompt_targets[at : at + hi - row.start] = r.prompt_token_ids[row.start + 1 : hi + 1]

        # Block tables: each row's slot on the device, and the entries that changed (block_table.py)
        slots = b.row_slots[:n]
        slots[:] = self.tables.place(sched)
        p = pos[:total]
        # the first group's pages (with several groups the program derives each group's from the table)
        b.slot_mapping[:total] = self.tables.mirror[slots[rows], p // P * self.G] * P + p % P

        # Sampling arrays: one column per field from one pass over the requests.
        params = [r.sampling_params for r in reqs]
        seeds = [r.sample_seed for r in reqs]
        for i in bad:
            params[i], seeds[i] = _NEUTRAL, 0
        b.temperature[:n] = [sp.temperature for sp in params]
        b.top_p[:n] = [sp.top_p for sp in params]
        b.min_p[:n] = [sp.min_p for sp in params]
        b.top_k[:n] = [sp.top_k for sp in params]
        np.maximum(b.top_k[:n], 0, out=b.top_k[:n])  # -1 and 0 both mean off
        b.seeds[:n] = seeds
        b.sample_index[:n] = [row.output_index for row in sched]
        b.num_logprobs[:n] = [-1 if sp.logprobs is None else sp.logprobs for sp in params]
        b.top_p[n:] = 1.0
        b.num_logprobs[n:] = -1

        pending = dict(zip(prev, src))
        narrow = params
        if out.width > 1 and any(sp.uses_penalties and row.samples for sp, row in zip(params, sched)):
            self._pack_wide_penalties(b, sched, params, out.width)
            narrow = ()  # done
        for i, sp in enumerate(narrow):
            # a prefill chunk that samples nothing needs no table (its logits are dropped)
            if sp.uses_penalties and sched[i].samples:
                r = reqs[i]
                b.presence_penalty[i] = sp.presence_penalty
                b.frequency_penalty[i] = sp.frequency_penalty
                b.repetition_penalty[i] = sp.repetition_penalty
                # The table holds the outputs read so far; a token still pending (a from_prev row) is
                # folded in on the device (pending_src), so this step need not wait for it. min_tokens
                # counts it too: output_index is the outputs before this row's sample, read or not.
                b.penalty_num[i] = self.penalties.fill_row(r, b.penalty_ids[i], b.penalty_counts[i],
                                                           sched[i].output_index)
                if tracks_outputs(sp):
                    b.pending_src[i] = pending.get(i, 0)
                # a min_tokens row past its minimum has an empty table: the step runs no penalty stage
                b.has_penalties |= bool(b.penalty_num[i] or b.pending_src[i])
        self.penalties.prune((r.request_id for r in reqs), 4 * self.max_seqs)
        if self.V:
            self._pack_constraints(b, sched, reqs, params, bad)
        return b

    def _pack_wide_penalties(self, b: BatchDescriptor, sched: list[ScheduledRequest], params: list[SamplingParams],
                             Q: int) -> None:
        """A step that verifies proposals: penalty tables of its S Q sampler rows, as the sampler of
        width Q reads them (row i Q + j: row i's table with its first j proposals counted as outputs,
        and min_tokens counting them too), so that each position samples as the step without
        proposals would there. penalty_num holds each row's largest count; a position's entries
        past its own are no entry (id V)."""
        S, W = b.num_seqs_bucket, b.penalty_ids.shape[1]
        key = (self._turn, Q)
        if key not in self._wide_penalties:
            self._wide_penalties[key] = (np.zeros((self.max_seqs * Q, W), np.int32),
                                         np.zeros((self.max_seqs * Q, W), np.float32))
        ids, counts = (x[: S * Q] for x in self._wide_penalties[key])
        for i, (row, sp) in enumerate(zip(sched, params)):
            if not (sp.uses_penalties and row.samples):
                continue
            b.presence_penalty[i] = sp.presence_penalty
            b.frequency_penalty[i] = sp.frequency_penalty
            b.repetition_penalty[i] = sp.repetition_penalty
            drafts = list(row.spec_token_ids)
            nums = [self.penalties.fill_row(row.request, ids[i * Q + j], counts[i * Q + j],
                                            row.output_index + min(j, len(drafts)), drafts[:j])
                    for j in range(Q)]
            most = max(nums)
            for j, n in enumerate(nums):
                ids[i * Q + j, n:most] = self.V
            b.penalty_num[i] = most
            b.has_penalties |= bool(most)
        b.penalty_ids, b.penalty_counts = ids, counts

    def _pack_wide_masks(self, b: BatchDescriptor, sched: list[ScheduledRequest],
                         constrained: list[tuple[TokenConstraint, int]], Q: int) -> None:
        """A step that verifies a grammar row's proposals: token masks of its S Q sampler rows (row
        i Q + j: row i's mask after its first j proposals, the matcher walked through them and
        back: TokenConstraint.fill_ahead), so that each position samples as the step without
        proposals would there."""
        S, VW = b.num_seqs_bucket, b.token_mask.shape[1]
        key = (self._turn, Q)
        if key not in self._wide_masks:
            self._wide_masks[key] = np.empty((self.max_seqs * Q, VW), np.int32)
        mask = self._wide_masks[key][: S * Q]
        mask[:] = -1  # all ones: the rows without a constraint may take any token
        for c, i in constrained:
            c.fill_ahead(mask[i * Q : (i + 1) * Q], sched[i].spec_token_ids)
        b.token_mask = mask

    def _pack_constraints(self, b: BatchDescriptor, sched: list[ScheduledRequest], reqs: list[Request],
                          params: list[SamplingParams], bad: dict[int, str]) -> None:
        """The token masks and logit_bias tables of the rows that sample this step."""
        constrained, biased = [], []
        for i, (row, r, sp) in enumerate(zip(sched, reqs, params)):
            if not row.samples or i in bad:
                continue
            if r.constraint is not None:
                constrained.append((r.constraint, i))
                b.needs_tokens = b.needs_tokens or r.constraint.depends_on_tokens
            if sp.logit_bias:
                biased.append((i, sp.logit_bias))
        Q = b.width
        if constrained and Q > 1 and any(sched[i].spec_token_ids and c.depends_on_tokens for c, i in constrained):
            self._pack_wide_masks(b, sched, constrained, Q)
        elif constrained:
            b.token_mask[:] = -1  # all ones: the rows without a constraint may take any token
            fill_rows(constrained, b.token_mask, self.grammar_executor() if self.grammar_executor else None)
        if constrained:
            b.masked[[i for _, i in constrained]] = 1
            b.has_mask = True
        if biased:
            b.bias_ids[:] = self.V
            b.bias_values[:] = 0.0
            for i, items in biased:
                b.bias_ids[i, : len(items)] = [t for t, _ in items]
                b.bias_values[i, : len(items)] = [v for _, v in items]
            b.has_bias = True


# the descriptor's fields that view the buffers besides the flat ones (_descriptor)
_VIEWS = ("penalty_ids", "penalty_counts", "token_mask", "bias_ids", "bias_values", "flat_i32", "flat_f32")

# the row fields a steady step takes from the last step's rows as they are (batch.BatchPacker._pack_steady);
# the others are the same for every such row (0) or move with each token
_ROW_VALUES = ("top_k", "seeds", "num_logprobs", "temperature", "top_p", "min_p", "row_slots")

# set (to anything but 0) in the environment: every step packed by BatchPacker._pack_steady is
# checked against the full pack (tests/conftest.py sets it for the whole suite)
VERIFY_ENV = envs.VERIFY_PACK


@dataclass
class _Steady:
    """What _pack_steady needs of the last packed step: its buckets and rows, which buffer set holds
    it, its rows' lengths and block counts, and whether its rows took their token from the device."""

    T: int
    S: int
    n: int
    reqs: list[Request]
    turn: int
    seq_lens: np.ndarray  # i32[n]
    n_blocks: np.ndarray  # i32[n]
    trimmed: np.ndarray  # i32[n] ScheduledRequest.blocks_trimmed (empty without sliding groups)
    from_prev: bool

    @classmethod
    def after(cls, out: SchedulerOutput, rows: list[ScheduledRequest], b: BatchDescriptor, turn: int) -> _Steady | None:
        """The record of a fully packed step, or None when its next step cannot be packed from it:
        any row not one sampled token (prefill), rows mixing tokens read and pending, or a request
        whose tables move with every token (penalties, min_tokens, a logit_bias; a grammar's rows are
        checked at every steady step)."""
        n = len(rows)
        if (not n or b.rejected or b.has_penalties or b.has_mask or b.has_bias or b.needs_tokens or out.width > 1
                or out.prompt_logprobs):
            return None
        if not all(row.num_new_tokens == 1 and row.samples for row in rows):
            return None
        from_prev = rows[0].from_prev
        if any(row.from_prev is not from_prev for row in rows):
            return None
        reqs = [row.request for row in rows]
        if any(r.sampling_params.uses_penalties or r.sampling_params.logit_bias for r in reqs):
            return None
        return cls(out.token_bucket, out.seq_bucket, n, reqs, turn, b.seq_lens[:n].copy(),
                   np.fromiter((len(row.block_ids) for row in rows), np.int32, n),
                   np.fromiter((row.blocks_trimmed for row in rows), np.int32, n), from_prev)


_NEUTRAL = SamplingParams(temperature=0.0)  # what a rejected row samples with (its token is dropped)


def unstorable(req: Request) -> str | None:
    """Why `req` cannot be written into a step's int32 arrays, or None when it can."""
    sp = req.sampling_params
    values = {"top_k": sp.top_k, "logprobs": sp.logprobs or 0, "seed": req.sample_seed}
    for name, v in values.items():
        if not -INT32_MAX - 1 <= v <= INT32_MAX:
            return f"{name} {v} does not fit the engine's int32 arrays"
    ids = [*req.prompt_token_ids, *req.output_token_ids]
    if sp.min_tokens:
        ids += masked_token_ids(sp, req.eos_token_ids)
    if any(not 0 <= t <= INT32_MAX for t in ids):
        return "a token id does not fit the engine's int32 arrays"
    return None
