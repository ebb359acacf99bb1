"""Who runs each step. Plain Python on the host: no accelerator library, no clocks, no randomness, no I/O.

The scheduler follows vLLM v1's counter model: every step each running request gets the new tokens
it lacks (one while decoding, a chunk while prefilling), within a token budget
(max_num_batched_tokens) and a sequence cap (max_num_seqs). Requests join and leave the running
batch at every step (continuous batching). Three queues: waiting (not started, or preempted by
recompute), running, swapped (preempted by swap: KV parked in host memory).

One step, in order:
  1. running requests, in policy order, get their tokens; when the pool runs dry the lowest-ranked
     running request is preempted (by swap or recompute, see _preempt);
  2. unless step 1 preempted, swapped requests come back and then waiting ones are admitted
     (taking prefix-cache hits), in policy order, while the budget, the cap, the pool and
     swap_threshold allow; with a policy that preempts for priority, a candidate that does not
     fit preempts the lowest-ranked running request when that one ranks below it;
  3. the step's size is chosen: prefill chunks are trimmed so the step fits its bucket with at
     most max_paddings padded tokens; then, with a step-cost model (step_cost.py), the candidate
     sizes (the bucket boundaries below the step's tokens, reached for throughput by deferring
     decode rows one step: any while requests wait, else only rows with slack before the longest
     ends; with a TPOT target by trimming prefill chunks instead of the max_paddings rule) are
     compared by predicted time: the most tokens per predicted second, or the largest step
     predicted within the target. Then the blocks that are full after the step are registered in
     the prefix cache.

A decision depends only on the queues, the block manager, the config and the step-cost table, so a
recorded trace of adds, aborts, sampled tokens and cost observations replays to the same decisions.

(This file is longer than the ~400 lines we aim for: the step's phases share the queues and the
budget, and read best together; the pools live in block_manager.py and the orderings in policy.py.)
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from jaxsched.config import SchedulerConfig
from jaxsched.core import speculation
from jaxsched.core.block_manager import NULL_BLOCK, BlockManager, SwapPool, cdiv
from jaxsched.core.buckets import round_up, seq_buckets_for
from jaxsched.core.draft_slots import DraftSlots
from jaxsched.core.kv_groups import FULL_ATTENTION, KVGroups
from jaxsched.core.ngram import NgramProposer
from jaxsched.core.policy import SchedulerPolicy, make_policy
from jaxsched.core.request import Request, RequestStatus
from jaxsched.core.stats import EngineStats
from jaxsched.core.step_cost import StepCostModel, StepShape
from jaxsched.errors import InvalidRequestError, QueueFullError


@dataclass(slots=True)
class ScheduledRequest:
    """One row of a step: the request, the tokens it gets, and its KV blocks after the step."""

    request: Request
    num_new_tokens: int
    # its block table after the step, filled when the step's decisions are final: the block
    # manager's own list, not a copy (read-only; valid until the next schedule())
    block_ids: Sequence[int] = ()
    blocks_trimmed: int = 0  # its leading blocks whose sliding pages the window passed (block_manager.py)
    # set when the step's decisions are final (Scheduler._commit):
    samples: bool = False  # the row catches up with all its tokens, so its sampled token counts
    output_index: int = 0  # the index in the request's output of the token this row samples
    # its one new token is the one the previous step sampled for it, which the host has not read
    # yet (overlapped scheduling): the step takes it from the device
    from_prev: bool = False
    # speculative decoding: the tokens proposed to follow its last one, the last of its
    # num_new_tokens (speculation.py); the step verifies them
    spec_token_ids: Sequence[int] = ()
    num_output: int = 0  # tokens update() appended to the request from this row
    start: int = 0  # the position of its first new token (set by _commit)


@dataclass
class SchedulerOutput:
    """One step's decisions: a plain value a test can inspect."""

    scheduled: dict[str, ScheduledRequest] = field(default_factory=dict)  # request id -> its row, in batch order
    preempted: list[str] = field(default_factory=list)  # preempted by recompute this step
    swapped_out: list[str] = field(default_factory=list)  # preempted by swap this step
    swapped_in: list[str] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (device src, device dst): n > 1 tails
    finished_ids: list[str] = field(default_factory=list)  # finished or aborted since the last step
    num_tokens: int = 0  # real tokens this step
    token_bucket: int = 0  # T
    seq_bucket: int = 0  # S
    context: int = 0  # KV tokens the step's attention reads: its rows' sequence lengths after it, summed
    num_deferred: int = 0  # decode rows the step-cost model put off to the next step
    # Q: positions each row's logits are taken at: 1, or with proposals to verify the speculative
    # config's num_speculative_tokens + 1 (the runner's programs of that width)
    width: int = 1
    num_draft_tokens: int = 0  # proposals the step verifies (counted in num_tokens)
    # a row owes prompt logprobs (SamplingParams.prompt_logprobs): the step runs the programs that
    # take logprobs at every token, whose one (T, S) is prompt_logprobs_buckets
    prompt_logprobs: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def has_block_moves(self) -> bool:
        """Whether the step copies blocks (swap out / in, copy-on-write): even an empty step may."""
        return bool(self.blocks_to_swap_out or self.blocks_to_swap_in or self.blocks_to_copy)

    @property
    def num_padding(self) -> int:
        return self.token_bucket - self.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 policy: str | SchedulerPolicy = "fcfs", cost_model: StepCostModel | None = None,
                 target_step_seconds: float | None = None, size_steps: bool = True) -> None:
        """cost_model: predicted step times, fed by whoever runs the steps (the engine); None keeps
        the max_paddings rule. target_step_seconds: keep each step's predicted time within this
        (a TPOT target) instead of maximising tokens per second. size_steps False: the cost model
        sizes speculative proposals only (speculation.py), steps keep the max_paddings rule."""
        self.config = config
        self.cost_model = cost_model
        self.size_steps = size_steps
        self.target_step_seconds = target_step_seconds
        spec = config.speculative
        self.proposer = None if spec is None else DraftSlots() if spec.method == "draft_model" else \
            NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        self.speculating = spec is not None  # proposals are made (set_speculation turns them off and on)
        self.prompt_logprobs_tokens = prompt_logprobs_tokens(config)
        self.num_drafts = 0  # rows that verified proposals
        self.num_draft_tokens = 0  # proposals verified
        self.num_accepted_tokens = 0  # of those, kept
        # kept proposals by position (1st, 2nd, ...): vLLM's num_accepted_tokens_per_pos
        self.accepted_per_pos = [0] * (spec.num_speculative_tokens if spec is not None else 0)
        self.block_manager = block_manager
        self.policy = make_policy(policy)
        self._key = self.policy.sort_key  # static per request: queues stay sorted by insertion
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.swap_pool = SwapPool(config.num_host_blocks)
        self.requests: dict[str, Request] = {}
        self._group_leader: dict[str, Request] = {}
        # (when, order, request id, queue deadline only) of the requests that have deadlines
        self._deadlines: list[tuple[float, int, str, bool]] = []
        self._finished_ids: list[str] = []
        self._next_seq_no = 0
        self.step_count = 0
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_block_copies = 0  # copy-on-write of n > 1 tails
        self.num_tokens = 0
        self.num_padding = 0
        self.last_padding = 0
        self.num_deferred = 0

    # -- queue management ----------------------------------------------------------------------
    def _insert(self, queue: list[Request], req: Request) -> None:
        bisect.insort(queue, req, key=self._key)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request_id {request.request_id!r} is already in flight; use a unique id",
                                      "request_id")
        self.check_fits(request)
        cap = self.config.max_num_queued_requests
        if cap is not None and len(self.waiting) >= cap:
            raise QueueFullError(
                f"the waiting queue is full ({cap} requests, max_num_queued_requests): retry later"
            )
        request.seq_no = self._next_seq_no
        self._next_seq_no += 1
        request.arrival_step = self.step_count
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        if request.group_id is not None:
            self._group_leader.setdefault(request.group_id, request)
        self._insert(self.waiting, request)
        for when, queue in ((request.deadline, False), (request.queue_deadline, True)):
            if when is not None:
                heapq.heappush(self._deadlines, (when, request.seq_no, request.request_id, queue))

    @property
    def has_deadlines(self) -> bool:
        return bool(self._deadlines)

    def expire(self, now: float) -> list[Request]:
        """End the requests whose deadline has passed (FINISHED_TIMEOUT), and those whose queue
        deadline has passed before they started (FINISHED_QUEUE_TIMEOUT); their blocks are freed.
        The ended requests, for their outputs. O(1) when nothing is due: called at every step."""
        due: dict[str, RequestStatus] = {}
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, rid, queue = heapq.heappop(self._deadlines)
            req = self.requests.get(rid)
            if req is None or rid in due:
                continue
            if queue and (req.status != RequestStatus.WAITING or req.num_computed_tokens or req.output_token_ids
                          or req.num_preemptions):
                continue  # it started: the queue deadline no longer applies
            due[rid] = RequestStatus.FINISHED_QUEUE_TIMEOUT if queue else RequestStatus.FINISHED_TIMEOUT
        ended = [self.requests[rid] for rid in due]
        for status in set(due.values()):
            self.finish_requests([rid for rid, s in due.items() if s == status], status)
        return ended

    def check_fits(self, request: Request) -> None:
        """Refuse a request that could never be scheduled instead of letting it wait forever."""
        bm = self.block_manager
        check_fits(request.num_prompt_tokens, request.sampling_params.max_tokens, self.config, bm.block_size,
                   bm.num_usable_blocks, bm.groups)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside a step (abort, stop string, error). Unknown ids are ignored."""
        ids = {rid for rid in request_ids if rid in self.requests}
        if not ids:
            return
        if status == RequestStatus.FINISHED_ERROR:
            # A failed request's own blocks may hold K/V of other tokens than their hashes say (a
            # row that could not be stored ran with zeros): their cached prefixes go, the rest stay
            for rid in ids:
                self.block_manager.forget_own_blocks(rid)
        self.waiting = [r for r in self.waiting if r.request_id not in ids]
        self.running = [r for r in self.running if r.request_id not in ids]
        self.swapped = [r for r in self.swapped if r.request_id not in ids]
        for rid in ids:
            self._finish(self.requests[rid], status)

    def recover(self, out: SchedulerOutput) -> list[str]:
        """Make the state consistent again after step `out` failed on the device. No block the step
        registered in the prefix cache and no host copy it made can be trusted: the cache is
        forgotten and requests swapped out by this step go back to waiting, to be recomputed.
        Returns the ids of the requests whose device KV is suspect (every running one: the step
        held the whole pool); the caller ends them. With overlapped scheduling the caller recovers
        every step in flight, the earlier one first."""
        self.block_manager.reset_prefix_cache()
        for rid in out.swapped_out:
            req = self.requests.get(rid)
            if req is not None and req.status == RequestStatus.SWAPPED:
                self.swapped.remove(req)
                self.swap_pool.release(rid)
                req.num_computed_tokens = 0
                req.status = RequestStatus.WAITING
                self._insert(self.waiting, req)
        for req in self.waiting:  # preempted while a step was in flight: its token is lost, recomputed
            req.num_pending = 0
        return [r.request_id for r in self.running]

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        rid = request.request_id
        if self.proposer is not None:
            self.proposer.forget((rid,))
        self.block_manager.free(rid)
        self.swap_pool.release(rid)
        del self.requests[rid]
        if request.group_id is not None and self._group_leader.get(request.group_id) is request:
            del self._group_leader[request.group_id]
        self._finished_ids.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        allocated, waste = bm.slot_usage()
        return EngineStats(
            kv_allocated_slots=allocated, kv_internal_waste_slots=waste,
            num_requests_running=len(self.running), num_requests_waiting=len(self.waiting),
            num_requests_swapped=len(self.swapped), kv_cache_usage_perc=bm.usage,
            num_preemptions=self.num_preemptions, num_swap_outs=self.num_swap_outs,
            spec_decode_num_drafts=self.num_drafts, spec_decode_num_draft_tokens=self.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(self.accepted_per_pos),
            num_block_copies=self.num_block_copies, prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits, num_steps=self.step_count, num_scheduled_tokens=self.num_tokens,
            num_padded_tokens=self.num_padding, last_step_padded_tokens=self.last_padding)

    # -- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        bm = self.block_manager
        out = SchedulerOutput()
        sched = out.scheduled
        budget = cfg.max_num_batched_tokens
        self._preempted_now: set[str] = set()

        # 1. Running requests, in policy order; preempt from the end when the pool runs dry.
        memory_preempted = False
        cap = cfg.long_prefill_token_threshold or budget
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if req.num_pending and self._length_reached(req, req.num_pending):  # its pending token is its last
                i += 1
                continue
            n = min(req.num_tokens + req.num_pending - req.num_computed_tokens, budget, cap)
            if req.wants_prompt_logprobs:
                n = min(n, self._room_for_prompt_logprobs(budget))
                if n <= 0:  # the step is past the prompt logprobs programs' tokens: next step
                    i += 1
                    continue
            while not bm.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim, out)
                memory_preempted = True
                if victim is req:
                    break
            else:
                sched[req.request_id] = ScheduledRequest(req, n)
                budget -= n
                if req.wants_prompt_logprobs:
                    budget = self._prompt_logprobs_step(out, budget)
                i += 1

        # rows of requests that were running already: the only ones the cost model may defer
        was_running = set(sched) if self.cost_model is not None and not memory_preempted else set()
        # 2. Swapped, then waiting requests; none in a step that had to preempt for memory.
        if not memory_preempted:
            budget = self._admit(out, budget)

        # 3. Fit the bucket, then register the blocks this step fills.
        total = cfg.max_num_batched_tokens - budget
        if sched:
            if out.prompt_logprobs:
                # one (T, S) (prompt_logprobs_buckets), which the budget kept the step within:
                # neither trimmed to another bucket nor given proposals
                out.token_bucket, out.seq_bucket = prompt_logprobs_buckets(cfg)
            else:
                total = self._size(out, total, was_running)
                out.token_bucket, out.seq_bucket = self.bucket_pair(total, len(sched))
            context = 0
            for row in sched.values():
                self._commit(row)
                context += row.request.num_computed_tokens + len(row.spec_token_ids)
                bm.register(row.request)
                row.block_ids = bm.block_ids(row.request.request_id)
                row.blocks_trimmed = bm.trimmed(row.request.request_id)
            out.num_tokens = total
            out.context = context
        out.finished_ids = self._finished_ids
        self._finished_ids = []
        self.step_count += 1
        self.num_tokens += total
        self.last_padding = out.num_padding
        self.num_padding += self.last_padding
        return out

    def _size(self, out: SchedulerOutput, total: int, was_running: set[str]) -> int:
        """The step's tokens once fitted to a bucket (max_paddings, or the step-cost model) and given
        speculative proposals; out.scheduled is trimmed to match."""
        sched = out.scheduled
        model = self.cost_model if self.size_steps else None
        known = model is not None and model.known(*self.bucket_pair(total, len(sched)))
        # a TPOT target sizes prefill chunks itself (by predicted cost), where the table knows the step
        if not (known and self.target_step_seconds is not None):
            fitted = self._fit_bucket(list(sched.values()), total)
            if fitted != total:
                total = fitted
                known = model is not None and model.known(*self.bucket_pair(total, len(sched)))
        if known:
            total = self._choose_by_cost(out, total, was_running)
        if self.speculating:
            total += self._propose(out, total)
        return total

    def _propose(self, out: SchedulerOutput, total: int) -> int:
        """Speculative decoding: proposals for the step's decode rows whose tokens the host has all
        read, as many as the step-cost model finds worth verifying (speculation.choose), in free
        blocks only (a proposal never preempts). Returns the tokens added."""
        spec, bm = self.config.speculative, self.block_manager
        # Overlapped scheduling: a step with a row whose last token is still on the device (the step
        # before is unread) verifies none, so that a wide step's tables (penalties: the pending
        # token folded in) and the next step's inputs (prev_ids) keep the synchronous engine's
        # layout; the engine pauses the overlap where proposals may come (may_propose).
        if any(row.request.num_pending for row in out.scheduled.values()):
            return 0
        rows = []  # (row, its proposals, its acceptance rate)
        for row in out.scheduled.values():
            req = row.request
            if (row.num_new_tokens != 1 or req.num_pending or req.num_computed_tokens != req.num_tokens - 1
                    or not req.output_token_ids):
                continue
            k, rate = self._proposal_room(req)
            if not k:
                continue
            drafts = self.proposer.propose(req, k)
            if not drafts:
                req.spec_empty_step = self.step_count
            grammar = req.constraint is not None and req.constraint.depends_on_tokens
            if grammar and drafts:  # the proposals the grammar refuses are cut before verification
                drafts = drafts[: req.constraint.valid_prefix(drafts)]
            if drafts:
                rows.append((row, drafts, rate))
        if not rows:
            return 0
        # every proposal with its chance of being kept (rate ** position), best first; a row's
        # proposals stay in order, as each chance is below the one before it
        cands = sorted(((rate ** (j + 1), i) for i, (_, drafts, rate) in enumerate(rows) for j in range(len(drafts))),
                       key=lambda c: -c[0])
        model, S = self.cost_model, len(out.scheduled)
        width = spec.width
        context = sum(row.request.num_computed_tokens + row.num_new_tokens for row in out.scheduled.values())

        def predict(T: int, n_rows: int, wide: bool) -> float:
            Tb, Sb = self.bucket_pair(T, n_rows)
            return model.predict(StepShape(Tb, Sb, context + T - total, width if wide else 1))

        x = speculation.choose(cands, total, S, self.config.max_num_batched_tokens - total,
                               self.config.token_buckets, predict if model is not None else None,
                               self.target_step_seconds)
        per_row = [0] * len(rows)
        for _, i in cands[:x]:
            per_row[i] += 1
        added = 0
        for (row, drafts, _), k in zip(rows, per_row):
            # the request's blocks for its proposals too; from the free pool only, else fewer
            while k and not bm.allocate_slots(row.request, 1 + k):
                k -= 1
            if k:
                row.spec_token_ids = drafts[:k]
                row.num_new_tokens = 1 + k
                added += k
        if added:
            out.width = width
            out.num_draft_tokens = added
        return added

    @staticmethod
    def _commit(row: ScheduledRequest) -> None:
        """Count a row's tokens as computed once the step's decisions are final (before the step
        runs: the next schedule() may come before this step's tokens are read), and mark the
        token it samples as pending until update() reads it."""
        req = row.request
        known = req.num_tokens
        # proposals are not counted as computed: update() counts the ones kept
        n = row.num_new_tokens - len(row.spec_token_ids)
        row.from_prev = req.num_computed_tokens + n > known  # only a pending token: n == 1
        row.output_index = req.num_output_tokens + req.num_pending
        row.start = req.num_computed_tokens
        req.num_computed_tokens += n
        if req.num_computed_tokens == known + req.num_pending:
            row.samples = True
            req.num_pending += 1

    def _length_reached(self, req: Request, pending: int) -> bool:
        """Whether a request's tokens, with `pending` more not read yet, reach max_tokens or
        max_model_len: it ends then, whatever the tokens are (update(); with overlapped scheduling
        a request whose pending token is its last gets no row meanwhile)."""
        max_tokens = req.sampling_params.max_tokens
        return ((max_tokens is not None and req.num_output_tokens + pending >= max_tokens)
                or req.num_tokens + pending >= self.config.max_model_len)

    def _proposal_room(self, req: Request) -> tuple[int, float]:
        """How many proposals the request may be given when its next decode step is scheduled (its
        tokens read), 0 where it verifies none, and its acceptance rate."""
        # A draft model's proposals are made on the device, after the packer built the tables that
        # would count them (penalties, min_tokens) and the grammar masks that would follow them:
        # such rows verify none. A fixed mask, allowed_token_ids and logit_bias apply alike at
        # every position.
        rate = speculation.acceptance_rate(req.spec_kept, req.spec_tried)
        if self.proposer.on_device and (req.sampling_params.uses_penalties or (
                req.constraint is not None and req.constraint.depends_on_tokens)):
            return 0, rate
        if rate < speculation.MIN_RATE and self.step_count - req.spec_step < speculation.RETRY_STEPS:
            return 0, rate
        return max(0, min(self.config.speculative.num_speculative_tokens, self._steps_left(req) - 1)), rate

    def may_propose(self, out: SchedulerOutput) -> bool:
        """With overlapped scheduling: whether a row of step `out` (dispatched, its tokens unread)
        may be given proposals in the next step, which must then be scheduled after its tokens are
        read (proposals follow a request's read tokens; engine/core.py pauses the overlap). A step
        that verified proposals must be read first anyway: how many it kept moves the next row."""
        if out.num_draft_tokens:
            return True
        if not self.speculating:
            return False
        return any(row.samples and not row.request.is_finished and self._proposal_room(row.request)[0]
                   and self.step_count - row.request.spec_empty_step >= speculation.EMPTY_RETRY_STEPS
                   for row in out.scheduled.values())

    def _steps_left(self, req: Request) -> int:
        """Decode steps a running request has at most to go: tokens left to sample before
        max_tokens or max_model_len (EOS or a stop string may end it sooner)."""
        left = self.config.max_model_len - req.num_tokens - req.num_pending
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            left = min(left, max_tokens - req.num_output_tokens - req.num_pending)
        return left

    def _waits_for_leader(self, req: Request) -> bool:
        """A sibling of an n > 1 request waits until the first sibling has computed its prompt, then
        takes the prompt's full blocks from the prefix cache and a copy of the partial last one."""
        if req.group_id is None:
            return False
        leader = self._group_leader.get(req.group_id)
        if leader is None or leader is req:
            return False
        return leader.num_computed_tokens < leader.num_prompt_tokens - 1

    def _copy_tail(self, req: Request, n_hit_blocks: int, n: int, out: SchedulerOutput) -> int:
        """Copy-on-write for a sibling of an n > 1 request that took the prompt's full blocks: the
        prompt's partial last block is copied from the first sibling's (it will diverge there)
        instead of being computed again. Returns the tokens the copy saves; 0 when not applicable."""
        leader = self._group_leader.get(req.group_id) if req.group_id is not None else None
        if leader is None or leader is req or leader.status != RequestStatus.RUNNING or req.num_output_tokens:
            return 0
        bm = self.block_manager
        P, G = bm.block_size, bm.G
        n_prompt = req.num_prompt_tokens
        full = (n_prompt - 1) // P
        tail = n_prompt - 1 - full * P  # prompt tokens in the partial block, the last one excluded
        if (tail <= 0 or n_hit_blocks != full or n != n_prompt - full * P
                or leader.num_computed_tokens < n_prompt - 1):
            return 0
        # the block's page in every group (a sliding group's is gone once the leader's window passed it)
        src = bm.block_ids(leader.request_id)[full * G : (full + 1) * G]
        dst = bm.block_ids(req.request_id)[full * G : (full + 1) * G]
        if len(src) < G or NULL_BLOCK in src or NULL_BLOCK in dst:
            return 0
        out.blocks_to_copy.extend(zip(src, dst))
        self.num_block_copies += 1
        return tail

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        """Bring back swapped requests and admit waiting ones, in policy order. With a policy that
        allows it, a candidate that does not fit (no seat, no blocks, or above swap_threshold)
        preempts the lowest-ranked running request if that one ranks below it, even one already
        scheduled this step (vLLM v1's rule); a request preempted this step is not re-admitted."""
        cfg = self.config
        bm = self.block_manager
        key = self._key
        skip = self._preempted_now
        j = 0  # first waiting request not skipped this step
        k = 0  # first swapped request not skipped this step
        while budget > 0:
            # (a request preempted this step may still have a pending token; it is skipped too)
            while j < len(self.waiting) and (self._waits_for_leader(self.waiting[j])
                                             or self.waiting[j].request_id in skip):
                j += 1
            while k < len(self.swapped) and self.swapped[k].request_id in skip:
                k += 1
            cand_w = self.waiting[j] if j < len(self.waiting) else None
            cand_s = self.swapped[k] if k < len(self.swapped) else None
            if cand_s is None and cand_w is None:
                break
            use_swapped = cand_s is not None and (cand_w is None or key(cand_s) <= key(cand_w))
            req = cand_s if use_swapped else cand_w
            if len(self.running) >= cfg.max_num_seqs:
                fits = False
            elif use_swapped:
                n = min(req.num_tokens - req.num_computed_tokens, budget, cfg.long_prefill_token_threshold or budget)
                fits = bm.allocate_slots(req, n)
            elif self.running and bm.usage > cfg.swap_threshold:
                # Above swap_threshold only running requests grow: admitting more would force
                # preemptions a few steps later.
                fits = False
            else:
                # a request owing prompt logprobs computes its whole prompt (vLLM's rule): cached
                # blocks would skip the positions whose logits give them
                hits = [] if req.wants_prompt_logprobs else bm.lookup(req)  # G pages a block
                hit_tokens = len(hits) // bm.G * bm.block_size
                n = req.num_tokens - hit_tokens
                if req.wants_prompt_logprobs:
                    n = min(n, self._room_for_prompt_logprobs(budget))
                    if n <= 0:
                        break
                if n > budget and not cfg.enable_chunked_prefill:
                    fits = False
                else:
                    n = min(n, budget, cfg.long_prefill_token_threshold or n)
                    fits = bm.allocate_slots(req, n, hits)
            if not fits:
                freed = self._preempt_lower(req, out)
                if freed is None:
                    break
                budget += freed
                continue
            if use_swapped:
                host = self.swap_pool.release(req.request_id)
                # the pages swapped out, in order: the sliding ones the window passed are not among them
                out.blocks_to_swap_in.extend(zip(host, (b for b in bm.block_ids(req.request_id) if b != NULL_BLOCK)))
                out.swapped_in.append(req.request_id)
                del self.swapped[k]
            else:
                if bm.uses_cache(req):
                    bm.prefix_queries += req.num_tokens
                    bm.prefix_hits += hit_tokens
                req.num_computed_tokens = hit_tokens
                copied = self._copy_tail(req, len(hits) // bm.G, n, out)
                req.num_computed_tokens += copied
                n -= copied
                del self.waiting[j]
            req.status = RequestStatus.RUNNING
            self._insert(self.running, req)
            out.scheduled[req.request_id] = ScheduledRequest(req, n)
            budget -= n
            if req.wants_prompt_logprobs:
                budget = self._prompt_logprobs_step(out, budget)
        return budget

    def _room_for_prompt_logprobs(self, budget: int) -> int:
        """Tokens a row owing prompt logprobs may take: its step must fit the prompt logprobs
        programs' token bucket."""
        return min(budget, self.prompt_logprobs_tokens - (self.config.max_num_batched_tokens - budget))

    def _prompt_logprobs_step(self, out: SchedulerOutput, budget: int) -> int:
        """The step now has a row owing prompt logprobs: it runs at that token bucket, which caps the
        rows after it. Returns the budget left."""
        out.prompt_logprobs = True
        return self._room_for_prompt_logprobs(budget)

    def _preempt_lower(self, cand: Request, out: SchedulerOutput) -> int | None:
        """Preempt the lowest-ranked running request for `cand` if the policy allows it and that
        request ranks below cand. Returns the budget it gave back (its tokens if it was scheduled
        this step), or None when there is no such request."""
        key = self._key
        if not self.running or not self.policy.preempts_for_priority:
            return None
        victim = self.running[-1]
        if key(victim) <= key(cand):
            return None
        self.running.pop()
        # un-schedule it if it was scheduled this step: its KV so far stays valid, this step's tokens were not run
        row = out.scheduled.pop(victim.request_id, None)
        self._preempt(victim, out)
        return row.num_new_tokens if row is not None else 0

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Give a running request's blocks back. By swap: its computed KV is copied to host blocks
        (the copy runs at the start of this step, before anything overwrites the freed blocks) and
        it resumes where it stopped. By recompute: its KV is dropped and prompt + outputs so far
        are prefilled again (prefix-cache hits may shorten that). "auto" swaps when recomputing
        would cost more than the copy: siblings of an n > 1 request, long contexts."""
        cfg = self.config
        bm = self.block_manager
        rid = req.request_id
        self._preempted_now.add(rid)
        self.num_preemptions += 1
        req.num_preemptions += 1
        mode = cfg.preemption_mode
        swap = mode == "swap" or (
            mode == "auto" and (req.group_size > 1 or req.num_computed_tokens >= cfg.swap_min_tokens))
        if swap and req.num_computed_tokens > 0:
            # the computed blocks' pages, but for the sliding ones the window has passed (swap-in
            # allocates none for them either: allocate_slots from the same position)
            bm.trim(rid, req.num_computed_tokens)
            live = [b for b in bm.block_ids(rid)[: cdiv(req.num_computed_tokens, bm.block_size) * bm.G]
                    if b != NULL_BLOCK]
            host = self.swap_pool.allocate(rid, len(live))
            if host is not None:  # else the host pool is full: fall back to recompute
                out.blocks_to_swap_out.extend(zip(live, host))
                bm.free(rid)
                req.status = RequestStatus.SWAPPED
                self._insert(self.swapped, req)
                out.swapped_out.append(rid)
                self.num_swap_outs += 1
                return
        bm.free(rid)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self._insert(self.waiting, req)
        out.preempted.append(rid)

    def bucket_pair(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """The (T, S) bucket pair of a step of num_tokens tokens in num_seqs rows."""
        T = round_up(self.config.token_buckets, num_tokens)
        return T, round_up(seq_buckets_for(self.config.seq_buckets, T), num_seqs)

    def _choose_by_cost(self, out: SchedulerOutput, total: int, was_running: set[str]) -> int:
        """Size the step by predicted cost. Candidates: the step as scheduled, and each token
        bucket below it that deferring decode rows (of requests running before this step,
        lowest-ranked first, none deferred in the last step, so none waits twice in a row; once
        nothing waits, only rows that still end no later than the step's longest) can reach. Picks
        the most tokens per predicted second. With target_step_seconds, prefill chunks are trimmed
        instead (latest first, each keeps a token; a deferred decode row is the latency the target
        protects): the largest candidate predicted within it, or the quickest when none is. Returns
        the step's tokens; out.scheduled is trimmed to match."""
        rows = list(out.scheduled.values())
        model, target = self.cost_model, self.target_step_seconds
        # Prefill chunks are trimmed only to keep a TPOT target. For throughput they keep the budget
        # (max_paddings has trimmed them already): trimming moves prompt tokens to a later step
        # rather than saving them, and every step with a queue is full, so on a noisy cost table
        # the trims that looked a few per cent better added steps to the run (docs/PERFORMANCE.md).
        chunk_cut = 0 if target is None else sum(row.num_new_tokens - 1 for row in rows)
        # While requests wait, any decode row may be deferred. Once the batch drains, only a row
        # with slack: one that, put off a step, still samples its last token no later than the
        # longest row in the step, which is never deferred. Deferring any row then lengthened the
        # tail that ends the run (measured: docs/PERFORMANCE.md); with slack the run keeps its
        # number of steps and each costs less.
        longest = max(self._steps_left(row.request) for row in rows)
        deferrable = [] if target is not None else [
            row for row in reversed(rows) if row.num_new_tokens == 1 and row.request.request_id in was_running
            and row.request.deferred_step != self.step_count - 1
            and (self.waiting or self._steps_left(row.request) < longest)]
        context = sum(row.request.num_computed_tokens + row.num_new_tokens for row in rows)
        floor = total - chunk_cut - len(deferrable)
        best, best_score = total, None
        dropped_ctx = list(itertools.accumulate((row.request.num_computed_tokens + 1 for row in deferrable),
                                                initial=0))  # context the first j deferred rows take off
        for k in [total, *reversed([b for b in self.config.token_buckets if floor <= b < total])]:
            cut = total - k
            trimmed = min(cut, chunk_cut)
            n_dropped = cut - trimmed
            ctx = context - trimmed - dropped_ctx[n_dropped]
            seconds = model.predict(StepShape(*self.bucket_pair(k, len(rows) - n_dropped), ctx))
            if target is not None:
                if best_score is None or seconds < best_score:
                    best, best_score = k, seconds
                if seconds <= target:
                    break  # the largest within the target
                continue
            score = k / seconds if seconds > 0 else 0.0
            if best_score is None or score > best_score:
                best, best_score = k, score
        if best < total:
            cut = total - best
            trimmed = min(cut, chunk_cut)
            self._trim(rows, trimmed)
            for row in deferrable[: cut - trimmed]:
                req = row.request
                del out.scheduled[req.request_id]
                self.block_manager.set_slots(req, req.num_computed_tokens)  # blocks kept: needed next step
                req.deferred_step = self.step_count
            out.num_deferred = cut - trimmed
            self.num_deferred += out.num_deferred
        return best

    def _trim(self, rows: list[ScheduledRequest], excess: int) -> None:
        """Take `excess` tokens off prefill chunks, latest row first, each keeping at least one."""
        bm = self.block_manager
        for row in reversed(rows):
            if excess == 0:
                break
            cut = min(excess, row.num_new_tokens - 1)
            if cut > 0:
                row.num_new_tokens -= cut
                excess -= cut
                bm.set_slots(row.request, row.request.num_computed_tokens + row.num_new_tokens)

    def _fit_bucket(self, rows: list[ScheduledRequest], total: int) -> int:
        """Trim prefill chunks (latest first, each keeps >= 1 token) so the step lands exactly on
        the bucket below when rounding up would pad more than max_paddings tokens. The trimmed
        tokens simply run next step."""
        cfg = self.config
        buckets = cfg.token_buckets
        k = bisect.bisect_left(buckets, total)
        if buckets[k] - total <= cfg.max_paddings or k == 0 or not cfg.enable_chunked_prefill:
            return total
        excess = total - buckets[k - 1]
        if sum(row.num_new_tokens - 1 for row in rows) < excess:
            return total
        self._trim(rows, excess)
        return buckets[k - 1]

    def update(self, out: SchedulerOutput, sampled_token_ids: Sequence[int],
               drafts: Sequence[Sequence[int]] | None = None) -> list[int]:
        """Apply a step's results. Returns the batch indices of requests that got new tokens (each
        row's num_output says how many).

        sampled_token_ids[i * Q + j] is the token sampled for the i-th row of out.scheduled at its
        j-th logits position (Q = out.width; 1 without proposals); it only counts when that row
        caught up with all the request's tokens (a partial prefill chunk samples a token that is
        thrown away) and the request has not ended since. A row with proposals keeps those its
        sampler drew the same token for, in order, and the token drawn at the first that differs
        (or after the last): the tokens the target model alone would have produced, greedy or
        drawn (speculation.py). With overlapped scheduling the next step was scheduled already: a
        request preempted by it still gets its token here. drafts[i]: a draft model's proposals for
        the i-th row, made in the step (draft_slots.py), in place of its placeholders.
        """
        if drafts is not None:
            for row, made in zip(out.scheduled.values(), drafts):
                if row.spec_token_ids:
                    row.spec_token_ids = list(made[: len(row.spec_token_ids)])
        got_token: list[int] = []
        ended: list[tuple[Request, RequestStatus]] = []
        sampled = sampled_token_ids.tolist() if hasattr(sampled_token_ids, "tolist") else sampled_token_ids
        Q = out.width
        for i, row in enumerate(out.scheduled.values()):
            req = row.request
            if not row.samples or req.is_finished:  # aborted or failed since schedule()
                continue
            req.num_pending -= 1
            drafts = row.spec_token_ids
            tokens = sampled[i * Q : i * Q + len(drafts) + 1]
            kept = kept_proposals(tokens, drafts)
            if drafts:
                self._count_drafts(req, len(drafts), kept)
                req.spec_step = self.step_count
            got_token.append(i)
            status = None
            for token in [*drafts[:kept], tokens[kept]]:
                req.output_token_ids.append(int(token))
                row.num_output += 1
                status = self._finish_status(req, int(token))
                if status is not None:
                    break
            if status is not None:
                was = req.status
                self._finish(req, status)
                ended.append((req, was))
            elif drafts:
                # the kept proposals' K/V is computed; the slots past them go back (their blocks
                # stay with the request, which grows into them)
                req.num_computed_tokens += kept
                self.block_manager.set_slots(req, req.num_computed_tokens)
        if ended:
            self.running = [r for r in self.running if not r.is_finished]
            if any(was != RequestStatus.RUNNING for _, was in ended):  # preempted by the next step
                self.waiting = [r for r in self.waiting if not r.is_finished]
                self.swapped = [r for r in self.swapped if not r.is_finished]
        return got_token

    def _count_drafts(self, req: Request, proposed: int, kept: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += kept
        for j in range(kept):
            self.accepted_per_pos[j] += 1
        req.spec_kept, req.spec_tried = speculation.record(req.spec_kept, req.spec_tried, proposed, kept)

    def _finish_status(self, req: Request, token: int) -> RequestStatus | None:
        """Whether the request ends with `token`, just appended to its output: its grammar refused
        it (an error) or is complete, EOS, a stop token id, or its length."""
        params = req.sampling_params
        if req.constraint is not None:  # the mask allowed it, so the grammar takes it (else: a bug, this request fails)
            why = req.constraint.accept(token)
            if why is not None:
                req.error, req.error_param = why, req.constraint.param
                return RequestStatus.FINISHED_ERROR
            if req.constraint.finished:  # the output is complete: the grammar allows nothing more
                return RequestStatus.FINISHED_STOPPED
        if not params.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if self._length_reached(req, 0):
            return RequestStatus.FINISHED_LENGTH
        return None

    def check_invariants(self) -> None:
        """Queues are disjoint and consistent with statuses and the pools. For tests."""
        cfg = self.config
        ids = [r.request_id for q in (self.waiting, self.running, self.swapped) for r in q]
        assert len(ids) == len(set(ids)), "a request is in two queues"
        assert set(ids) == set(self.requests), "queues and the request table disagree"
        assert len(self.running) <= cfg.max_num_seqs, "running exceeds max_num_seqs"
        for r in self.waiting:
            assert r.status == RequestStatus.WAITING and r.request_id not in self.block_manager.req_blocks
        for r in self.swapped:
            assert r.status == RequestStatus.SWAPPED and r.request_id in self.swap_pool.req_blocks
        for r in self.running:
            assert r.status == RequestStatus.RUNNING
        self.block_manager.check_invariants()
        self.swap_pool.check_invariants()


# the token bucket of steps with a row owing prompt logprobs: at least this, or the step's budget
PROMPT_LOGPROBS_TOKENS = 256


def prompt_logprobs_tokens(cfg: SchedulerConfig) -> int:
    """The token bucket of steps with a row owing prompt logprobs. Large enough for a full step of
    decode rows beside such a row's chunk, so that the running rows never keep it out."""
    want = min(cfg.max_num_batched_tokens, max(PROMPT_LOGPROBS_TOKENS, cfg.max_num_seqs + 1))
    return round_up(cfg.token_buckets, want)


def prompt_logprobs_buckets(cfg: SchedulerConfig) -> tuple[int, int]:
    """The one (T, S) of steps with a row owing prompt logprobs: their programs take logprobs at every
    token, and one such program (per engine) costs a warm-up less than one per bucket pair would;
    the S bucket holds as many rows as any step of T tokens can have (the rows past the step's are
    padding, which the packed matmuls skip on a CPU)."""
    T = prompt_logprobs_tokens(cfg)
    return T, round_up(seq_buckets_for(cfg.seq_buckets, T), min(T, cfg.max_num_seqs))


def kept_proposals(sampled: Sequence[int], proposed: Sequence[int]) -> int:
    """How many of a row's proposals it keeps: those, in order, that its sampler drew the same token
    for at their positions. Each position's draw is the one the step without proposals would make
    there (the request's seed and that output index, over the target's logits given the kept
    tokens before it), so the kept tokens and the one drawn after them are exactly the target's:
    rejection sampling against proposals that are one token each (ngram's), whose acceptance test
    min(1, p / q) is "the draw from p is that token", and whose residual draw is p without it."""
    kept = 0
    while kept < len(proposed) and sampled[kept] == proposed[kept]:
        kept += 1
    return kept


def check_fits(n_prompt: int, max_tokens: int | None, cfg: SchedulerConfig, block_size: int,
               num_usable_blocks: int, groups: KVGroups | None = None) -> None:
    """Refuse (InvalidRequestError, naming the field) a request of n_prompt prompt tokens and
    max_tokens that could never be scheduled: the front end asks before a request reaches a core,
    and the scheduler asks again as each comes in. groups: the model's KV layer groups (a block
    is then a page of one group's layers; core/kv_groups.py)."""
    if n_prompt >= cfg.max_model_len:
        raise InvalidRequestError(
            f"prompt is {n_prompt} tokens but max_model_len is {cfg.max_model_len}: the prompt must "
            f"be shorter than max_model_len (shorten it or raise max_model_len)", "prompt"
        )
    if max_tokens is not None and n_prompt + max_tokens > cfg.max_model_len:
        raise InvalidRequestError(
            f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) = {n_prompt + max_tokens} exceeds "
            f"max_model_len ({cfg.max_model_len}): lower max_tokens to at most {cfg.max_model_len - n_prompt}",
            "max_tokens"
        )
    if not cfg.enable_chunked_prefill and n_prompt > cfg.max_num_batched_tokens:
        raise InvalidRequestError(
            f"prompt is {n_prompt} tokens but max_num_batched_tokens is {cfg.max_num_batched_tokens} "
            "and chunked prefill is off: enable_chunked_prefill=True or raise max_num_batched_tokens", "prompt"
        )
    final_len = n_prompt + max_tokens if max_tokens is not None else cfg.max_model_len
    needed = (groups or FULL_ATTENTION).pages_for(final_len, block_size, cfg.max_num_batched_tokens)
    if needed > num_usable_blocks:
        raise InvalidRequestError(
            f"request needs {needed} KV blocks ({final_len} tokens) but the "
            f"pool has {num_usable_blocks}: lower max_tokens or enlarge the pool "
            "(gpu_memory_utilization / num_gpu_blocks_override)", "max_tokens"
        )
