"""Where an engine's memory went, read off its arrays once it has started: the weights, the KV pool,
the host swap pool, the largest compiled program's workspace and the compiled programs themselves,
on one device of the engine
(tensor parallelism: each device's share), and what the memory budget leaves. The engine logs it at
start, the front end gets it with CoreInfo, and the server publishes it on /metrics
(jaxsched:memory_bytes)."""

from __future__ import annotations

import msgspec

# the report's figures in bytes, as /metrics labels them (kind=...)
KINDS = ("weights", "kv_pool", "swap", "workspace", "programs", "budget", "left", "draft_weights", "draft_kv_pool")


class MemoryReport(msgspec.Struct, array_like=True, gc=False):
    """One device's figures, bytes. budget: what the engine may use of the device
    (gpu_memory_utilization of its memory; host memory on a CPU); left: the budget less the
    weights, the KV pool, the workspace and the programs (the swap pool is host memory, apart on a
    GPU)."""

    weights: int  # the model's arrays on the device (packed copies included), a draft model's too
    kv_pool: int  # the K and V pools, every block (the null page included), a draft model's too
    kv_blocks: int  # usable blocks
    kv_tokens: int  # the tokens they hold when every layer group keeps a page of each block
    swap: int  # the host arrays swapped-out blocks go to
    workspace: int  # the largest temporary buffer of the compiled step programs (XLA's figure)
    budget: int
    left: int
    # the compiled step programs: XLA's generated code where it reports it (a GPU), else (a CPU,
    # where it reports none) the host memory the warm-up's compilations kept, measured as the
    # process's resident memory before and after them: on the demo model's 79 programs, 1.2 GB,
    # as much as a 2048-token context's KV pool (each program holds a copy of every layer's code
    # with per-layer weights: the platform record's layer_weights)
    programs: int = 0
    # of weights and kv_pool: a draft model's (speculative_config method "draft_model")
    draft_weights: int = 0
    draft_kv_pool: int = 0

    def bytes_by_kind(self) -> dict[str, int]:
        return {kind: getattr(self, kind) for kind in KINDS}

    def lines(self) -> str:
        """The report for a log: one figure per line."""
        mib = 2**20
        return (f"memory on one device: weights {self.weights / mib:.1f} MiB, KV pool {self.kv_pool / mib:.1f} MiB "
                f"({self.kv_blocks} blocks, {self.kv_tokens} tokens), workspace {self.workspace / mib:.1f} MiB, "
                f"compiled programs {self.programs / mib:.1f} MiB; "
                f"swap pool (host) {self.swap / mib:.1f} MiB; budget {self.budget / mib:.1f} MiB, "
                f"left {self.left / mib:.1f} MiB"
                + (f"; of the weights and the KV pool, the draft model's {self.draft_weights / mib:.1f} MiB and "
                   f"{self.draft_kv_pool / mib:.1f} MiB" if self.draft_weights else ""))


def resident_bytes() -> int:
    """This process's resident memory (Linux's VmRSS), or 0 where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def code_bytes(programs) -> int:
    """XLA's generated code of these compiled programs (0 where the platform does not report it)."""
    total = 0
    for p in programs:
        stats = p.memory_analysis()  # None where a backend has no memory analysis
        total += int(getattr(stats, "generated_code_size_in_bytes", 0) or 0)
    return total


def device_bytes(arrays) -> int:
    """Bytes of these arrays on the first device holding them (a split array's shard there, a
    replicated one whole): one device's share."""
    total = 0
    for x in arrays:
        shards = getattr(x, "addressable_shards", None)
        total += shards[0].data.nbytes if shards else x.nbytes
    return total
