"""The front end's output side: a core's token ids -> text, stop strings, logprobs, n > 1 groups.

vLLM v1 splits its EngineCore (schedule, execute, update: token ids only) from an OutputProcessor
in the front end; so does this engine. The processor keeps, per request, what only outputs need: an
incremental detokenizer per sample, the tokens and logprobs a CUMULATIVE or FINAL_ONLY output
returns, and how much of each sample a DELTA output has sent. A request with n samples runs in the
core as n sibling requests ("{i}_{id}"); their outputs are reported together under the request's
id. A stop string ends a sample here: process() returns its core id for the caller to abort.

Outputs are built only as a request asks: DELTA (what is new: what a stream sends, so a long
stream costs time linear in its length), CUMULATIVE (everything so far, vLLM's default), or
FINAL_ONLY (one output when it ends: LLM.generate and non-streaming server requests).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from jaxsched.core.request import RequestOutputKind
from jaxsched.engine.core_messages import EngineCoreOutput, EngineCoreRequest, LogprobArrays, sample_ids
from jaxsched.engine.detokenizer import IncrementalDetokenizer
from jaxsched.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxsched.errors import InvalidRequestError

logger = logging.getLogger(__name__)


class _Sample:
    """One sample's output state (the request itself when n = 1)."""

    __slots__ = (
        "core_id",
        "cumulative_logprob",
        "detok",
        "error",
        "error_param",
        "finish_reason",
        "finished_time",
        "first_scheduled_time",
        "first_token_time",
        "logprobs",
        "num_preemptions",
        "sent_chars",
        "stop_reason",
        "token_ids",
    )

    def __init__(self, core_id: str, detok: IncrementalDetokenizer, logprobs: bool) -> None:
        self.core_id = core_id
        self.detok = detok
        # its tokens and logprobs (with DELTA outputs: those no output has yet)
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if logprobs else None
        self.cumulative_logprob = 0.0
        self.sent_chars = 0  # DELTA: text that went out already
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.error_param: str | None = None
        self.first_scheduled_time = self.first_token_time = self.finished_time = 0.0
        self.num_preemptions = 0


