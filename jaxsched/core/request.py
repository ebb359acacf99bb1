"""Host-side request state and sampling parameters. Plain Python: no jax here.

A Request follows vLLM v1's counter model: there is no prefill phase and no decode phase. Each step
the scheduler gives a request some new tokens so that `num_computed_tokens` catches up with
`num_tokens + num_pending` (prompt + output, plus tokens sampled but not read yet). Chunked prefill,
recompute after preemption, prefix-cache hits and overlapped scheduling are all that one rule.
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jaxsched.core.limits import MAX_ALLOWED_TOKEN_IDS, MAX_LOGIT_BIAS, MAX_N, MAX_STOP, MAX_STOP_CHARS
from jaxsched.errors import InvalidRequestError
from jaxsched.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from jaxsched.structured.grammar import TokenConstraint


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = 4  # max_tokens or max_model_len
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # failed on its own (a value the step could not take); other requests go on
    FINISHED_TIMEOUT = 7  # its deadline passed (Request.deadline)
    FINISHED_QUEUE_TIMEOUT = 8  # it waited longer than its queue deadline without starting

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(str, enum.Enum):
    """The OpenAI / vLLM spelling of why a request ended."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    TIMEOUT = "timeout"
    QUEUE_TIMEOUT = "queue_timeout"  # the server answers 503 (it never started); offline it is the finish reason


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    RequestStatus.FINISHED_TIMEOUT: FinishReason.TIMEOUT,
    RequestStatus.FINISHED_QUEUE_TIMEOUT: FinishReason.QUEUE_TIMEOUT,
}


