"""Where an engine's memory went, read off its arrays once it has started: the weights, the KV pool,
the host swap pool and the largest compiled program's workspace, on one device of the engine
(tensor parallelism: each device's share), and what the memory budget leaves. The engine logs it at
start, the front end gets it with CoreInfo, and the server publishes it on /metrics
(jaxsched:memory_bytes)."""

from __future__ import annotations

import msgspec

# the report's figures in bytes, as /metrics labels them (kind=...)
KINDS = ("weights", "kv_pool", "swap", "workspace", "budget", "left")


class MemoryReport(msgspec.Struct, array_like=True, gc=False):
    """One device's figures, bytes. budget: what the engine may use of the device
    (gpu_memory_utilization of its memory; host memory on a CPU); left: the budget less the
    weights, the KV pool and the workspace (the swap pool is host memory, apart on a GPU)."""

    weights: int  # the model's arrays on the device (packed copies included)
    kv_pool: int  # the K and V pools, every block (the null page included)
    kv_blocks: int  # usable blocks
    kv_tokens: int  # the tokens they hold when every layer group keeps a page of each block
    swap: int  # the host arrays swapped-out blocks go to
    workspace: int  # the largest temporary buffer of the compiled step programs (XLA's figure)
    budget: int
    left: int

    def bytes_by_kind(self) -> dict[str, int]:
        return {kind: getattr(self, kind) for kind in KINDS}

    def lines(self) -> str:
        """The report for a log: one figure per line."""
        mib = 2**20
        return (f"memory on one device: weights {self.weights / mib:.1f} MiB, KV pool {self.kv_pool / mib:.1f} MiB "
                f"({self.kv_blocks} blocks, {self.kv_tokens} tokens), workspace {self.workspace / mib:.1f} MiB; "
                f"swap pool (host) {self.swap / mib:.1f} MiB; budget {self.budget / mib:.1f} MiB, "
                f"left {self.left / mib:.1f} MiB")


def device_bytes(arrays) -> int:
    """Bytes of these arrays on the first device holding them (a split array's shard there, a
    replicated one whole): one device's share."""
    total = 0
    for x in arrays:
        shards = getattr(x, "addressable_shards", None)
        total += shards[0].data.nbytes if shards else x.nbytes
    return total