class _Request:
    __slots__ = ("arrival_time", "params", "priority", "prompt", "prompt_logprobs", "prompt_logprobs_sent",
                 "prompt_token_ids", "request_id", "samples", "unfinished")

    def __init__(self, req: EngineCoreRequest, prompt: str | None, samples: list[_Sample]) -> None:
        self.request_id = req.request_id
        self.prompt = prompt
        self.prompt_token_ids = req.prompt_token_ids
        self.params = req.sampling_params
        self.arrival_time = req.arrival_time
        self.priority = req.priority
        self.samples = samples
        self.unfinished = len(samples)
        # prompt_logprobs: the prompt tokens' entries so far (the first token's None), as the core's
        # steps scored them; a DELTA output carries them once
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = \
            [None] if self.params.prompt_logprobs is not None else None
        self.prompt_logprobs_sent = False


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _Request] = {}
        self._by_core_id: dict[str, tuple[_Request, int]] = {}  # a sample's core id -> (request, index)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests or request_id in self._by_core_id

    def __len__(self) -> int:
        """Requests in flight."""
        return len(self._requests)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def request_of(self, core_id: str) -> str | None:
        """The id of the request a sample's core id belongs to (None: not tracked, or that sample ended)."""
        hit = self._by_core_id.get(core_id)
        return hit[0].request_id if hit is not None else None

    # -- requests in and out -------------------------------------------------------------------
    def add(self, req: EngineCoreRequest, prompt: str | None = None) -> None:
        """Track a request the front end is about to hand to a core; refuses it, tracking nothing,
        when its id or a sample's is in flight already."""
        params = req.sampling_params
        ids = sample_ids(req.request_id, params.n)
        taken = next((i for i in {req.request_id, *ids} if i in self), None)
        if taken is not None:
            raise InvalidRequestError(f"request_id {taken!r} is already in flight; use a unique id", "request_id")
        samples = [_Sample(sid, IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params),
                           params.logprobs is not None) for sid in ids]
        state = _Request(req, prompt, samples)
        self._requests[req.request_id] = state
        for i, sid in enumerate(ids):
            self._by_core_id[sid] = (state, i)

    def _find(self, request_id: str) -> _Request | None:
        state = self._requests.get(request_id)
        if state is None and request_id in self._by_core_id:
            state = self._by_core_id[request_id][0]
        return state

    def forget(self, request_ids: str | Iterable[str]) -> list[str]:
        """Stop tracking requests (by a request's id or a sample's: the whole request). Returns the
        core ids of their samples still running, for the caller to abort."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        running = []
        for rid in ids:
            state = self._find(rid)
            if state is None:
                continue
            running += [s.core_id for s in state.samples if s.finish_reason is None]
            self._drop(state)
        return running

    def abort(self, request_ids: str | Iterable[str]) -> tuple[list[RequestOutput], list[str]]:
        """End requests as aborted: their final outputs (finish_reason "abort" on the samples still
        running) and the core ids to abort."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs, running = [], []
        now = time.monotonic()
        for rid in ids:
            state = self._find(rid)
            if state is None:
                continue
            for s in state.samples:
                if s.finish_reason is None:
                    running.append(s.core_id)
                    s.finish_reason, s.finished_time = "abort", now
            state.unfinished = 0
            outputs.append(self._output(state, range(len(state.samples)), final=True))
            self._drop(state)
        return outputs, running

    def _drop(self, state: _Request) -> None:
        self._requests.pop(state.request_id, None)
        for s in state.samples:
            self._by_core_id.pop(s.core_id, None)

    # -- a core's outputs ----------------------------------------------------------------------
    def process(self, outputs: Iterable[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """The RequestOutputs of a step's core outputs (as their requests asked for them), and the
        core ids of samples that ended here (a stop string, output that could not be processed),
        which the caller aborts in the core. Outputs of requests no longer tracked are ignored
        (aborted, or ended by a stop string while the core ran on)."""
        changed: dict[str, tuple[_Request, list[int]]] = {}
        to_abort: list[str] = []
        now = time.monotonic()
        for o in outputs:
            hit = self._by_core_id.get(o.request_id)
            if hit is None:
                continue
            state, i = hit
            s = state.samples[i]
            if s.finish_reason is not None:
                continue
            if o.first_scheduled_time:
                s.first_scheduled_time = o.first_scheduled_time
            if o.prompt_logprobs is not None:
                self._add_prompt_logprobs(state, o)
                if not o.new_token_ids and o.finish_reason is None:
                    continue  # a prefill chunk: nothing to output yet
            if o.new_token_ids and not s.first_token_time:
                s.first_token_time = now
            try:
                self._add_tokens(s, o, state.params.logprobs)
            except Exception as e:  # noqa: BLE001 - e.g. a tokenizer that cannot decode a token: this request alone fails
                why = f"its output could not be processed: {type(e).__name__}: {e}"
                logger.error("request %r failed: %s", state.request_id, why)
                for other in state.samples:
                    if other.finish_reason is None:
                        other.finish_reason, other.error, other.finished_time = "error", why, now
                        to_abort.append(other.core_id)
                        state.unfinished -= 1
                changed.setdefault(state.request_id, (state, []))[1].extend(range(len(state.samples)))
                continue
            if s.detok.stop_string is not None and o.finish_reason in (None, "length"):
                # (a step may bring several tokens, speculative decoding's: the stop string can
                # come before the one that reached the length)
                s.finish_reason, s.stop_reason = "stop", s.detok.stop_string
                if o.finish_reason is None:
                    to_abort.append(s.core_id)
            elif o.finish_reason is not None:
                s.finish_reason = o.finish_reason
                s.stop_reason = o.stop_reason
                s.error, s.error_param = o.error, o.error_param
                s.num_preemptions = o.num_preemptions
            if s.finish_reason is not None:
                s.finished_time = now
                state.unfinished -= 1
                self._by_core_id.pop(s.core_id, None)
            changed.setdefault(state.request_id, (state, []))[1].append(i)
        results = []
        for state, which in changed.values():
            finished = state.unfinished == 0
            if finished:
                self._drop(state)
            elif state.params.output_kind == RequestOutputKind.FINAL_ONLY:
                continue
            results.append(self._output(state, which, final=finished))
        return results, to_abort

    def _add_tokens(self, s: _Sample, o: EngineCoreOutput, k: int | None) -> None:
        n = len(o.new_token_ids)
        for j, token in enumerate(o.new_token_ids):
            s.token_ids.append(token)
            if s.logprobs is not None and o.logprobs is not None:
                s.logprobs.append(self._logprobs_entry(o.logprobs, j, token, k or 0))
                s.cumulative_logprob += float(o.logprobs.logprob[j])
            s.detok.add_token(token, last=o.finish_reason is not None and j == n - 1)
            if s.detok.stop_string is not None:
                break

    def _add_prompt_logprobs(self, state: _Request, o: EngineCoreOutput) -> None:
        """A step's entries of prompt tokens o.prompt_logprobs_start on (samples of one request
        score the same prompt: the first entries to arrive for a token are kept)."""
        pl, k = state.prompt_logprobs, state.params.prompt_logprobs or 0
        if pl is None:
            return
        ids = state.prompt_token_ids
        for j in range(len(o.prompt_logprobs.logprob)):
            t = o.prompt_logprobs_start + j
            if t == len(pl):
                pl.append(self._logprobs_entry(o.prompt_logprobs, j, ids[t], k))

    def _logprobs_entry(self, lp: LogprobArrays, j: int, token: int, k: int) -> dict[int, Logprob]:
        dec = self.tokenizer.convert_ids_to_tokens
        entry = {token: Logprob(float(lp.logprob[j]), int(lp.rank[j]), dec(token))}
        for m in range(k):
            t = int(lp.top_ids[j, m])
            if t not in entry:
                entry[t] = Logprob(float(lp.top_logprobs[j, m]), m + 1, dec(t))
        return entry

    # -- building outputs ----------------------------------------------------------------------
    def _completion(self, s: _Sample, index: int, kind: RequestOutputKind, final: bool) -> CompletionOutput:
        text, ids, logprobs = s.detok.text, s.token_ids, s.logprobs
        if kind == RequestOutputKind.DELTA:
            # text a stop string may still remove stays back until it cannot (the detokenizer cuts
            # only what starts within holdback characters of the end)
            end = len(text) if s.finish_reason is not None else max(s.sent_chars, len(text) - s.detok.holdback)
            text, s.sent_chars = text[s.sent_chars:end], end
            # the sample holds only what no output has yet: handed over, and new lists begun
            s.token_ids = []
            if logprobs is not None:
                s.logprobs = []
        elif not final:  # copies: later tokens do not change this output (a final one hands its lists over)
            ids = ids[:]
            logprobs = logprobs[:] if logprobs is not None else None
        return CompletionOutput(index=index, text=text, token_ids=ids,
                                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                                logprobs=logprobs, finish_reason=s.finish_reason, stop_reason=s.stop_reason)

    def _output(self, state: _Request, which: Iterable[int], final: bool) -> RequestOutput:
        """The request's output after samples `which` changed: every sample's completion, or with
        DELTA outputs only the changed ones' (vLLM's parallel sampling)."""
        kind = state.params.output_kind
        samples = state.samples
        if len(samples) > 1 and kind != RequestOutputKind.DELTA:
            which = range(len(samples))
        if len(samples) == 1:
            comps = [self._completion(samples[0], 0, kind, final)]
        else:
            comps = [self._completion(samples[i], i, kind, final) for i in sorted(set(which))]
        metrics = None  # a stream's deltas carry none until the last: it is built per request per step
        if final or kind != RequestOutputKind.DELTA:
            started = [s.first_scheduled_time for s in samples if s.first_scheduled_time]
            tokened = [s.first_token_time for s in samples if s.first_token_time]
            metrics = RequestMetrics(state.arrival_time, min(started, default=0.0), min(tokened, default=0.0),
                                     max(s.finished_time for s in samples) if final else 0.0,
                                     sum(s.num_preemptions for s in samples))
        failed = next((s for s in samples if s.error), None)
        prompt_logprobs = state.prompt_logprobs
        if kind == RequestOutputKind.DELTA and prompt_logprobs is not None:
            prompt_logprobs, state.prompt_logprobs_sent = (None if state.prompt_logprobs_sent else prompt_logprobs), True
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, comps, final, metrics,
                             prompt_logprobs=prompt_logprobs, priority=state.priority,
                             error=failed.error if failed else None, error_param=failed.error_param if failed else None)
