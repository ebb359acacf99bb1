"""Host-side request state and sampling parameters. Plain Python: no jax here.

A Request follows vLLM v1's counter model: there is no prefill phase and no decode phase. Each step
the scheduler gives a request some new tokens so that `num_computed_tokens` catches up with
`num_tokens` (prompt + output). Chunked prefill, recompute after preemption and (later) prefix-cache
hits are all that one rule.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = 4  # max_tokens or max_model_len
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(str, enum.Enum):
    """The OpenAI / vLLM spelling of why a request ended."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


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
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Penalties, as vLLM applies them on device (see jaxsched/sampler.py): presence and frequency
    # subtract over the output tokens so far; repetition divides positive / multiplies negative
    # logits of every prompt or output token (1 = off); min_tokens masks EOS and stop_token_ids.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0

    def __post_init__(self) -> None:
        # Normalise list-like fields to tuples so the object stays hashable and immutable.
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be a positive integer (the number of samples), got {self.n!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer (>= 1), got {self.max_tokens!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ValueError(f"logprobs must be a non-negative integer, got {self.logprobs!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {v!r}")
        rp = self.repetition_penalty
        if not isinstance(rp, (int, float)) or isinstance(rp, bool) or not 0.0 < rp < float("inf"):
            raise ValueError(f"repetition_penalty must be > 0 (1 = off, > 1 discourages repeats), got {rp!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        object.__setattr__(self, "_uses_penalties", self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                           or self.repetition_penalty != 1.0 or self.min_tokens > 0)

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
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
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
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASON.get(self.status)
