"""EngineCoreClient: one interface over every way engine cores run.

    InprocClient         one core, stepped by the caller's own thread (LLMEngine, LLM, the bench):
                         get_output() runs a step; nothing runs between calls
    ThreadClient         one core on a thread of its own, running EngineCore.run_loop
    ProcessClient        one core in a process of its own (core_process.py), the same loop, behind
                         ZeroMQ sockets carrying msgspec messages
    DataParallelClient   N of the two above, each its own loop: requests routed by prefix-cache hit
                         and load, outputs merged as they come (parallel/data_parallel.py)
    MultiHostClient      this host's core of an engine over several hosts (parallel/multihost.py)

launch.make_client builds the one EngineArgs ask for.

The front end (frontend.py) talks to any of them the same way: add_request, abort_requests,
get_output, call_utility, stats, shutdown. Outputs of cores that run on their own wait in an Outbox
(a thread-safe queue with a wake-up callback), in the order they came; a core that dies puts a
CoreDead there, so whoever reads outputs learns of it at once (the liveness mechanism).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from jaxsched.config import EngineConfig
from jaxsched.core.stats import EngineStats
from jaxsched.engine.core import EngineCore, StepFailure
from jaxsched.engine.core_messages import (
    AbortRequests,
    CoreDead,
    CoreInfo,
    CoreInput,
    EngineCoreOutputs,
    EngineCoreRequest,
    Shutdown,
    UtilityRequest,
)

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core is gone (its thread or process ended, or it was shut down)."""