class RequestOutputKind(enum.IntEnum):
    """What a request's RequestOutputs hold (vLLM's names and values). CUMULATIVE: everything so
    far, every step. DELTA: what is new since the last one (text held back while a stop string
    may be starting, as a stream does). FINAL_ONLY: one output, when the request ends: what
    LLM.generate asks for, which saves the host building an output per request per step."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


INT32_MAX = 2**31 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what OpenAI-style clients send: int64, or uint64
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a bias value


def short_repr(v: object, limit: int = 40) -> str:
    """repr(v), cut to `limit` characters: error messages and log lines quote what they got without
    echoing a huge input (repr escapes line breaks and control characters)."""
    r = repr(v)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def _int(name: str, v: object, lo: int, hi: int | None, meaning: str) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        where = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise InvalidRequestError(f"{name} must be an integer {where} ({meaning}), got {short_repr(v)}", name)


def _float(name: str, v: object, lo: float, hi: float | None, meaning: str, low_open: bool = False) -> None:
    try:  # an int too large for a float overflows here
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    except OverflowError:
        ok = False
    ok = ok and (v > lo if low_open else v >= lo) and (hi is None or v <= hi)
    if not ok:
        where = f"{'(' if low_open else '['}{lo:g}, {f'{hi:g}]' if hi is not None else 'inf)'}"
        raise InvalidRequestError(f"{name} must be a finite number in {where} ({meaning}), got {short_repr(v)}",
                                  name)


@dataclass(frozen=True)
class SamplingParams:
    """vLLM's SamplingParams (the subset this engine implements), validated at construction.

    temperature 0 means greedy. top_k 0 or -1 disables top-k; top_p 1.0 and min_p 0.0 disable theirs.
    `seed` makes a request's samples reproducible whatever else is in the batch. `logprobs=k`
    returns the sampled token's logprob plus the k most likely alternatives at each step.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # the prompt tokens' logprobs too, with this many alternatives each (vLLM's): the first token's
    # entry is None; computed per step chunk (model_runner.py), not from the prefix cache
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Penalties, as vLLM applies them on device (see jaxsched/runner/sampler.py): presence and frequency
    # subtract over the output tokens so far; repetition divides positive / multiplies negative
    # logits of every prompt or output token (1 = off); min_tokens masks EOS and stop_token_ids.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    # Constraints on the tokens sampled: a grammar (jaxsched/structured/params.py), a bias added to
    # chosen logits ({token id: bias in [-100, 100]}, as OpenAI's logit_bias), a set of the only
    # tokens allowed. All three are applied on the device (sampler.py); logprobs stay the model's.
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] | None = None
    allowed_token_ids: tuple[int, ...] | list[int] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        # Normalise list-like fields to tuples so the object stays hashable and immutable.
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (tuple, list)):
            raise InvalidRequestError(
                f"stop must be a string or a list of strings, got {type(stop).__name__}", "stop")
        object.__setattr__(self, "stop", tuple(stop))
        if not isinstance(self.stop_token_ids, (tuple, list, type(None))):
            raise InvalidRequestError(
                f"stop_token_ids must be a list of token ids, got {type(self.stop_token_ids).__name__}",
                "stop_token_ids")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        # Every integer is bounded here, where it enters: what reaches the device's int32 arrays must
        # fit them (token ids are checked against the vocabulary in LLMEngine.make_request).
        _int("n", self.n, 1, MAX_N, "the number of samples")
        _float("temperature", self.temperature, 0.0, None, "0 means greedy")
        _float("top_p", self.top_p, 0.0, 1.0, "1 = off", low_open=True)
        _int("top_k", self.top_k, -1, None, "-1 or 0 = off; values above the vocabulary size act as off")
        _float("min_p", self.min_p, 0.0, 1.0, "0 = off")
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, 1, INT32_MAX, "None = up to max_model_len")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, INT32_MAX, "the number of alternatives per token")
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, 0, INT32_MAX, "the number of alternatives per prompt token")
        if self.seed is not None:
            _int("seed", self.seed, SEED_MIN, SEED_MAX, "any 64-bit integer, signed or unsigned")
        if len(self.stop) > MAX_STOP:
            raise InvalidRequestError(f"stop has {len(self.stop)} strings; at most {MAX_STOP} are allowed", "stop")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS:
                raise InvalidRequestError(f"stop must be non-empty strings of at most {MAX_STOP_CHARS} "
                                          f"characters, got {short_repr(s)}", "stop")
        if len(self.stop_token_ids) > MAX_STOP:
            raise InvalidRequestError(f"stop_token_ids has {len(self.stop_token_ids)} ids; at most {MAX_STOP} are "
                                      "allowed", "stop_token_ids")
        for t in self.stop_token_ids:
            _int("stop_token_ids", t, 0, INT32_MAX, "token ids of the vocabulary")
        for name in ("presence_penalty", "frequency_penalty"):
            _float(name, getattr(self, name), -2.0, 2.0, "0 = off")
        _float("repetition_penalty", self.repetition_penalty, 0.0, None, "1 = off, > 1 discourages repeats",
               low_open=True)
        _int("min_tokens", self.min_tokens, 0, INT32_MAX, "0 = off")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
                                      "min_tokens")
        self._check_constraints()
        kind = self.output_kind
        if not isinstance(kind, int) or isinstance(kind, bool) or kind not in tuple(RequestOutputKind):
            raise InvalidRequestError(f"output_kind must be a RequestOutputKind (0 CUMULATIVE, 1 DELTA, 2 FINAL_ONLY), "
                                      f"got {short_repr(kind)}", "output_kind")
        object.__setattr__(self, "output_kind", RequestOutputKind(kind))
        object.__setattr__(self, "_uses_penalties", self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                           or self.repetition_penalty != 1.0 or self.min_tokens > 0)

    def _check_constraints(self) -> None:
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise InvalidRequestError(f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}",
                                      "structured_outputs")
        bias = self.logit_bias
        if bias is not None:
            items = bias.items() if isinstance(bias, dict) else bias
            try:
                items = tuple((t, b) for t, b in items)
            except (TypeError, ValueError):
                raise InvalidRequestError("logit_bias must map token ids to numbers", "logit_bias") from None
            if len(items) > MAX_LOGIT_BIAS:
                raise InvalidRequestError(f"logit_bias has {len(items)} entries; at most {MAX_LOGIT_BIAS} are allowed",
                                          "logit_bias")
            for t, b in items:
                _int("logit_bias", t, 0, INT32_MAX, "keys are token ids of the vocabulary")
                _float("logit_bias", b, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT, "a value added to the token's logit")
            object.__setattr__(self, "logit_bias", tuple(sorted(dict(items).items())) or None)
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, (tuple, list)) or not allowed:
                raise InvalidRequestError("allowed_token_ids must be a non-empty list of token ids", "allowed_token_ids")
            if len(allowed) > MAX_ALLOWED_TOKEN_IDS:
                raise InvalidRequestError(f"allowed_token_ids has {len(allowed)} ids; at most {MAX_ALLOWED_TOKEN_IDS} "
                                          "are allowed", "allowed_token_ids")
            for t in allowed:
                _int("allowed_token_ids", t, 0, INT32_MAX, "token ids of the vocabulary")
            object.__setattr__(self, "allowed_token_ids", tuple(allowed))
            if so is not None:
                raise InvalidRequestError("allowed_token_ids cannot be combined with structured outputs: the grammar "
                                          "already decides which tokens may come; pass one of them",
                                          "allowed_token_ids")

    def with_max_tokens(self, max_tokens: int | None) -> SamplingParams:
        """These parameters with another max_tokens, which alone is checked: the prompts of one
        request share the rest, checked once (a list of thousands of allowed ids among them)."""
        if max_tokens == self.max_tokens:
            return self
        if max_tokens is not None:
            _int("max_tokens", max_tokens, 1, INT32_MAX, "None = up to max_model_len")
            if self.min_tokens > max_tokens:
                raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({max_tokens})",
                                          "min_tokens")
        new = copy.copy(self)
        object.__setattr__(new, "max_tokens", max_tokens)
        return new

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """Whether the sampler must see this request's token history (or mask its stop tokens)."""
        return self._uses_penalties  # set in __post_init__: the batch packer asks at every step


