"""The KV block pool's bookkeeping on the host. Plain Python: no jax here.

The device pool is preallocated once: NB blocks of P token slots each, per layer. This class only
decides which block ids a request owns. Block 0 is the null page: never handed out, so padding
tokens and padding rows of a batch can point at it and a kernel never reads or writes outside the
pool.

Why the free queue is a dict: allocate takes from the front and free appends at the back in O(1),
and (for prefix caching) a block can leave the middle of the queue in O(1) when it is reused. A
plain dict keeps insertion order, which is exactly that queue.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxsched.request import Request

NULL_BLOCK = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheStats:
    num_blocks: int  # usable blocks (the null page excluded)
    num_used_blocks: int
    num_free_blocks: int
    usage: float  # used / usable, the fraction vLLM reports as kv_cache_usage_perc
    allocated_slots: int  # token slots in used blocks
    used_slots: int  # slots that hold (or will hold this step) a token's K/V
    internal_waste: int  # allocated_slots - used_slots: the tails of last blocks


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null page), got {num_blocks}")
        if block_size <= 0 or block_size % 8:
            raise ValueError(f"block_size must be a positive multiple of 8, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_cnt = [0] * num_blocks
        self.free_queue: dict[int, None] = dict.fromkeys(range(1, num_blocks))
        self.req_blocks: dict[str, list[int]] = {}
        self.req_slots: dict[str, int] = {}  # token slots each request has claimed

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def block_ids(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Extra blocks `request` needs so its first num_computed + num_new_tokens tokens have slots."""
        have = len(self.req_blocks.get(request.request_id, ()))
        return max(0, cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - have)

    # -- allocation ----------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Give `request` the blocks for its next num_new_tokens tokens. False (and no change) if
        the pool has too few free blocks."""
        need = self.num_blocks_needed(request, num_new_tokens)
        if need > len(self.free_queue):
            return False
        blocks = self.req_blocks.setdefault(request.request_id, [])
        for _ in range(need):
            block = next(iter(self.free_queue))
            del self.free_queue[block]
            self.ref_cnt[block] = 1
            blocks.append(block)
        self.req_slots[request.request_id] = request.num_computed_tokens + num_new_tokens
        return True

    def free(self, request_id: str) -> None:
        """Release every block of a request. Tail blocks go to the queue first so that, once blocks
        carry cached prefixes, the shared heads are evicted last."""
        blocks = self.req_blocks.pop(request_id, None)
        self.req_slots.pop(request_id, None)
        if not blocks:
            return
        for block in reversed(blocks):
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self.free_queue[block] = None
            elif self.ref_cnt[block] < 0:  # pragma: no cover - a bookkeeping bug, never user input
                raise RuntimeError(f"block {block} freed more often than allocated")

    # -- stats ---------------------------------------------------------------------------------
    def stats(self) -> KVCacheStats:
        used = self.num_usable_blocks - len(self.free_queue)
        allocated = used * self.block_size
        used_slots = sum(self.req_slots.values())
        return KVCacheStats(
            num_blocks=self.num_usable_blocks,
            num_used_blocks=used,
            num_free_blocks=len(self.free_queue),
            usage=used / self.num_usable_blocks,
            allocated_slots=allocated,
            used_slots=used_slots,
            internal_waste=allocated - used_slots,
        )

    def check_invariants(self) -> None:
        """Every block is free xor referenced; ref counts match the block tables. For tests."""
        counts = [0] * self.num_blocks
        for blocks in self.req_blocks.values():
            for b in blocks:
                counts[b] += 1
        assert counts[NULL_BLOCK] == 0 and NULL_BLOCK not in self.free_queue, "null page handed out"
        for b in range(1, self.num_blocks):
            assert counts[b] == self.ref_cnt[b], f"block {b}: ref {self.ref_cnt[b]} != owners {counts[b]}"
            assert (b in self.free_queue) == (counts[b] == 0), f"block {b} free/used mismatch"
