"""LLMEngine: the front end over its engine cores, stepped by the caller (vLLM's LLMEngine).

    engine = LLMEngine(model=...)                    # one core in this process (InprocClient), or
                                                     # data_parallel_size cores with loops of their own
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step():                    # one core step (in process), or whatever the
            ...                                      # cores produced meanwhile (their own loops)

The scheduler and the model runner are the core's (engine_core.py); validation, detokenizing, stop
strings and n > 1 grouping are the front end's (frontend.py). LLM (llm.py) is a loop over this.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from typing import Any

from jaxsched.config import EngineArgs
from jaxsched.core.request import SamplingParams
from jaxsched.core.stats import EngineStats
from jaxsched.engine.core import EngineCore
from jaxsched.engine.core_client import EngineCoreClient, EngineDeadError
from jaxsched.engine.core_messages import CoreDead, EngineCoreOutputs, EngineCoreRequest
from jaxsched.engine.frontend import PRIORITY_MAX, PRIORITY_MIN, FrontEnd, NewRequest, PromptType
from jaxsched.engine.launch import make_client
from jaxsched.engine.outputs import RequestOutput
from jaxsched.errors import StepFailedError

__all__ = ["PRIORITY_MAX", "PRIORITY_MIN", "LLMEngine", "PromptType"]


class LLMEngine(FrontEnd):
    def __init__(self, args: EngineArgs | None = None, devices: Sequence[Any] | None = None,
                 client: EngineCoreClient | None = None, **kwargs: Any) -> None:
        """devices: the jax devices of an in-process core (tensor_parallel_size of them; None: the
        first ones). client: cores started elsewhere (launch.make_client)."""
        if client is None:
            args = args if args is not None else EngineArgs.from_kwargs(**kwargs)
            client = make_client(args, devices)
        cores = client.local_cores
        own = cores[0] if len(cores) == 1 else None  # its tokenizer and compiled grammars are shared
        super().__init__(client, own.tokenizer if own else None, own.grammars if own else None)
        self._frontend_seconds = 0.0

    @property
    def core(self) -> EngineCore:
        """The one engine core in this process (tests and benchmarks look inside it)."""
        cores = self.client.local_cores
        if len(cores) != 1:
            raise AttributeError(f"this engine has {len(cores)} cores in this process, not one: use client.local_cores")
        return cores[0]

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType | Sequence[int],
                    params: SamplingParams | None = None, arrival_time: float | None = None,
                    priority: int = 0) -> None:
        self.add(self.make_request(request_id, prompt, params, arrival_time, priority))

    def add_request_obj(self, req: NewRequest) -> None:
        """Queue a request made by make_request (validated up front, as a batch is)."""
        self.add(req)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """End requests (an n > 1 request, or any of its samples, ends all its samples)."""
        self.abort(request_ids)

    def stats(self) -> EngineStats:
        """The cores' figures (queues, KV usage, preemptions, prefix cache, padding, step timings).
        A core stepped by the caller counts this front end's output work in its step's time and
        output phase, as it runs inside the caller's step."""
        s = self.client.stats()
        if self.client.steps_in_caller:
            fe = self._frontend_seconds
            s = dataclasses.replace(s, step_seconds=s.step_seconds + fe, output_seconds=s.output_seconds + fe)
        return s

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """The outputs of the requests that got tokens: one core step when the core runs in this
        thread; else whatever the cores produced since the last call (waiting for the first, while
        a request is in flight). Raises StepFailedError, carrying the step's outputs, when a step
        failed on the device (its requests ended, the others go on), EngineDeadError when a core
        is gone."""
        messages: list[EngineCoreOutputs] = []
        item = self.client.get_output(None if self.has_unfinished_requests() else 0)
        while item is not None:
            if isinstance(item, CoreDead):
                raise EngineDeadError(item.why)
            messages.append(item)
            if self.client.steps_in_caller:
                break
            item = self.client.get_output(0)
        t0 = time.perf_counter()
        outputs: list[RequestOutput] = []
        failure = None
        for outs in messages:
            outputs += self.process(outs)
            failure = failure or outs.step_failure
        self._frontend_seconds += time.perf_counter() - t0
        if failure is not None:
            raise StepFailedError(outputs, failure)
        return outputs

    def shutdown(self) -> None:
        self.client.shutdown()

    # -- several hosts (distributed.py) --------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        """False on a process other than 0 of an engine over several hosts (it runs follow())."""
        return self.client.is_leader

    def end_batch(self) -> None:
        """On a multi-host leader: the other hosts' follow(until="idle") returns (LLM.generate)."""
        self.client.end_batch()

    def follow(self, until: str = "stop") -> tuple[list[str], list[RequestOutput]]:
        """On a process other than 0 of a multi-host engine: run process 0's steps until it ends its
        batch ("idle") or shuts down ("stop"). With until="idle", returns the ids of the requests
        added meanwhile, in order, and every output (the leader's, token for token); with "stop"
        (a server's lifetime) nothing is kept."""
        keep = until == "idle"
        added: list[str] = []
        outs: list[RequestOutput] = []

        def on_add(req: EngineCoreRequest) -> None:
            if keep:
                self.outputs.add(req)
                added.append(req.request_id)

        def on_outputs(core_outs: EngineCoreOutputs) -> None:
            if keep:  # (a stop string's abort comes from the leader, before its next step)
                outs.extend(self.outputs.process(core_outs.outputs)[0])

        def on_abort(ids: list[str]) -> None:
            if keep:
                self.outputs.forget(ids)

        self.client.follow(until, on_add, on_outputs, on_abort)
        return added, outs


def create_engine(args: EngineArgs) -> LLMEngine:
    """The engine `args` ask for (what LLM, AsyncEngine and the CLI build)."""
    return LLMEngine(args)
