"""EngineStats: one snapshot of the engine's figures, named as vLLM's metrics (without the prefix).

The scheduler fills it (it owns the queues and the block manager), LLMEngine adds its step timings;
LLMEngine.stats() returns it,
the AsyncEngine publishes it between steps, and the /metrics gauges read it. One structure, one
path.
"""

from __future__ import annotations

from dataclasses import dataclass

# the host phases of a step, each counted in EngineStats.<phase>_seconds (engine.py, serving/metrics.py)
HOST_PHASES = ("schedule", "pack", "launch", "update", "output")


@dataclass(frozen=True)
class EngineStats:
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_requests_swapped: int = 0
    kv_cache_usage_perc: float = 0.0  # fraction of usable KV blocks in use (0 to 1)
    num_preemptions: int = 0  # since start, swap and recompute
    num_swap_outs: int = 0
    num_block_copies: int = 0  # copy-on-write of n > 1 tails
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_steps: int = 0
    num_scheduled_tokens: int = 0  # real tokens, since start
    num_padded_tokens: int = 0  # padding tokens, since start
    last_step_padded_tokens: int = 0
    step_seconds: float = 0.0  # wall time of every step (LLMEngine.step), since start
    longest_step_seconds: float = 0.0  # the longest step's wall time (several cores: the longest of theirs)
    device_seconds: float = 0.0  # of which the host waited on the device (jitted calls, block moves)
    # the device's own time on the steps it ran with nothing else in flight (the synchronous engine,
    # or the last step of the work), each from its model program's dispatch to its results being
    # read, and those steps' count (first runs of a program left out): the device-only time of a
    # step, which device_seconds undercounts by the part that ran while the host was still
    # dispatching
    device_busy_seconds: float = 0.0
    device_busy_steps: int = 0
    # the host's work in the steps, by phase, since start: scheduling, packing the batch into its
    # fixed-shape arrays, applying the sampled tokens to the scheduler, and building the outputs
    # (detokenizing, stop strings, logprobs); launch: dispatching the step's programs to the device
    # (the call returns before they run: on a GPU this is the kernel launches and input copies)
    schedule_seconds: float = 0.0
    pack_seconds: float = 0.0
    launch_seconds: float = 0.0
    update_seconds: float = 0.0
    output_seconds: float = 0.0
    # speculative decoding, since start (vLLM's spec_decode_* counters): rows that verified
    # proposals, the proposals verified, those kept, and those kept by position (1st, 2nd, ...)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # with overlapped scheduling: steps read before the next was scheduled because a row of them
    # might be given proposals (scheduler.may_propose); the other steps overlapped
    spec_decode_overlap_pauses: int = 0
    # KV slots now: in blocks held by requests, and of those the unfilled tails of last blocks
    kv_allocated_slots: int = 0
    kv_internal_waste_slots: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_decode_mean_accepted_length(self) -> float:
        """Tokens a verifying row yields on average: its kept proposals plus the one drawn after them."""
        return 1.0 + self.spec_decode_num_accepted_tokens / self.spec_decode_num_drafts \
            if self.spec_decode_num_drafts else 0.0

    @property
    def host_share(self) -> float:
        """The share of step time spent on the host (schedule, pack, update, detokenize): in the
        synchronous engine the device idles for all of it."""
        return 1.0 - self.device_seconds / self.step_seconds if self.step_seconds else 0.0

    @property
    def scheduling_share(self) -> float:
        """The design's "scheduling overhead": the scheduler's share of the steps' wall time."""
        return self.schedule_seconds / self.step_seconds if self.step_seconds else 0.0

    @property
    def kv_internal_waste_perc(self) -> float:
        """The share of allocated KV slots that hold no token (0 to 1): the last blocks' tails."""
        return self.kv_internal_waste_slots / self.kv_allocated_slots if self.kv_allocated_slots else 0.0

    @property
    def kv_external_fragmentation_perc(self) -> float:
        """Zero by construction: the pool is pages of one size and a request's pages need not be
        contiguous, so every free block can serve any request; nothing is ever free but unusable."""
        return 0.0