@dataclass(eq=False)
class Request:
    """One request's host state, owned by the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    eos_token_ids: tuple[int, ...] = ()
    # per-request sampling seed; the engine draws one for unseeded requests so runs replay exactly
    sample_seed: int = 0
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    # tokens whose K/V a scheduled step computes; counted when the step is scheduled, so with
    # overlapped scheduling it runs ahead of the tokens the host knows
    num_computed_tokens: int = 0
    # tokens sampled by scheduled steps that the host has not read yet (0 or 1 between steps; 2
    # for a moment with overlapped scheduling, when the next step is scheduled before the last
    # one's tokens are read). Positions num_tokens onwards hold them.
    num_pending: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    error: str | None = None  # why it ended with FINISHED_ERROR
    error_param: str | None = None  # set when its own input caused that: the field to change
    num_preemptions: int = 0
    deferred_step: int = -2  # the last step the step-cost model put this request's decode row off
    # speculative decoding: decayed counts of its proposals kept and tested (speculation.py)
    spec_kept: float = 0.0
    spec_tried: float = 0.0
    spec_step: int = 0  # the scheduler's step count when its proposals were last verified
    spec_empty_step: int = -(2**31)  # ... when the proposer last had nothing for it (no n-gram recurred)
    # prompt_logprobs: the prompt tokens whose logprobs went out (a recompute does not send them again)
    prompt_logprobs_done: int = 1
    # which tokens it may sample next (grammar.py): follows its accepted tokens; None = any
    constraint: TokenConstraint | None = None
    # arrival order, set by the scheduler: the tie-breaker of every ordering
    seq_no: int = 0
    # the scheduler's step count when the request arrived (priority aging counts steps, not seconds)
    arrival_step: int = 0
    # parallel sampling: the samples of one n > 1 request are sibling Requests of one group
    group_id: str | None = None
    group_size: int = 1
    # prefix caching: chain hashes of the full blocks hashed so far, and the chain's root (requests
    # with different salts never share blocks)
    block_hashes: list[bytes] = field(default_factory=list)
    cache_salt: int = 0
    # time.monotonic() after which the request ends (FINISHED_TIMEOUT), and after which it ends if it
    # has not started yet (FINISHED_QUEUE_TIMEOUT); None: never
    deadline: float | None = None
    queue_deadline: float | None = None
    # metrics (time.monotonic() stamps, 0.0 = not yet)
    first_scheduled_time: float = 0.0
    first_token_time: float = 0.0
    finished_time: float = 0.0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output, without building the concatenation."""
        n_prompt = len(self.prompt_token_ids)
        if stop <= n_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : stop - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether its next step computes prompt positions whose logprobs it still owes."""
        return (self.sampling_params.prompt_logprobs is not None
                and self.prompt_logprobs_done < self.num_prompt_tokens)

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASON.get(self.status)
