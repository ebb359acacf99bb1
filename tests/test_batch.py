"""pack(): the device batch built from a scheduler decision. No model, no jax."""

import numpy as np
from test_scheduler import make_sched

from jaxsched.core.request import Request, SamplingParams
from jaxsched.runner.batch import BatchDescriptor, BatchPacker, flat_sizes


def test_pack_mixed_step():
    s, bm = make_sched(num_blocks=32, block_size=8, max_num_seqs=8, budget=32)
    a = Request("a", list(range(100, 120)), SamplingParams(temperature=0.5, top_k=3, seed=7), sample_seed=7)
    b = Request("b", list(range(200, 203)), SamplingParams(logprobs=2, top_p=0.9), sample_seed=11)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    s.update(out, [1, 2])
    a_tokens = a.num_tokens
    c = Request("c", list(range(300, 325)), SamplingParams(min_p=0.1), sample_seed=13)
    s.add_request(c)
    out = s.schedule()  # a and b decode one token each; c prefills its whole prompt (2 + 25 <= 32)
    packer = BatchPacker(32, 8, 16, 8)
    batch = packer.pack(out)
    T, S = out.token_bucket, out.seq_bucket
    assert (batch.num_tokens_bucket, batch.num_seqs_bucket) == (T, S)
    assert list(out.scheduled) == ["a", "b", "c"]
    n_c = out.scheduled["c"].num_new_tokens
    assert [out.scheduled[r].num_new_tokens for r in "ab"] == [1, 1] and n_c == 25
    total = 2 + n_c
    assert batch.num_seqs[0] == 3
    np.testing.assert_array_equal(batch.query_start_loc[:4], [0, 1, 2, total])
    assert (batch.query_start_loc[4:] == total).all()  # padding rows are empty
    np.testing.assert_array_equal(batch.token_ids[:total], [1, 2] + list(range(300, 325)))
    assert (batch.token_ids[total:] == 0).all()
    np.testing.assert_array_equal(batch.positions[:total], [a_tokens - 1, 3] + list(range(25)))
    np.testing.assert_array_equal(batch.seq_lens[:3], [a_tokens, 4, 25])
    assert (batch.seq_lens[3:] == 0).all()
    np.testing.assert_array_equal(batch.logits_indices[:3], [0, 1, total - 1])
    # slot mapping goes through each request's block table
    for row, (rid, sr) in enumerate(out.scheduled.items()):
        blocks = bm.block_ids(rid)
        assert list(sr.block_ids) == blocks  # the scheduler's output carries the block table
        table = packer.tables.mirror[batch.row_slots[row]]  # what the step's writes make of its slot's row
        np.testing.assert_array_equal(table[: len(blocks)], blocks)
        assert (table[len(blocks):] == 0).all()
        lo, hi = batch.query_start_loc[row], batch.query_start_loc[row + 1]
        pos = batch.positions[lo:hi]
        np.testing.assert_array_equal(batch.slot_mapping[lo:hi], np.asarray(blocks)[pos // 8] * 8 + pos % 8)
    assert (batch.slot_mapping[total:] == 0).all() and (batch.row_slots[3:] == 0).all()  # the null slot
    # the writes: every block of the three rows, once, in their slots' rows; padding writes 0 at 0
    n = sum(len(sr.block_ids) for sr in out.scheduled.values())
    assert batch.table_overflow is None and (batch.table_writes[n:] == 0).all() and (batch.table_values[n:] == 0).all()
    got = np.zeros_like(packer.tables.mirror).reshape(-1)
    got[batch.table_writes[:n]] = batch.table_values[:n]
    np.testing.assert_array_equal(got.reshape(packer.tables.mirror.shape), packer.tables.mirror)
    # sampling arrays
    np.testing.assert_allclose(batch.temperature[:3], [0.5, 1.0, 1.0])
    np.testing.assert_array_equal(batch.top_k[:3], [3, 0, 0])
    np.testing.assert_allclose(batch.top_p[:S], [1.0, 0.9] + [1.0] * (S - 2))
    np.testing.assert_allclose(batch.min_p[:3], [0.0, 0.0, 0.1], rtol=1e-6)
    np.testing.assert_array_equal(batch.seeds[:3], [7, 11, 13])
    np.testing.assert_array_equal(batch.sample_index[:3], [1, 1, 0])
    np.testing.assert_array_equal(batch.num_logprobs[:S], [-1, 2] + [-1] * (S - 2))
    # every field is a view of the two flat buffers, which rebuild the same descriptor
    assert (batch.flat_i32.size, batch.flat_f32.size) == flat_sizes(T, S)
    again = BatchDescriptor.from_flat(batch.flat_i32.copy(), batch.flat_f32.copy(), T, S)
    np.testing.assert_array_equal(again.table_writes, batch.table_writes)
    np.testing.assert_array_equal(again.top_p, batch.top_p)


def test_pack_reuses_buffers_without_stale_values():
    s, _ = make_sched(num_blocks=32, block_size=8, max_num_seqs=8, budget=32)
    packer = BatchPacker(32, 8, 16, 8)
    for rid in "abcd":
        s.add_request(Request(rid, [5] * 7, SamplingParams(temperature=0.7)))
    big = packer.pack(s.schedule())
    assert big.num_seqs[0] == 4
    s2, _ = make_sched(num_blocks=32, block_size=8, max_num_seqs=8, budget=32)
    s2.add_request(Request("z", [9], SamplingParams()))
    small = packer.pack(s2.schedule())
    assert small.num_seqs[0] == 1
    assert (small.token_ids[1:] == 0).all() and (small.seq_lens[1:] == 0).all()
    assert (small.temperature[1:] == 0).all() and (small.row_slots[1:] == 0).all()
