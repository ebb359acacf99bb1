"""KV cache groups: how a model's layers share the paged pool when some of them read a sliding window
(vLLM's hybrid KV cache manager is the model). Plain Python, no accelerator library.

A layer that reads only its last W positions needs only the last ceil(W / P) + 1 pages of a
sequence; the rest can go back to the pool. Pages are freed per *group* of layers that share one
block table: the layers are cut into G groups of at most Lg layers each, every group all sliding or
all full attention, and the pool holds pages of Lg layers, f[Lg, NB, K, P, H]. Layer l reads and
writes row `slot(l)` of the pages in its group's table. A request's blocks are one list with G
entries per block of P tokens (logical block i, group g at i * G + g): a sliding group's entry turns
into the null page once the window has passed it, while a full group keeps its pages to the end.

The pages of all groups come from one pool, one free queue (block_manager.py): which group needs
how many pages depends on the requests' lengths (long contexts need full-attention pages; many
short ones, sliding ones), so a fixed split of the pool would strand memory whenever the mix
differs from its guess.

Group size Lg: the fewer layers of one kind (vLLM's rule), so both kinds divide into whole groups
where the counts allow (Gemma 3: 4 global layers and 22 sliding ones make one group of 4 and six of
4, the last holding 2: a page of that group leaves 2 of its 4 rows unused). A model without
windows is one group of every layer, and a model whose every layer has one (Mistral) one sliding
group: the pool is then f[L, NB, ...] as without groups.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from jaxsched.models.model_config import ModelConfig


@dataclass(frozen=True)
class KVGroups:
    layers: tuple[tuple[int, ...], ...]  # each group's layers, in pool row order
    windows: tuple[int | None, ...]  # each group's window in tokens; None: full attention

    @property
    def num_groups(self) -> int:  # G
        return len(self.layers)

    @property
    def size(self) -> int:  # Lg: the pool's rows per page
        return max(len(g) for g in self.layers)

    @property
    def sliding(self) -> tuple[int, ...]:
        """The groups with a window."""
        return tuple(g for g, w in enumerate(self.windows) if w is not None)

    def group_of(self) -> tuple[int, ...]:
        """Each layer's group (by layer index)."""
        return self._index()[0]

    def slot_of(self) -> tuple[int, ...]:
        """Each layer's row in its group's pages (by layer index)."""
        return self._index()[1]

    def _index(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        L = sum(len(g) for g in self.layers)
        group, slot = [0] * L, [0] * L
        for g, layers in enumerate(self.layers):
            for j, layer in enumerate(layers):
                group[layer], slot[layer] = g, j
        return tuple(group), tuple(slot)

    def pages_for(self, tokens: int, block_size: int, chunk: int) -> int:
        """The most pages a request of `tokens` tokens holds at once, computed in steps of at most
        `chunk` tokens: every block in each full group, and in each sliding group the blocks one
        step's queries read (its window before the step's first token, and the step's own)."""
        blocks = -(-tokens // block_size)
        return sum(blocks if w is None else min(blocks, -(-(w - 1 + chunk) // block_size) + 1) for w in self.windows)

    def first_needed(self, g: int, position: int, block_size: int) -> int:
        """The first logical block group g still needs when the next token to compute is at
        `position`: a query at q reads (q - W, q], and every later query reads from later on."""
        w = self.windows[g]
        return 0 if w is None else max(0, position - w + 1) // block_size


# one group without a window, its layers left unsaid: the plain pool, for the host's bookkeeping
# (block manager, packer, limits) where no model is at hand (benchmarks, tests)
FULL_ATTENTION = KVGroups(((),), (None,))


@functools.lru_cache(maxsize=16)
def kv_groups(cfg: ModelConfig) -> KVGroups:
    """The groups of a model as it runs (after config.resolve dropped a window no shorter than the
    context); computed once per config (the front end asks for every request)."""
    return group_layers([cfg.layer_window(i) for i in range(cfg.num_layers)])


def group_layers(windows: list[int | None]) -> KVGroups:
    """The groups of layers with these windows (None: full attention; one window size at most)."""
    L = len(windows)
    sliding = [i for i, w in enumerate(windows) if w is not None]
    full = [i for i, w in enumerate(windows) if w is None]
    if not sliding or not full:
        return KVGroups((tuple(range(L)),), (windows[0],))
    window = windows[sliding[0]]
    if any(windows[i] != window for i in sliding):
        raise ValueError(f"sliding windows of several sizes ({sorted(set(windows) - {None})}) are not supported")
    size = min(len(full), len(sliding))
    groups = [tuple(full[i : i + size]) for i in range(0, len(full), size)]
    out: list[int | None] = [None] * len(groups)
    for i in range(0, len(sliding), size):
        groups.append(tuple(sliding[i : i + size]))
        out.append(window)
    return KVGroups(tuple(groups), tuple(out))
