import pytest

from jaxsched.core.block_manager import NULL_BLOCK, BlockManager
from jaxsched.core.request import Request, SamplingParams


def req(rid: str, n_prompt: int = 10) -> Request:
    return Request(rid, list(range(n_prompt)), SamplingParams())


def test_block_size_must_be_multiple_of_8():
    with pytest.raises(ValueError, match="multiple of 8"):
        BlockManager(10, 12)


def test_allocate_free_and_null_page():
    bm = BlockManager(num_blocks=9, block_size=8)
    assert bm.num_free_blocks == 8  # block 0 is never handed out
    r = req("a", 20)
    assert bm.allocate_slots(r, 20)
    blocks = bm.block_ids("a")
    assert len(blocks) == 3 and NULL_BLOCK not in blocks
    s = bm.stats()
    assert (s.num_used_blocks, s.num_free_blocks, s.allocated_slots, s.used_slots, s.internal_waste) == (
        3, 5, 24, 20, 4)
    assert bm.usage == pytest.approx(3 / 8)
    bm.check_invariants()
    bm.free("a")
    assert bm.num_free_blocks == 8 and bm.block_ids("a") == []
    bm.check_invariants()


def test_grows_only_when_a_block_fills():
    bm = BlockManager(9, 8)
    r = req("a", 8)
    assert bm.allocate_slots(r, 8)
    r.num_computed_tokens = 8
    assert bm.allocate_slots(r, 1)
    assert len(bm.block_ids("a")) == 2  # the ninth token needs a second block
    r.num_computed_tokens = 9
    free = bm.num_free_blocks
    assert bm.allocate_slots(r, 7) and bm.num_free_blocks == free  # the second block still has 7 free slots
    assert len(bm.block_ids("a")) == 2


def test_refuses_without_side_effects_when_the_pool_is_short():
    bm = BlockManager(5, 8)  # 4 usable blocks
    a, b = req("a"), req("b")
    assert bm.allocate_slots(a, 24)  # 3 blocks
    assert not bm.allocate_slots(b, 16)  # needs 2, only 1 left
    assert bm.block_ids("b") == [] and bm.num_free_blocks == 1
    bm.free("a")
    bm.free("b")  # freeing a request with no blocks is a no-op
    assert bm.num_free_blocks == 4
    bm.check_invariants()


def test_freed_blocks_are_reused_oldest_first():
    bm = BlockManager(5, 8)
    a, b = req("a"), req("b")
    bm.allocate_slots(a, 8)
    bm.allocate_slots(b, 8)
    first_a = bm.block_ids("a")[0]
    bm.free("a")
    c = req("c")
    bm.allocate_slots(c, 16)
    # blocks 3 and 4 were free before a's block came back, so they go first
    assert first_a not in bm.block_ids("c")
