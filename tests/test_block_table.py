"""The block tables on the device, sent as changes (runner/block_table.py): the host side alone, the
packer's bytes that do not grow with max_model_len, and an engine whose table must equal its
mirror after prefix hits longer than a step's write buffer and swap preemption."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from compiles import no_compilation
from test_parity import SENTENCES
from test_scheduler import make_sched

from jaxsched import LLM, SamplingParams
from jaxsched.core.request import Request
from jaxsched.runner.batch import BatchPacker, flat_sizes
from jaxsched.runner.block_table import BlockTables


def row(rid: str, blocks: list[int]):
    return SimpleNamespace(request=SimpleNamespace(request_id=rid), block_ids=blocks, blocks_trimmed=0)


def sent(t: BlockTables, capacity: int = 64) -> dict[int, int]:
    """The staged writes as {flat index: value}, taken as a step would."""
    w, v = np.zeros(capacity, np.int32), np.zeros(capacity, np.int32)
    extra = t.take_writes(w, v)
    assert extra is None
    return {int(i): int(x) for i, x in zip(w, v) if (i, x) != (0, 0)}


def test_a_growing_list_sends_its_new_blocks_only():
    t = BlockTables(num_slots=2, max_blocks=4)
    a = [5, 6]
    assert t.place([row("a", a)]).tolist() == [1]  # slot 0 is the null slot
    assert sent(t) == {4: 5, 5: 6}
    assert t.place([row("a", a)]).tolist() == [1] and sent(t) == {}  # nothing changed: nothing sent
    a.append(9)
    t.place([row("a", a)])
    assert sent(t) == {6: 9}
    assert t.mirror[1].tolist() == [5, 6, 9, 0] and not t.mirror[0].any()


def test_pages_a_window_passed_are_zeroed_in_place():
    """Two layer groups, the second sliding: a row holds G = 2 entries per block; when the block
    manager frees the sliding pages of the first blocks (their entries the null page in its list,
    blocks_trimmed counting them), only those entries are written, with zeros."""
    t = BlockTables(num_slots=1, max_blocks=8, groups=2, sliding=(1,))
    a = [5, 6, 7, 8, 9, 10]  # blocks 0-2: (global, sliding) pages
    t.place([row("a", a)])
    sent(t)
    a[1] = a[3] = 0  # the window passed blocks 0 and 1
    r = row("a", a)
    r.blocks_trimmed = 2
    t.place([r])
    assert sent(t) == {9: 0, 11: 0}
    assert t.mirror[1].tolist() == [5, 0, 7, 0, 9, 10, 0, 0]
    t.place([r])
    assert sent(t) == {}  # nothing new


def test_a_new_list_is_written_whole_and_the_old_tail_zeroed():
    t = BlockTables(num_slots=1, max_blocks=4)
    t.place([row("a", [1, 2, 3])])
    sent(t)
    t.place([row("a", [7])])  # back from preemption: another list, shorter
    assert sent(t) == {4: 7, 5: 0, 6: 0}
    t.release(["a"])
    t.place([row("b", [8, 9])])  # the freed slot's next owner zeroes nothing it does not cover
    assert sent(t) == {4: 8, 5: 9}
    assert t.mirror[1].tolist() == [8, 9, 0, 0]


def test_a_slot_is_taken_from_a_request_not_in_the_step_when_none_is_free():
    t = BlockTables(num_slots=2, max_blocks=2)
    b = [2]
    t.place([row("a", [1]), row("b", b)])
    sent(t)
    slots = t.place([row("b", b), row("c", [3])])  # "a" left unreleased: its slot goes to "c"
    assert slots.tolist() == [2, 1] and sent(t) == {2: 3}
    assert t.place([row("a", [4])]).tolist() == [2]  # "a" is back: written whole, in the slot "b" had
    assert sent(t) == {4: 4}


def test_writes_past_the_capacity_come_back_for_the_overflow_program():
    t = BlockTables(num_slots=1, max_blocks=16)
    t.place([row("a", list(range(1, 11)))])
    w, v = np.zeros(4, np.int32), np.zeros(4, np.int32)
    extra = t.take_writes(w, v)
    assert w.tolist() == [16, 17, 18, 19] and v.tolist() == [1, 2, 3, 4]
    assert extra[0].tolist() == list(range(20, 26)) and extra[1].tolist() == list(range(5, 11))
    with pytest.raises(ValueError, match="does not fit M = 16"):
        t.place([row("b", list(range(17)))])


def test_nothing_the_packer_sends_grows_with_max_model_len():
    """The flat buffers' sizes depend on the buckets alone; before, they held the [S, M] table."""
    small, large = (BatchPacker(32, 8, M, 8) for M in (12, 16384))
    for packer in (small, large):
        s, _ = make_sched(num_blocks=32, block_size=8, max_num_seqs=8, budget=32)
        for rid in "abc":
            s.add_request(Request(rid, list(range(1, 20)), SamplingParams()))
        out = s.schedule()
        b = packer.pack(out)
        assert (b.flat_i32.size, b.flat_f32.size) == flat_sizes(out.token_bucket, out.seq_bucket)
    assert small.tables.mirror[:4, :12].tolist() == large.tables.mirror[:4, :12].tolist()


def long_prompts(llm, n: int, shared_tokens: int):
    tok = llm.get_tokenizer()
    shared = (tok.encode(" ".join(SENTENCES)) * 20)[:shared_tokens]
    return [{"prompt_token_ids": shared + tok.encode(s)[: 2 + i]} for i, s in enumerate(SENTENCES[:n])]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_the_device_table_follows_prefix_hits_past_the_write_buffer_and_preemption(llama_dir, mode, monkeypatch):
    """A 320-token shared prefix is 40 blocks of 8, more than any step's own writes (T + S <= 36):
    later requests' hits go through the overflow program. A small pool preempts. Greedy outputs
    equal those of an engine without prefix caching, and the device table equals its mirror."""
    base = {"max_model_len": 512, "max_num_seqs": 4, "max_num_batched_tokens": 32, "block_size": 8}
    ref = LLM(llama_dir, **base, enable_prefix_caching=False)
    prompts = long_prompts(ref, 4, 320)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    del ref
    llm = LLM(llama_dir, **base, enable_prefix_caching=True, num_gpu_blocks_override=56, preemption_mode=mode)
    runner = llm.llm_engine.core.runner
    overflows = []
    write = runner._write_overflow
    monkeypatch.setattr(runner, "_write_overflow", lambda w, v: (overflows.append(w.size), write(w, v)))
    with no_compilation():
        first = llm.generate(prompts[:1], params, use_tqdm=False)
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert first[0].outputs[0].token_ids == expected[0]
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert overflows, "no step changed more entries than its buffer holds"
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    np.testing.assert_array_equal(np.asarray(runner.block_table), runner.packer.tables.mirror)
