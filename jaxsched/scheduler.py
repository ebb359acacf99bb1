"""Who runs each step. Plain Python: no jax, no clocks, no randomness, no I/O.

The scheduler follows vLLM v1's counter model: every step each running request gets the new tokens
it lacks (one while decoding, a chunk while prefilling), within a token budget
(max_num_batched_tokens) and a sequence cap (max_num_seqs). Requests join and leave the running
batch at every step (continuous batching). When the block pool runs dry, the latest arrival among
the running requests is preempted by recompute: its blocks are freed and it goes back to the front
of the waiting queue with num_computed_tokens = 0, to be prefilled again (prompt + outputs so far).

A decision depends only on the queues, the block manager and the config, so a recorded trace of
adds, aborts and sampled tokens replays to the same decisions.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from jaxsched.block_manager import BlockManager, cdiv
from jaxsched.buckets import round_up
from jaxsched.config import SchedulerConfig
from jaxsched.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """One step's decisions: a plain value a test can inspect."""

    requests: list[Request]  # scheduled, in batch order
    num_new_tokens: list[int]  # tokens each gets this step
    preempted: list[str] = field(default_factory=list)  # request ids preempted by recompute
    finished_ids: list[str] = field(default_factory=list)  # finished or aborted since the last step
    num_tokens: int = 0  # real tokens this step
    token_bucket: int = 0  # T
    seq_bucket: int = 0  # S

    @property
    def num_seqs(self) -> int:
        return len(self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int  # since start


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: collections.deque[Request] = collections.deque()
        # Kept sorted by arrival (seq_no): iteration serves the oldest first and the preemption
        # victim, the latest arrival, is always at the end.
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self._next_seq_no = 0
        self.num_preemptions = 0

    # -- queue management ----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in flight; use a unique id")
        self.check_fits(request)
        request.seq_no = self._next_seq_no
        self._next_seq_no += 1
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check_fits(self, request: Request) -> None:
        """Refuse a request that could never be scheduled instead of letting it wait forever."""
        cfg = self.config
        n_prompt = request.num_prompt_tokens
        if n_prompt >= cfg.max_model_len:
            raise ValueError(
                f"prompt is {n_prompt} tokens but max_model_len is {cfg.max_model_len}: the prompt must "
                f"be shorter than max_model_len (shorten it or raise max_model_len)"
            )
        if not cfg.enable_chunked_prefill and n_prompt > cfg.max_num_batched_tokens:
            raise ValueError(
                f"prompt is {n_prompt} tokens but max_num_batched_tokens is {cfg.max_num_batched_tokens} "
                "and chunked prefill is off: enable_chunked_prefill=True or raise max_num_batched_tokens"
            )
        max_tokens = request.sampling_params.max_tokens or cfg.max_model_len
        final_len = min(n_prompt + max_tokens, cfg.max_model_len)
        bm = self.block_manager
        if cdiv(final_len, bm.block_size) > bm.num_usable_blocks:
            raise ValueError(
                f"request needs {cdiv(final_len, bm.block_size)} KV blocks ({final_len} tokens) but the "
                f"pool has {bm.num_usable_blocks}: lower max_tokens or enlarge the pool "
                "(gpu_memory_utilization / num_gpu_blocks_override)"
            )

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside a step (abort, stop string). Unknown ids are ignored."""
        ids = {rid for rid in request_ids if rid in self.requests}
        if not ids:
            return
        self.waiting = collections.deque(r for r in self.waiting if r.request_id not in ids)
        self.running = [r for r in self.running if r.request_id not in ids]
        for rid in ids:
            self._finish(self.requests[rid], status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.block_manager.free(request.request_id)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.num_preemptions)

    # -- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        bm = self.block_manager
        budget = cfg.max_num_batched_tokens
        scheduled: list[Request] = []
        num_new: list[int] = []
        preempted: list[str] = []

        # 1. Running requests, oldest first. Each gets what it lacks, up to the budget.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not bm.allocate_slots(req, n):
                victim = self.running.pop()  # the latest arrival
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                scheduled.append(req)
                num_new.append(n)
                budget -= n
                i += 1

        # 2. Waiting requests, in order, while nothing had to be preempted this step.
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
                req = self.waiting[0]
                n = req.num_tokens - req.num_computed_tokens
                if n > budget and not cfg.enable_chunked_prefill:
                    break
                n = min(n, budget)
                if not bm.allocate_slots(req, n):
                    break
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                bisect.insort(self.running, req, key=lambda r: r.seq_no)
                scheduled.append(req)
                num_new.append(n)
                budget -= n

        total = cfg.max_num_batched_tokens - budget
        out = SchedulerOutput(
            requests=scheduled,
            num_new_tokens=num_new,
            preempted=preempted,
            finished_ids=self._finished_ids,
            num_tokens=total,
            token_bucket=round_up(cfg.token_buckets, total) if scheduled else 0,
            seq_bucket=round_up(cfg.seq_buckets, len(scheduled)) if scheduled else 0,
        )
        self._finished_ids = []
        return out

    def _preempt(self, req: Request) -> None:
        """Preemption by recompute: drop the KV, prefill prompt + outputs again later."""
        self.block_manager.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput, sampled_token_ids: Sequence[int]) -> list[int]:
        """Apply a step's results. Returns the batch indices of requests that got a new token.

        sampled_token_ids[i] is the token sampled for out.requests[i]; it only counts when that
        request's KV caught up with all its tokens this step (a partial prefill chunk samples a
        token that is thrown away).
        """
        max_model_len = self.config.max_model_len
        got_token: list[int] = []
        any_finished = False
        for i, req in enumerate(out.requests):
            if req.status != RequestStatus.RUNNING:  # aborted or preempted since schedule()
                continue
            req.num_computed_tokens += out.num_new_tokens[i]
            if req.num_computed_tokens < req.num_tokens:
                continue
            token = int(sampled_token_ids[i])
            req.output_token_ids.append(token)
            got_token.append(i)
            params = req.sampling_params
            status = None
            if not params.ignore_eos and token in req.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif token in params.stop_token_ids:
                status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token
            elif (params.max_tokens is not None and req.num_output_tokens >= params.max_tokens) or (
                req.num_tokens >= max_model_len
            ):
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                self._finish(req, status)
                any_finished = True
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return got_token
