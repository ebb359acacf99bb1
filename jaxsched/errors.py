"""The engine's own exceptions, importable without jax (the server maps each to an HTTP status)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxsched.engine.outputs import RequestOutput


class InvalidRequestError(ValueError):
    """A request the engine refuses as given. Still a ValueError (bad input is one throughout the
    API); `param` names the argument or SamplingParams field to change (None when no single one is
    to blame), so that a server can name it without reading the message."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class QueueFullError(RuntimeError):
    """The waiting queue holds max_num_queued_requests already: retry later (HTTP 503)."""


class StepFailedError(RuntimeError):
    """A step failed on the device. The engine has already ended the requests whose KV the step
    may have spoiled (FINISHED_ERROR); `outputs` are the step's outputs: those requests' final
    RequestOutputs, each with `error` set, and, from data-parallel cores whose other cores stepped
    fine, their ordinary outputs of the same step. Every other request is intact and the engine
    can keep stepping. `why`: the device's failure ("Type: message")."""

    def __init__(self, outputs: list[RequestOutput], why: str | BaseException) -> None:
        self.outputs = outputs
        self.why = f"{type(why).__name__}: {why}" if isinstance(why, BaseException) else why
        super().__init__(f"an engine step failed ({self.why}); {len(self.request_ids)} request(s) in it were ended")

    @property
    def request_ids(self) -> list[str]:
        """The requests the failure ended (the outputs with `error` set)."""
        return [o.request_id for o in self.outputs if o.error is not None]
