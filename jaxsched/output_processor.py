"""The output side of a step: sampled tokens -> text, stop strings, logprobs, RequestOutputs.

vLLM splits its EngineCore (schedule, execute, update) from an OutputProcessor; so does this
engine. The processor keeps, per request, what only the outputs need (an incremental detokenizer,
logprobs so far) and the n > 1 groups: a request with n samples runs as n sibling Requests whose
outputs are reported together under the parent's id. It ends requests in the scheduler only through
the `finish` callback it is given (stop strings, errors, aborts).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from jaxsched.detokenizer import IncrementalDetokenizer
from jaxsched.errors import InvalidRequestError
from jaxsched.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxsched.request import Request, RequestOutputKind, RequestStatus

if TYPE_CHECKING:
    from jaxsched.runner import StepResult
    from jaxsched.sampler import SamplerOutput
    from jaxsched.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

Finish = Callable[[Iterable[str], RequestStatus], None]


class _RequestState:
    """Output-side extras of one (sample) request: detokenizer and logprobs, and with DELTA outputs
    how much of its text and tokens went out already."""

    __slots__ = ("cumulative_logprob", "detok", "logprobs", "request", "sent_chars", "sent_tokens")

    def __init__(self, request: Request, detok: IncrementalDetokenizer) -> None:
        self.request = request
        self.detok = detok
        self.logprobs: list[dict[int, Logprob]] | None = [] if request.sampling_params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.sent_chars = 0
        self.sent_tokens = 0


class _Group:
    """An n > 1 request: its samples run as sibling Requests; outputs are reported together."""

    __slots__ = ("child_ids", "children", "completions", "parent")

    def __init__(self, parent: Request, children: list[Request]) -> None:
        self.parent = parent
        self.children = children
        self.child_ids = [c.request_id for c in children]
        self.completions: list[CompletionOutput | None] = [None] * len(children)


def tracked_ids(req: Request) -> list[str]:
    """The ids a request occupies while in flight: its own, and with n > 1 its samples' ("{i}_{id}")."""
    n, rid = req.sampling_params.n, req.request_id
    return [rid] if n == 1 else [rid, *(f"{i}_{rid}" for i in range(n))]


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request: distinct per sample, reproducible per seed."""
    return (seed + index * 0x9E3779B1) % (2**31 - 1)


class OutputProcessor:
    def __init__(self, tokenizer, finish: Finish, enable_prefix_caching: bool) -> None:
        self.tokenizer = tokenizer
        self.finish = finish
        self.enable_prefix_caching = enable_prefix_caching
        self._states: dict[str, _RequestState] = {}
        self._groups: dict[str, _Group] = {}  # parent request id -> its samples

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states or request_id in self._groups

    # -- requests in and out -------------------------------------------------------------------
    def add(self, req: Request) -> list[Request]:
        """Track a request; returns the Requests to schedule: itself, or with n > 1 its samples
        ("{i}_{request_id}", as vLLM names them), which share the prompt's KV blocks. Refuses the
        request, tracking nothing, when its id or a sample's is in flight already."""
        n = req.sampling_params.n
        rid = req.request_id
        ids = tracked_ids(req)
        taken = next((i for i in ids if i in self), None)
        if taken is not None:
            raise InvalidRequestError(f"request_id {taken!r} is already in flight; use a unique id", "request_id")
        if n == 1:
            self._track(req)
            return [req]
        # With prefix caching off, the samples share blocks only among themselves.
        salt = req.cache_salt if self.enable_prefix_caching else int.from_bytes(
            hashlib.blake2b(rid.encode(), digest_size=8).digest(), "little")
        children = [dataclasses.replace(req, request_id=f"{i}_{rid}", sample_seed=sample_seed(req.sample_seed, i),
                                        group_id=rid, group_size=n, output_token_ids=[], block_hashes=[],
                                        cache_salt=salt, constraint=req.constraint and req.constraint.fork())
                    for i in range(n)]
        for child in children:
            self._track(child)
        self._groups[rid] = _Group(req, children)
        return children

    def _track(self, req: Request) -> None:
        self._states[req.request_id] = _RequestState(
            req, IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.sampling_params))

    def forget(self, request_ids: str | Iterable[str]) -> list[str]:
        """Stop tracking requests (an abort, or an add the scheduler refused). An id of an n > 1
        request or of one of its samples forgets the whole group. Returns every sample id
        forgotten, for the scheduler to end."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        expanded = []
        for rid in ids:
            gid, members = self._group_of(rid)
            if gid is not None:
                del self._groups[gid]
            expanded.extend(members)
        for rid in expanded:
            self._states.pop(rid, None)
        return expanded

    def _group_of(self, rid: str) -> tuple[str | None, list[str]]:
        """(group id, its sample ids) when `rid` is an n > 1 request or one of its samples, else
        (None, [rid]): ending one sample ends them all."""
        state = self._states.get(rid)
        if state is not None and state.request.group_id in self._groups:
            rid = state.request.group_id
        group = self._groups.get(rid)
        return (rid, list(group.child_ids)) if group is not None else (None, [rid])

    def fail(self, reasons: dict[str, str]) -> list[RequestOutput]:
        """End requests that failed (request id -> why), with their sibling samples: FINISHED_ERROR
        in the scheduler, and their final outputs, with `error` set."""
        now = time.monotonic()
        ended: dict[str, list[str]] = {}  # group id (or own id) -> its samples that end
        for rid, why in reasons.items():
            if rid not in self._states or self._states[rid].request.error:  # ended with a sibling
                continue
            logger.error("request %s failed: %s", rid, why)
            gid, ids = self._group_of(rid)
            ids = [r for r in ids if r in self._states]
            for r in ids:
                req = self._states[r].request
                req.error, req.error_param, req.finished_time = why, None, now
            req = self._states[rid].request  # it was in a step (a sibling may not have been)
            req.first_scheduled_time = req.first_scheduled_time or now
            ended[gid or rid] = ids
        self.finish([r for ids in ended.values() for r in ids], RequestStatus.FINISHED_ERROR)
        outputs = []
        for key, ids in ended.items():
            done = {r: self._output(self._states.pop(r)) for r in ids}
            if key not in self._groups:
                outputs.extend(done.values())
                continue
            group = self._groups[key]
            changed = []
            for r, o in done.items():
                changed.append(group.child_ids.index(r))
                group.completions[changed[-1]] = o.outputs[0]
            outputs.append(self._group_output(key, changed))
        return outputs

    # -- a step's outputs ----------------------------------------------------------------------
    def process(self, out: SchedulerOutput, got: list[int], res: StepResult) -> list[RequestOutput]:
        """Outputs of the requests that got a token in step `out` (rows `got`, as Scheduler.update
        returns them). The step's start is each request's first scheduling time."""
        rows = list(out.scheduled.values())
        for row in rows:
            if not row.request.first_scheduled_time:
                row.request.first_scheduled_time = res.started
        sampled = res.sampled
        now = time.monotonic()
        stopped, broken = [], {}
        for i in got:
            req = rows[i].request
            state = self._states[req.request_id]
            token = req.output_token_ids[-1]
            if not req.first_token_time:
                req.first_token_time = now
            try:
                if state.logprobs is not None:
                    state.logprobs.append(self._logprobs_entry(sampled, i, token, req.sampling_params.logprobs))
                    state.cumulative_logprob += float(sampled.logprob[i])
                state.detok.add_token(token, last=req.is_finished)
            except Exception as e:  # noqa: BLE001 - e.g. a tokenizer that cannot decode a token: this request alone fails
                broken[req.request_id] = f"its output could not be processed: {type(e).__name__}: {e}"
                continue
            if state.detok.stop_string is not None and not req.is_finished:
                req.stop_reason = state.detok.stop_string
                stopped.append(req.request_id)
        if stopped:
            self.finish(stopped, RequestStatus.FINISHED_STOPPED)
        outputs = self.fail(broken) if broken else []
        groups: dict[str, list[int]] = {}  # n > 1 requests with a new output: the samples that changed
        for i in got:
            req = rows[i].request
            if req.request_id not in self._states and req.error:  # failed above
                continue
            if req.is_finished:
                req.finished_time = now
                o = self._output(self._states.pop(req.request_id))
            elif req.sampling_params.output_kind == RequestOutputKind.FINAL_ONLY:
                continue  # nothing to build until it ends
            else:
                o = self._output(self._states[req.request_id])
            if req.group_id is None:
                outputs.append(o)
            elif req.group_id in self._groups:
                group = self._groups[req.group_id]
                j = group.child_ids.index(req.request_id)
                group.completions[j] = o.outputs[0]
                groups.setdefault(req.group_id, []).append(j)
        for gid, changed in groups.items():
            if (self._groups[gid].parent.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY
                    or self._group_finished(gid)):
                outputs.append(self._group_output(gid, changed))
        return outputs

    def _group_finished(self, gid: str) -> bool:
        return all(c is not None and c.finish_reason is not None for c in self._groups[gid].completions)

    def _group_output(self, gid: str, changed: Iterable[int]) -> RequestOutput:
        """The n > 1 request's output after its samples `changed` got theirs: every sample's
        completion, or with DELTA outputs only the changed ones' (vLLM's parallel sampling)."""
        group = self._groups[gid]
        parent = group.parent
        finished = self._group_finished(gid)
        if parent.sampling_params.output_kind == RequestOutputKind.DELTA:
            which = sorted(set(changed))
        else:
            which = range(len(group.completions))
        comps = []
        for i in which:
            c = group.completions[i]
            if c is None:  # a sample with no token yet
                c = CompletionOutput(index=i, text="", token_ids=[])
            c.index = i
            comps.append(c)
        if finished:
            del self._groups[gid]
        kids = group.children
        metrics = RequestMetrics(parent.arrival_time,
                                 min((c.first_scheduled_time for c in kids if c.first_scheduled_time), default=0.0),
                                 min((c.first_token_time for c in kids if c.first_token_time), default=0.0),
                                 max(c.finished_time for c in kids) if finished else 0.0,
                                 sum(c.num_preemptions for c in kids))
        failed = next((c for c in kids if c.error), None)
        return RequestOutput(gid, parent.prompt, parent.prompt_token_ids, comps, finished, metrics,
                             priority=parent.priority, error=failed.error if failed else None,
                             error_param=failed.error_param if failed else None)

    def _logprobs_entry(self, sampled: SamplerOutput, i: int, token: int, k: int) -> dict[int, Logprob]:
        dec = self.tokenizer.convert_ids_to_tokens
        entry = {token: Logprob(float(sampled.logprob[i]), int(sampled.rank[i]), dec(token))}
        for j in range(k):
            t = int(sampled.top_ids[i, j])
            if t not in entry:
                entry[t] = Logprob(float(sampled.top_logprobs[i, j]), j + 1, dec(t))
        return entry

    def _output(self, state: _RequestState) -> RequestOutput:
        req = state.request
        reason = req.finish_reason
        text, first = state.detok.text, 0  # first: the first token (and logprob) this output holds
        if req.sampling_params.output_kind == RequestOutputKind.DELTA:
            # text a stop string may still remove stays back until it cannot (the detokenizer
            # cuts only what starts within holdback characters of the end)
            end = len(text) if req.is_finished else max(state.sent_chars, len(text) - state.detok.holdback)
            text, state.sent_chars = text[state.sent_chars:end], end
            first, state.sent_tokens = state.sent_tokens, len(req.output_token_ids)
        comp = CompletionOutput(  # the slices are copies: later tokens do not change this output
            index=0, text=text, token_ids=req.output_token_ids[first:],
            cumulative_logprob=state.cumulative_logprob if state.logprobs is not None else None,
            logprobs=state.logprobs[first:] if state.logprobs is not None else None,
            finish_reason=reason.value if reason else None, stop_reason=req.stop_reason)
        metrics = RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time,
                                 req.finished_time, req.num_preemptions)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [comp], req.is_finished, metrics,
                             priority=req.priority, error=req.error, error_param=req.error_param)
