"""AsyncEngine: the front end on asyncio, over engine cores that run their own loops.

    engine = AsyncEngine(LLMEngine(model=...))          # its core gets a loop of its own
    async for out in engine.generate(prompt, SamplingParams(max_tokens=32), request_id="r1"):
        print(out.outputs[0].text)                       # as the params' output_kind asks
    await engine.abort("r1")

Threads. The cores step on their own (a thread each, or a process each: core_client.py); the event
loop checks requests (FrontEnd.make_request) and hands them over; one output thread reads the cores'
outputs, turns them into RequestOutputs (detokenizing, stop strings, n > 1 groups) and posts them to
their streams' event loops, one call per loop per batch. The FrontEnd is shared by the event loop(s)
and the output thread under one lock, held for bookkeeping only.

Outputs are what each request's SamplingParams ask for: DELTA (the server's streams: what is new),
CUMULATIVE (the default, as vLLM's generate yields), FINAL_ONLY (one output). A stream whose consumer
is slower than the engine holds one pending output: new deltas are appended to it, a cumulative
output replaces it, so what waits stays one output per request however slowly it is read.

Failures. A step that fails on the device ends the requests it may have spoiled: their streams raise
EngineStepError and the rest go on; so does a failure on the host during a step, which ends every
request in flight. A core that is gone (its thread ended, its process died: a CoreDead from the
client) ends every stream with EngineDeadError, turns is_running False (so /health says 503), and
calls the on_dead callbacks (the server exits non-zero).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Self

from jaxsched.config import EngineArgs
from jaxsched.core.request import RequestOutputKind, SamplingParams
from jaxsched.core.stats import EngineStats
from jaxsched.engine.core_client import EngineCoreClient, EngineDeadError, ThreadClient
from jaxsched.engine.core_messages import CoreDead, EngineCoreOutputs
from jaxsched.engine.launch import make_client
from jaxsched.engine.llm_engine import LLMEngine
from jaxsched.engine.outputs import RequestOutput
from jaxsched.errors import QueueFullError
from serving.metrics import EngineMetrics

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError", "EngineStepError", "QueueFullError", "QueueTimeoutError", "RequestStream",
           "merge_delta"]


class QueueTimeoutError(RuntimeError):
    """The request waited longer than the server's queue timeout without starting (503)."""


