"""Result types, named and shaped as vLLM's so code written against vLLM reads them unchanged."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # per generated token: {token_id: Logprob} with the sampled token and the top-k alternatives
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """time.monotonic() stamps; 0.0 means the event has not happened."""

    arrival_time: float
    first_scheduled_time: float = 0.0
    first_token_time: float = 0.0
    finished_time: float = 0.0
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # SamplingParams.prompt_logprobs: per prompt token {token_id: Logprob} with the prompt's own token and
    # the top-k alternatives; the first token's entry is None (vLLM's)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    priority: int = 0
    error: str | None = None  # why the request failed (its finish_reason is "error"); None otherwise
    # the request field to blame when its own input made it fail (a client error); None otherwise
    error_param: str | None = None
    extra: dict = field(default_factory=dict)