class Outbox:
    """Outputs of cores that run on their own, waiting for the front end: a thread-safe FIFO; `notify`
    (set by the reader, called on the core's side after each put) wakes a reader that waits elsewhere."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[EngineCoreOutputs | CoreDead] = queue.SimpleQueue()
        self.notify: Callable[[], None] | None = None

    def put(self, item: EngineCoreOutputs | CoreDead) -> None:
        self._q.put(item)
        notify = self.notify
        if notify is not None:
            notify()

    def get(self, timeout: float | None = None) -> EngineCoreOutputs | CoreDead | None:
        """The next item; None when none came within timeout (0: do not wait)."""
        try:
            return self._q.get_nowait() if timeout == 0 else self._q.get(timeout=timeout)
        except queue.Empty:
            return None


class EngineCoreClient(ABC):
    """How the front end reaches its cores. `config` and `info` are core 0's (every core of a client
    has the same config; data-parallel cores get core 0's pool size)."""

    config: EngineConfig
    info: CoreInfo
    num_cores: int = 1
    # get_output() runs a core step in the caller's thread (so the caller's own work between calls
    # is part of each step's time); else cores step on their own and outputs wait in an Outbox
    steps_in_caller: bool = False
    # several hosts (distributed.py): process 0 leads, the others follow its steps
    is_leader: bool = True

    @abstractmethod
    def add_request(self, req: EngineCoreRequest) -> None:
        """Hand a checked request to a core. An in-process core's refusal raises here; a core that
        runs on its own answers a refusal with an error output."""

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | CoreDead | None:
        """The next outputs (None: none within timeout). InprocClient runs a step for them."""

    @abstractmethod
    def call_utility_async(self, method: str | Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Run one of EngineCore.UTILITIES on every core between two steps: a future of their
        results, one per core. A callable (taking the core) is run by cores in this process only
        (tests, benchmarks)."""

    def call_utility(self, method: str | Callable[..., Any], *args: Any) -> list[Any]:
        """call_utility_async, waited for: one result per core."""
        return self.call_utility_async(method, *args).result()

    @abstractmethod
    def stats(self) -> EngineStats:
        """The cores' figures as of their last step (summed over data-parallel cores)."""

    @abstractmethod
    def shutdown(self) -> None: ...

    @property
    def dead(self) -> str | None:
        """Why the cores are gone; None while they run."""
        return None

    def end_batch(self) -> None:
        """A multi-host leader tells the other hosts that a batch is done; nothing elsewhere."""

    def follow(self, until: str = "stop", on_add: Callable[[EngineCoreRequest], None] | None = None,
               on_outputs: Callable[[EngineCoreOutputs], None] | None = None,
               on_abort: Callable[[list[str]], None] | None = None) -> None:
        """A multi-host follower runs the leader's steps (distributed.py)."""
        raise RuntimeError("follow() is for the processes other than 0 of an engine over several hosts")

    @property
    def local_cores(self) -> list[EngineCore]:
        """The cores in this process (none for core processes): tests and benchmarks read them."""
        return []


class InprocClient(EngineCoreClient):
    """One core stepped by the caller: get_output() is one EngineCore.step(), and every call waits
    for it, so a synchronous caller adds no thread and no copy (LLM.generate's path)."""

    steps_in_caller = True

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.config = core.config
        self.info = core.info()

    def add_request(self, req: EngineCoreRequest) -> None:
        self.core.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """A step's outputs (none when no request is in flight). A step that failed on the device
        gives its outputs with step_failure set."""
        if not self.core.has_unfinished_requests():
            return EngineCoreOutputs()
        try:
            return EngineCoreOutputs(self.core.step())
        except StepFailure as e:
            logger.error("a step failed on the device: %s", e, exc_info=e.cause)
            return EngineCoreOutputs(e.outputs, step_failure=str(e))

    def call_utility_async(self, method: str | Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        try:
            fut.set_result([self.core.call(method, args)])
        except Exception as e:  # noqa: BLE001 - handed to the caller
            fut.set_exception(e)
        return fut

    def stats(self) -> EngineStats:
        return self.core.stats()

    def shutdown(self) -> None:
        pass

    @property
    def local_cores(self) -> list[EngineCore]:
        return [self.core]


class LoopClient(EngineCoreClient):
    """A core that runs its own loop (on a thread or in a process): requests go in as messages,
    outputs come back through the Outbox; utility calls wait on a future resolved by their reply."""

    def __init__(self, outbox: Outbox | None, index: int) -> None:
        self.outbox = outbox if outbox is not None else Outbox()
        self.index = index
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._lock = threading.Lock()
        self._stats = EngineStats()
        self._dead: str | None = None

    @abstractmethod
    def _send(self, msg: CoreInput) -> None: ...

    def add_request(self, req: EngineCoreRequest) -> None:
        self._check_alive()
        self._send(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self._dead is None:
            self._send(AbortRequests(list(request_ids)))

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | CoreDead | None:
        return self.outbox.get(timeout)

    def call_utility_async(self, method: str | Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._dead is not None:
            fut.set_exception(EngineDeadError(self._dead))
            return fut
        with self._lock:
            call_id = next(self._call_ids)
            self._calls[call_id] = fut
        self._send(UtilityRequest(call_id, method, list(args)))
        return fut

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def dead(self) -> str | None:
        return self._dead

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _receive(self, outs: EngineCoreOutputs) -> None:
        """A message from the core (on the core's thread, or the process client's reader)."""
        if outs.stats is not None:
            self._stats = outs.stats
        u = outs.utility
        if u is not None:
            with self._lock:
                fut = self._calls.pop(u.call_id, None)
            if fut is not None and not fut.done():
                if u.error is not None:
                    fut.set_exception(RuntimeError(f"engine core utility failed: {u.error}"))
                else:
                    fut.set_result([u.result])
            if not outs.outputs:
                return
        self.outbox.put(outs)

    def _died(self, why: str, expected: bool = False) -> None:
        """The core is gone (expected: shut down by its client)."""
        if self._dead is not None:
            return
        self._dead = why
        (logger.info if expected else logger.error)("engine core %d: %s", self.index, why)
        with self._lock:
            calls, self._calls = self._calls, {}
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(why))
        self.outbox.put(CoreDead(why))


class ThreadClient(LoopClient):
    """A core in this process, on a thread of its own (the server's in-process core; data-parallel
    cores): jax releases the GIL while a device runs, so its steps overlap the front end's work."""

    def __init__(self, core: EngineCore, outbox: Outbox | None = None) -> None:
        super().__init__(outbox, core.engine_index)
        self.core = core
        self.config = core.config
        self.info = core.info()
        self._stats = core.stats()
        self._inbox: queue.SimpleQueue[CoreInput] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"jaxsched-core{self.index}", daemon=True)
        self._thread.start()

    def _send(self, msg: CoreInput) -> None:
        self._inbox.put(msg)

    def _receive_input(self, block: bool) -> CoreInput | None:
        try:
            return self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _run(self) -> None:
        try:
            self.core.run_loop(self._receive_input, self._receive)
        except BaseException as e:
            logger.exception("engine core %d's loop failed", self.index)
            self._died(f"the engine core's loop failed: {type(e).__name__}: {e}")
            return
        self._died("the engine core was shut down", expected=True)

    def shutdown(self, timeout: float | None = 10.0) -> None:
        if self._thread.is_alive():
            self._send(Shutdown())
            self._thread.join(timeout)

    @property
    def local_cores(self) -> list[EngineCore]:
        return [self.core]