class EngineStepError(RuntimeError):
    """The engine ended this request alone, with an error; the others went on. `param` names the
    request field to change when the request's own input caused it (a client error: a grammar
    past the parser's limits); None when a step failed on the device."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    """Append DELTA output `new` to `into` (an earlier delta of the same request nobody read yet)."""
    outs = into.outputs
    by_index = {outs[0].index: outs[0]} if len(outs) == 1 else {c.index: c for c in outs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            outs.append(c)
            by_index[c.index] = c
            continue
        # each delta's lists are its own (output_processor slices them): extended in place
        old.text += c.text
        old.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            if old.logprobs is None:
                old.logprobs = c.logprobs
            else:
                old.logprobs.extend(c.logprobs)
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason, old.stop_reason = c.finish_reason, c.stop_reason
    if len(outs) > 1:
        outs.sort(key=lambda c: c.index)
    if into.prompt_logprobs is None:  # (the first delta carries them)
        into.prompt_logprobs = new.prompt_logprobs
    into.finished, into.metrics = new.finished, new.metrics
    into.error, into.error_param = new.error, new.error_param


class RequestStream:
    """Async iterator over one request's RequestOutputs. Closing it early aborts the request (its
    KV blocks are freed before its core's next step)."""

    def __init__(self, engine: AsyncEngine, request_id: str, loop: asyncio.AbstractEventLoop,
                 kind: RequestOutputKind) -> None:
        self.engine = engine
        self.request_id = request_id
        self.loop = loop
        self.kind = kind
        self.finished = False
        self._released = False  # its place in the admission count is given back
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None  # the reader's, while it waits (cheaper than an Event)

    def _put(self, item: RequestOutput | BaseException) -> None:  # on the event loop
        if isinstance(item, BaseException):
            self._error = item
        elif self._pending is None or self.kind != RequestOutputKind.DELTA:
            self._pending = item  # a cumulative output supersedes the one not read yet
        else:
            merge_delta(self._pending, item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if isinstance(item, BaseException) or item.finished:
            # the engine is done with it: a consumer that reads slowly (or not at all, a client
            # that stopped reading) must not keep holding a place in the admission queue
            self._release()

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self.engine._release()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while self._pending is None and self._error is None:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item, self._pending = self._pending, None
        if item is not None:
            if item.finished:
                self._done()
            return item
        self._done()
        raise self._error

    def _done(self) -> None:
        if not self.finished:
            self.finished = True
            self._release()

    def close(self) -> None:
        """Stop listening; abort the request if it has not finished."""
        if not self.finished:
            self.engine._abort(self.request_id)
            self._done()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> Self:  # `async with await engine.add_request(...) as stream:`
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _Live:
    """A request in flight, as the output thread tracks it."""

    stream: RequestStream
    arrival_time: float
    prompt_tokens: int
    num_tokens: int = 0
    last_token_time: float = 0.0


class AsyncEngine:
    # /health turns 503 when requests are in flight and no step has ended for this long: at least
    # WATCHDOG_MIN seconds, and WATCHDOG_STEPS times the longest step seen (a step that compiles, a
    # long prefill on a large model)
    WATCHDOG_MIN = 60.0
    WATCHDOG_STEPS = 10

    def __init__(self, engine: LLMEngine, start: bool = True, queue_timeout: float | None = None) -> None:
        """engine: the front end and its cores. A core stepped by the caller (one in this process)
        gets a thread of its own while this AsyncEngine runs; shutdown() hands it back.
        queue_timeout: seconds a request may wait without starting, after which it fails with
        QueueTimeoutError (the server's 503); None: as long as it takes."""
        if queue_timeout is not None and not queue_timeout > 0:
            raise ValueError(f"--queue-timeout must be > 0 seconds, got {queue_timeout}")
        self.queue_timeout = queue_timeout
        self.watchdog_min = self.WATCHDOG_MIN
        self._progress = time.monotonic()  # when a step last ended, or work last began after a pause
        self._stall_logged = False
        self.engine = engine
        self.metrics = EngineMetrics()
        self._lock = threading.Lock()  # the FrontEnd's state and _live: event loops and the output thread
        self._live: dict[str, _Live] = {}
        self._stopping = False
        self._stop_reason = "the engine was shut down"
        self.dead: str | None = None  # why the cores are gone, if they died
        self.on_dead: list[Callable[[str], None]] = []  # called once, on the output thread, when they die
        self._caller_client: EngineCoreClient | None = None  # the client to give back at shutdown
        self._thread: threading.Thread | None = None
        self._cores_stopped = threading.Event()  # shutdown() is done: the cores are stopped, the client given back
        self._in_flight = 0  # streams not finished yet
        self._stats = EngineStats()
        # read once, here: the engine's config is its one owner
        self._queue_limit = engine.scheduler_config.max_num_queued_requests
        cfg = engine.config
        self.metrics.describe_cache(cfg.cache.block_size, cfg.cache.num_blocks, engine.kv_bytes_per_device(),
                                    cfg.model.num_kv_heads // cfg.tensor_parallel_size, cfg.tensor_parallel_size,
                                    engine.client.num_cores)
        self.metrics.describe_memory(engine.memory_report())
        if start:
            self.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, start: bool = True) -> AsyncEngine:
        """The cores EngineArgs ask for, each with a loop of its own (vLLM's constructor name)."""
        return cls(LLMEngine(client=make_client(args, own_loop=True)), start=start)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        client = self.engine.client
        if client.steps_in_caller:  # one core in this process: its own loop, on its own thread
            self._caller_client = client
            self.engine.client = ThreadClient(client.local_cores[0])
        self._stats = self.engine.stats()
        self.metrics.publish(self._stats)
        self._thread = threading.Thread(target=self._run, args=(self.engine.client,), name="jaxsched-output",
                                        daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._stopping
                and self.dead is None)

    def shutdown(self, timeout: float | None = 10.0, reason: str = "the engine was shut down") -> None:
        """Stop the cores after their current step; requests still in flight fail with
        EngineDeadError(reason) now. Waits up to `timeout` seconds (0: does not wait: the cores stop
        on a thread of their own)."""
        with self._lock:
            again = self._stopping
            if not again:
                self._stopping = True
                self._stop_reason = reason
                live, self._live = self._live, {}
                self.engine.abort(list(live))  # the LLMEngine may be reused
        if again:  # a second call (the server's deadline, then its exit) waits as asked
            if self._thread is not None and timeout != 0:
                self._cores_stopped.wait(timeout)
            return
        dead = EngineDeadError(reason)
        for entry in live.values():
            self._post(entry.stream, dead)
        self._flush()
        if self._thread is None:
            return
        if timeout == 0:
            threading.Thread(target=self._stop_cores, args=(None,), name="jaxsched-shutdown", daemon=True).start()
        else:
            self._stop_cores(timeout)

    def _stop_cores(self, timeout: float | None) -> None:
        client = self.engine.client
        if self._caller_client is not None:
            client.shutdown(timeout)  # a ThreadClient: its loop ends after its step
            self._thread.join(timeout)
            self.engine.client, self._caller_client = self._caller_client, None
        else:
            client.shutdown()
            self._thread.join(timeout)
        self._cores_stopped.set()

    # -- the asyncio side ----------------------------------------------------------------------
    @property
    def num_queued(self) -> int:
        """Requests accepted that are not in the running batch."""
        return max(0, self._in_flight - self._stats.num_requests_running)

    def stats(self) -> EngineStats:
        """The cores' figures as of their last step."""
        return self._stats

    async def add_request(self, prompt: Any, sampling_params: SamplingParams | None = None,
                          request_id: str | None = None, priority: int = 0,
                          timeout: float | None = None) -> RequestStream:
        """Check and queue a request; returns its stream. Raises ValueError for bad input (as
        FrontEnd.make_request), QueueFullError when max_num_queued_requests are queued,
        EngineDeadError when the engine does not run."""
        if not self.is_running:
            raise EngineDeadError(self.dead or "the engine is not running (it was shut down or never started)")
        # Refused here, before any work, so that a flood never reaches a core; the scheduler checks
        # the same limit against its waiting queue.
        limit = self._queue_limit
        if limit is not None and self.num_queued >= limit:
            raise QueueFullError(f"{self.num_queued} requests are queued (max_num_queued_requests is {limit}); "
                                 "retry later")
        rid = request_id if request_id is not None else uuid.uuid4().hex
        now = time.monotonic()
        new = self.engine.make_request(rid, prompt, sampling_params, now, priority, timeout, self.queue_timeout)
        stream = RequestStream(self, rid, asyncio.get_running_loop(), new.core.sampling_params.output_kind)
        with self._lock:
            if self._stopping:
                raise EngineDeadError(self._stop_reason)
            if not self._live:  # work begins after a pause: the watchdog counts from now
                self._progress = time.monotonic()
            self.engine.add(new)  # raises for an id in flight, and a core's refusal when it runs here
            self._live[rid] = _Live(stream, now, len(new.core.prompt_token_ids))
            self._in_flight += 1
        return stream

    async def generate(self, prompt: Any, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """RequestOutputs of one request (as its output_kind asks); leaving the loop early aborts it."""
        stream = await self.add_request(prompt, sampling_params, request_id, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with an output whose finish_reason is "abort"."""
        self._abort(request_id)

    async def call(self, fn: str | Callable[..., Any], *args: Any) -> list[Any]:
        """Run a core utility (EngineCore.UTILITIES), or fn(core) on cores in this process, on every
        core between two of its steps: the results, one per core."""
        if not self.is_running:
            raise EngineDeadError(self.dead or "the engine is not running (it was shut down or never started)")
        return await asyncio.wrap_future(self.engine.client.call_utility_async(fn, *args))

    def _abort(self, rid: str) -> None:
        with self._lock:
            live = self._live.pop(rid, None)
            if live is None:
                return
            outputs = self.engine.abort(rid)
        for out in outputs:
            self._post(live.stream, out)
        self._flush()

    def _release(self) -> None:
        with self._lock:
            self._in_flight -= 1

    # -- the output thread ---------------------------------------------------------------------
    def _run(self, client: EngineCoreClient) -> None:
        while True:
            item = client.get_output(None)
            batch = [item]
            while (more := client.get_output(0)) is not None:
                batch.append(more)
            try:
                dead = self._handle(batch)
            except Exception:
                logger.exception("output processing failed")
                dead = None
            if dead is not None:
                if not self._stopping:
                    self._died(dead.why)
                return

    def stalled(self) -> float | None:
        """Seconds since the last step ended, when requests are in flight and that is longer than
        the watchdog allows (a step stuck on the device or in a kernel); else None."""
        if not self._live:
            return None
        quiet = time.monotonic() - self._progress
        limit = max(self.watchdog_min, self.WATCHDOG_STEPS * self._stats.longest_step_seconds)
        if quiet <= limit:
            return None
        if not self._stall_logged:
            self._stall_logged = True
            logger.error("no engine step has ended for %.0f s with %d requests in flight (the watchdog allows "
                         "%.0f s): /health says 503 until one does", quiet, len(self._live), limit)
        return quiet

    def _handle(self, batch: list[EngineCoreOutputs | CoreDead | None]) -> CoreDead | None:
        dead = None
        now = time.monotonic()
        self._progress, self._stall_logged = now, False
        with self._lock:
            for item in batch:
                if isinstance(item, CoreDead):
                    dead = item
                elif item is not None:
                    self._process(item, now)
            self._stats = self.engine.stats()
        self.metrics.publish(self._stats)
        self._flush()
        return dead

    def _process(self, outs: EngineCoreOutputs, now: float) -> None:  # under the lock
        if outs.step_failure is not None:
            logger.error("a step failed on the device (%s): its requests were ended", outs.step_failure)
        front = self.engine
        for o in outs.outputs:
            if o.new_token_ids:
                rid = front.outputs.request_of(o.request_id)
                live = self._live.get(rid) if rid is not None else None
                if live is not None:
                    self.metrics.observe_tokens(len(o.new_token_ids), live.prompt_tokens, live.arrival_time,
                                                live.num_tokens, live.last_token_time, now)
                    live.num_tokens += len(o.new_token_ids)
                    live.last_token_time = now
        for out in front.process(outs):
            live = self._live.get(out.request_id)
            if live is None:  # added to the front end directly, or aborted meanwhile
                continue
            if out.finished:
                del self._live[out.request_id]
                self.metrics.observe_finished(out, live.arrival_time, now)
            if any(c.finish_reason == "queue_timeout" for c in out.outputs):
                self._post(live.stream, QueueTimeoutError(
                    f"the request waited {now - live.arrival_time:.1f} s in the queue without starting (the "
                    f"server's --queue-timeout is {self.queue_timeout:g} s): retry later"))
                continue
            if out.error is not None:  # this request failed on its own; the others in its step go on
                if not out.finished:
                    del self._live[out.request_id]
                    front.abort(out.request_id)
                self._post(live.stream, EngineStepError(f"the request failed: {out.error}", out.error_param))
                continue
            self._post(live.stream, out)

    def _died(self, why: str) -> None:
        """The cores are gone: every stream fails, and whoever waits for that learns of it."""
        logger.error("the engine is gone: %s", why)
        self.dead = why
        with self._lock:
            live, self._live = self._live, {}
            self.engine.outputs.forget(list(live))
        err = EngineDeadError(f"the engine stopped: {why}")
        for entry in live.values():
            self._post(entry.stream, err)
        self._flush()
        for callback in self.on_dead:
            try:
                callback(why)
            except Exception:
                logger.exception("an on_dead callback failed")

    # -- posting to streams (on their event loops) ---------------------------------------------
    _outbox_local = threading.local()

    def _post(self, stream: RequestStream, item: Any) -> None:
        box = getattr(self._outbox_local, "box", None)
        if box is None:
            box = self._outbox_local.box = {}
        box.setdefault(stream.loop, []).append((stream, item))

    def _flush(self) -> None:
        box = getattr(self._outbox_local, "box", None)
        if not box:
            return
        self._outbox_local.box = {}
        for loop, items in box.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: nobody listens, free the requests
                with self._lock:
                    for stream, _ in items:
                        if self._live.pop(stream.request_id, None) is not None:
                            self.engine.abort(stream.request_id)


def _deliver(items: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in items:
        stream._put(item)

