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

Sliding windows (kv_groups.py): with G layer groups a request's list holds G pages per logical
block of P tokens (block i, group g at i * G + g), all from the one free queue. Once the window has
passed a logical block, its sliding groups' pages are freed and their entries turn into the null
page (`trim`; `req_trimmed` counts such blocks), so a long context keeps about ceil(W / P) + 1
pages in each sliding group. A page is cached under its block's hash and its group; a freed
sliding page keeps its hash in the free queue like any other (a later hit may revive it), and
trimmed entries are neither swapped nor hashed again. A prefix-cache hit needs every full group's
pages of its blocks, but a sliding group's only from the first block its window still reads. With
one group without a window (every model without sliding layers) all of this is the plain pool.
"""

from __future__ import annotations

import array
import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from jaxsched.core.kv_groups import FULL_ATTENTION, KVGroups
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
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 groups: KVGroups = FULL_ATTENTION) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null page), got {num_blocks}")
        if block_size <= 0 or block_size % 8:
            raise ValueError(f"block_size must be a positive multiple of 8, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = groups
        self.G = groups.num_groups
        self._sliding = groups.sliding
        self._full = tuple(g for g in range(self.G) if g not in self._sliding)
        self.req_trimmed: dict[str, int] = {}  # logical blocks whose sliding pages are freed
        self.num_trimmed_pages = 0  # sliding pages freed because the window passed them (tests, metrics)
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

    def _key(self, h: bytes, g: int) -> bytes:
        """The cache key of group g's page of the block with chain hash h."""
        return h if g == 0 else h + bytes((g,))

    def first_needed(self, position: int) -> int:
        """The first logical block the sliding groups still need when the next token to compute is
        at `position` (0 without sliding groups)."""
        return self.groups.first_needed(self._sliding[0], position, self.block_size) if self._sliding else 0

    def lookup(self, request: Request) -> list[int]:
        """Cached pages holding the longest prefix of the request's tokens, G per block (null for a
        sliding group's block its window no longer reads). At least one token is left to compute,
        since the step must produce logits for the request's last token."""
        if not self.uses_cache(request):
            return []
        P, G, cached = self.block_size, self.G, self.cached
        max_full = (request.num_tokens - 1) // P
        hashes = self.block_hashes(request, max_full)
        n = 0  # blocks whose every full group's page is cached
        while n < max_full and all(self._key(hashes[n], g) in cached for g in self._full):
            n += 1
        if self._sliding:
            # the longest n' <= n whose blocks from first_needed(n' P) on have all their sliding pages
            run = 0  # sliding-complete blocks ending at the one before n'
            runs = []
            for i in range(n):
                run = run + 1 if all(self._key(hashes[i], g) in cached for g in self._sliding) else 0
                runs.append(run)
            while n > 0 and runs[n - 1] < n - self.first_needed(n * P):
                n -= 1
        lo = self.first_needed(n * P)
        return [cached[self._key(hashes[i], g)] if g in self._full or i >= lo else NULL_BLOCK
                for i in range(n) for g in range(G)]

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
        G = self.G
        for i in range(done, num_full):
            for g in range(G):
                b = blocks[i * G + g]
                key = self._key(hashes[i], g)
                # a page the window already passed is not hashed (its entry is the null page)
                if b != NULL_BLOCK and self.block_hash[b] is None and key not in self.cached:
                    self.cached[key] = b
                    self.block_hash[b] = key
        self.req_num_registered[rid] = num_full

    # -- allocation ----------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Give `request` the blocks for its next num_new_tokens tokens, after taking
        `computed_blocks` (prefix-cache hits as lookup gives them, only for a request that owns no
        blocks yet), and free the sliding pages its window has passed. False (and no change but
        that freeing) if the pool has too few free blocks."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        G, P = self.G, self.block_size
        if blocks is not None and not computed_blocks:  # the common case: a decode within its last block
            slots = request.num_computed_tokens + num_new_tokens
            if self._sliding:
                self.trim(rid, request.num_computed_tokens)
            if slots <= len(blocks) // G * P:
                self.req_slots[rid] = slots
                return True
        num_computed = request.num_computed_tokens + len(computed_blocks) // G * P
        have = ((len(blocks) if blocks else 0) + len(computed_blocks)) // G  # logical blocks
        need = max(0, cdiv(num_computed + num_new_tokens, P) - have)
        # the sliding groups' pages only from the first block their window still reads
        lo = self.first_needed(num_computed)
        pages = need * len(self._full) + len(self._sliding) * max(0, have + need - max(lo, have))
        revived = sum(1 for b in computed_blocks if b != NULL_BLOCK and self.ref_cnt[b] == 0)  # leave the free queue
        if pages + revived > len(self.free_queue):
            return False
        if blocks is None:
            blocks = self.req_blocks[rid] = []
            self.req_trimmed[rid] = lo  # a hit's or a swapped-in request's first blocks: null
        for b in computed_blocks:
            if b != NULL_BLOCK:
                if self.ref_cnt[b] == 0:
                    del self.free_queue[b]
                self.ref_cnt[b] += 1
            blocks.append(b)
        if computed_blocks:
            self.req_num_registered[rid] = len(computed_blocks) // G
            self.req_num_hits[rid] = len(computed_blocks) // G
        if need:
            free_queue, ref_cnt, block_hash = self.free_queue, self.ref_cnt, self.block_hash
            taken = iter(list(itertools.islice(free_queue, pages)))  # the queue's front: least recently freed
            for i in range(have, have + need):
                for g in range(G):
                    if i < lo and g in self._sliding:
                        blocks.append(NULL_BLOCK)
                        continue
                    b = next(taken)
                    del free_queue[b]
                    h = block_hash[b]
                    if h is not None:  # evict the cached prefix this block held
                        block_hash[b] = None
                        if self.cached.get(h) == b:
                            del self.cached[h]
                    ref_cnt[b] = 1
                    blocks.append(b)
        self.req_slots[rid] = num_computed + num_new_tokens
        return True

    def trim(self, request_id: str, position: int) -> None:
        """Free the sliding groups' pages of the blocks their window no longer reads once the next
        token to compute is at `position`; their entries become the null page."""
        blocks = self.req_blocks.get(request_id)
        if not blocks or not self._sliding:
            return
        G = self.G
        done = self.req_trimmed.get(request_id, 0)
        lo = min(self.first_needed(position), len(blocks) // G)
        for i in range(done, lo):
            for g in self._sliding:
                b = blocks[i * G + g]
                if b == NULL_BLOCK:
                    continue
                blocks[i * G + g] = NULL_BLOCK
                self.num_trimmed_pages += 1
                self.ref_cnt[b] -= 1
                if self.ref_cnt[b] == 0:
                    self.free_queue[b] = None
        if lo > done:
            self.req_trimmed[request_id] = lo

    def trimmed(self, request_id: str) -> int:
        """The request's leading logical blocks whose sliding pages are freed."""
        return self.req_trimmed.get(request_id, 0)

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
        self.req_trimmed.pop(request_id, None)
        if not blocks:
            return
        for block in reversed(blocks):
            if block == NULL_BLOCK:
                continue
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
        for b in blocks[self.req_num_hits.get(request_id, 0) * self.G:]:
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
        requests' last blocks, in each group (shared prefix blocks are always full and add none).
        O(requests)."""
        allocated = (self.num_usable_blocks - len(self.free_queue)) * self.block_size
        P, G = self.block_size, self.G
        waste = sum((len(self.req_blocks[rid]) // G * P - slots) * G for rid, slots in self.req_slots.items()
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
        G = self.G
        for rid, blocks in self.req_blocks.items():
            assert len(blocks) % G == 0, f"request {rid}: {len(blocks)} pages is not whole blocks of {G} groups"
            for k, b in enumerate(blocks):
                if b == NULL_BLOCK:  # only a sliding group's page the window has passed
                    assert k % G in self._sliding and k // G < self.req_trimmed.get(rid, 0), \
                        f"request {rid}: entry {k} is the null page"
                counts[b] += 1
        assert NULL_BLOCK not in self.free_queue, "null page handed out"
        for b in range(1, self.num_blocks):
            assert counts[b] == self.ref_cnt[b], f"block {b}: ref {self.ref_cnt[b]} != owners {counts[b]}"
            assert (b in self.free_queue) == (counts[b] == 0), f"block {b} free/used mismatch"
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, f"cache entry {h} -> block {b} which carries {self.block_hash[b]}"
        for rid, blocks in self.req_blocks.items():
            live = [b for b in blocks if b != NULL_BLOCK]
            assert len(set(live)) == len(live), f"request {rid} holds a block twice"


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
