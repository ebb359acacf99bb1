"""The KV block pool's bookkeeping on the host. Plain Python, no accelerator library.

The device pool is preallocated once: NB blocks of P token slots each, per layer. This class only
decides which block ids a request owns. Block 0 is the null page: never handed out, so padding
tokens and padding rows of a batch can point at it and a kernel never reads or writes outside the
pool.

Automatic prefix caching. A full block is identified by a hash chain, blake2b(parent hash + its P
tokens), 128 bits: equal hashes mean equal token prefixes, and (unlike Python's hash()) nobody can
craft a prompt that collides with another user's prefix. A full block
of a running request is registered under its hash; a later request whose prompt starts with the
same blocks takes them by reference count instead of computing them again. A freed block keeps its
KV and its hash while it waits in the free queue, and is evicted (its hash forgotten) only when an
allocation takes it: LRU eviction, because the free queue is in the order blocks were released.

Why the free queue is a dict: allocate takes from the front and free appends at the back in O(1),
and a cached block can leave the middle of the queue in O(1) when a prefix hit revives it. A
plain dict keeps insertion order, which is exactly that queue.
"""

from __future__ import annotations

import array
import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from jaxsched.core.request import Request

NULL_BLOCK = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheStats:
    """How the pool's blocks and slots are used: a diagnostic of the block manager (tests and
    debugging). The figures the engine reports (usage, prefix-cache hits) are in EngineStats."""

    num_blocks: int  # usable blocks (the null page excluded)
    num_used_blocks: int  # referenced by at least one request
    num_free_blocks: int  # unreferenced, including cached ones that can be evicted
    num_cached_blocks: int  # unreferenced blocks still holding a cached prefix (a subset of free)
    allocated_slots: int  # token slots in used blocks
    used_slots: int  # slots that hold (or will hold this step) a token's K/V
    internal_waste: int  # allocated_slots - used_slots: the tails of last blocks


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null page), got {num_blocks}")
        if block_size <= 0 or block_size % 8:
            raise ValueError(f"block_size must be a positive multiple of 8, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.free_queue: dict[int, None] = dict.fromkeys(range(1, num_blocks))
        self.req_blocks: dict[str, list[int]] = {}
        self.req_slots: dict[str, int] = {}  # token slots each request has claimed
        self.block_hash: list[bytes | None] = [None] * num_blocks  # hash a block is cached under
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.req_num_registered: dict[str, int] = {}  # leading full blocks of a request registered
        self.req_num_hits: dict[str, int] = {}  # leading blocks a request found in the cache (not its own work)
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / (self.num_blocks - 1)

    def block_ids(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def uses_cache(self, request: Request) -> bool:
        # The samples of one n > 1 request always share their prompt's blocks, caching on or off.
        return self.enable_prefix_caching or request.group_size > 1

    # -- prefix cache --------------------------------------------------------------------------
    def block_hashes(self, request: Request, num_full: int) -> list[bytes]:
        """The chain hashes of the request's first num_full full blocks (extended lazily, kept on
        the request so each block is hashed once)."""
        hashes = request.block_hashes
        P = self.block_size
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else request.cache_salt.to_bytes(16, "little")
            tokens = array.array("q", request.token_slice(i * P, (i + 1) * P)).tobytes()
            hashes.append(hashlib.blake2b(parent + tokens, digest_size=16).digest())
        return hashes

    def lookup(self, request: Request) -> list[int]:
        """Cached blocks holding the longest prefix of the request's tokens. At least one token is
        left to compute, since the step must produce logits for the request's last token."""
        if not self.uses_cache(request):
            return []
        P = self.block_size
        max_full = (request.num_tokens - 1) // P
        hits: list[int] = []
        for h in self.block_hashes(request, max_full):
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def register(self, request: Request) -> None:
        """Cache the request's blocks that are full once this step's tokens are written. A block
        written this step may be hit by a request scheduled later in the same step: the forward
        pass writes every new token's K/V before any attention reads."""
        rid = request.request_id
        # a block holding a token the host has not read yet (overlapped scheduling) is hashed later
        num_full = min(self.req_slots.get(rid, 0), request.num_tokens) // self.block_size
        done = self.req_num_registered.get(rid, 0)
        if num_full <= done or not self.uses_cache(request):
            return
        blocks = self.req_blocks[rid]
        hashes = self.block_hashes(request, num_full)
        for i in range(done, num_full):
            h, b = hashes[i], blocks[i]
            if self.block_hash[b] is None and h not in self.cached:
                self.cached[h] = b
                self.block_hash[b] = h
        self.req_num_registered[rid] = num_full

    # -- allocation ----------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Give `request` the blocks for its next num_new_tokens tokens, after taking
        `computed_blocks` (prefix-cache hits, only for a request that owns no blocks yet). False
        (and no change) if the pool has too few free blocks."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if blocks is not None and not computed_blocks:  # the common case: a decode within its last block
            slots = request.num_computed_tokens + num_new_tokens
            if slots <= len(blocks) * self.block_size:
                self.req_slots[rid] = slots
                return True
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        have = (len(blocks) if blocks else 0) + len(computed_blocks)
        need = max(0, cdiv(num_computed + num_new_tokens, self.block_size) - have)
        revived = sum(1 for b in computed_blocks if self.ref_cnt[b] == 0)  # leave the free queue
        if need + revived > len(self.free_queue):
            return False
        if blocks is None:
            blocks = self.req_blocks[rid] = []
        for b in computed_blocks:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1
            blocks.append(b)
        if computed_blocks:
            self.req_num_registered[rid] = len(computed_blocks)
            self.req_num_hits[rid] = len(computed_blocks)
        if need:
            free_queue, ref_cnt, block_hash = self.free_queue, self.ref_cnt, self.block_hash
            taken = list(itertools.islice(free_queue, need))  # the queue's front: least recently freed
            for b in taken:
                del free_queue[b]
                h = block_hash[b]
                if h is not None:  # evict the cached prefix this block held
                    block_hash[b] = None
                    if self.cached.get(h) == b:
                        del self.cached[h]
                ref_cnt[b] = 1
            blocks.extend(taken)
        self.req_slots[rid] = num_computed + num_new_tokens
        return True

    def set_slots(self, request: Request, num_slots: int) -> None:
        """Shrink a request's claimed slots after the scheduler cut its chunk (blocks are kept:
        the next step needs them)."""
        self.req_slots[request.request_id] = num_slots

    def free(self, request_id: str) -> None:
        """Release every block of a request. Tail blocks go to the queue first so that cached
        prefix heads, shared by more requests, are evicted last."""
        blocks = self.req_blocks.pop(request_id, None)
        self.req_slots.pop(request_id, None)
        self.req_num_registered.pop(request_id, None)
        self.req_num_hits.pop(request_id, None)
        if not blocks:
            return
        for block in reversed(blocks):
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self.free_queue[block] = None
            elif self.ref_cnt[block] < 0:  # pragma: no cover - a bookkeeping bug, never user input
                raise RuntimeError(f"block {block} freed more often than allocated")

    def forget_own_blocks(self, request_id: str) -> None:
        """Forget the cached prefixes of the blocks a request computed itself (not those it found in
        the cache): after it failed, their K/V may not be what their hashes say. The rest of the
        cache stays."""
        blocks = self.req_blocks.get(request_id) or ()
        for b in blocks[self.req_num_hits.get(request_id, 0):]:
            h = self.block_hash[b]
            if h is not None:
                self.block_hash[b] = None
                if self.cached.get(h) == b:
                    del self.cached[h]

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their contents)."""
        for b in self.cached.values():
            self.block_hash[b] = None
        self.cached.clear()
        self.req_num_registered.clear()

    # -- stats ---------------------------------------------------------------------------------
    def slot_usage(self) -> tuple[int, int]:
        """(allocated, wasted) token slots: in used blocks, and of those the unfilled tails of the
        requests' last blocks (shared prefix blocks are always full and add none). O(requests)."""
        allocated = (self.num_usable_blocks - len(self.free_queue)) * self.block_size
        P = self.block_size
        waste = sum(len(self.req_blocks[rid]) * P - slots for rid, slots in self.req_slots.items()
                    if rid in self.req_blocks)
        return allocated, waste

    def stats(self) -> KVCacheStats:
        used = self.num_usable_blocks - len(self.free_queue)
        allocated, waste = self.slot_usage()
        cached_free = sum(1 for b in self.cached.values() if self.ref_cnt[b] == 0)
        return KVCacheStats(
            num_blocks=self.num_usable_blocks,
            num_used_blocks=used,
            num_free_blocks=len(self.free_queue),
            num_cached_blocks=cached_free,
            allocated_slots=allocated,
            used_slots=allocated - waste,
            internal_waste=waste,
        )

    def check_invariants(self) -> None:
        """Every block is free xor referenced; ref counts match the block tables; the cache maps
        only to blocks that carry its hash. For tests."""
        counts = [0] * self.num_blocks
        for blocks in self.req_blocks.values():
            for b in blocks:
                counts[b] += 1
        assert counts[NULL_BLOCK] == 0 and NULL_BLOCK not in self.free_queue, "null page handed out"
        for b in range(1, self.num_blocks):
            assert counts[b] == self.ref_cnt[b], f"block {b}: ref {self.ref_cnt[b]} != owners {counts[b]}"
            assert (b in self.free_queue) == (counts[b] == 0), f"block {b} free/used mismatch"
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, f"cache entry {h} -> block {b} which carries {self.block_hash[b]}"
        for rid, blocks in self.req_blocks.items():
            assert len(set(blocks)) == len(blocks), f"request {rid} holds a block twice"


class SwapPool:
    """The host tier of the pool (swap_space): which host blocks hold a swapped-out request's KV.
    Host block ids index the runner's host arrays; there is no null page here."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self.req_blocks: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def allocate(self, request_id: str, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        blocks = [self.free.pop() for _ in range(n)]
        self.req_blocks[request_id] = blocks
        return blocks

    def release(self, request_id: str) -> list[int]:
        blocks = self.req_blocks.pop(request_id, [])
        self.free.extend(reversed(blocks))
        return blocks

    def check_invariants(self) -> None:
        owned = [b for blocks in self.req_blocks.values() for b in blocks]
        assert len(owned) == len(set(owned)), "a host block is owned twice"
        assert sorted(owned + self.free) == list(range(self.num_blocks)), "host blocks lost or duplicated"
