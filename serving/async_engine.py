"""AsyncEngine: the LLMEngine step loop on one thread, per-request streams on the asyncio side.

    engine = AsyncEngine(LLMEngine(model=...))          # starts the engine thread
    async for out in engine.generate(prompt, SamplingParams(max_tokens=32), request_id="r1"):
        print(out.outputs[0].text)                       # the text so far
    await engine.abort("r1")

Outputs are CUMULATIVE, as vLLM's generate() yields by default: each RequestOutput holds all the text
and tokens so far. That is what lets a stream coalesce: a consumer slower than the engine gets only
the newest output and loses nothing. DeltaTracker turns them into deltas for streaming (holding back
text that could still be the start of a stop string).

Threads. LLMEngine is not thread-safe, so only the engine thread touches it: adds, aborts and calls
from the asyncio side go through a thread-safe command queue and are applied between steps. Results
come back with loop.call_soon_threadsafe, one call per event loop per step. An idle engine sleeps on
a threading.Event. A step that fails on the device has already ended the requests it may have
spoiled (LLMEngine.step raises StepFailedError with their final outputs): their streams raise
EngineStepError and the loop carries on with the rest. Any other exception out of a step is a bug on
the host, after which no request's state can be trusted: every request in flight fails and is
aborted, so that nothing hangs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Self

from jaxsched.errors import InvalidRequestError, QueueFullError, StepFailedError
from jaxsched.outputs import RequestOutput
from jaxsched.request import SamplingParams
from jaxsched.stats import EngineStats
from serving.metrics import EngineMetrics
from serving.streaming import DeltaTracker

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "DeltaTracker", "EngineDeadError", "EngineStepError", "QueueFullError", "RequestStream"]


class EngineDeadError(RuntimeError):
    """The engine thread is not running (never started, or shut down)."""


class EngineStepError(RuntimeError):
    """The engine ended this request alone, with an error; the others went on. `param` names the
    request field to change when the request's own input caused it (a client error: a grammar
    past the parser's limits); None when a step failed on the device."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


_ACCEPTED = object()  # posted once the engine thread has validated and queued a request


class RequestStream:
    """Async iterator over one request's cumulative RequestOutputs. Closing it early aborts the
    request (its KV blocks are freed before the next step)."""

    def __init__(self, engine: AsyncEngine, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.request_id = request_id
        self.loop = loop
        self.finished = False
        self._released = False  # its place in the admission count is given back
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._accepted: asyncio.Future[None] = loop.create_future()

    def _put(self, item: Any) -> None:  # on the event loop
        if item is _ACCEPTED:
            if not self._accepted.done():
                self._accepted.set_result(None)
        elif isinstance(item, BaseException) and not self._accepted.done():
            self._accepted.set_exception(item)
        else:
            self._queue.put_nowait(item)
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
        item = await self._queue.get()
        while not isinstance(item, BaseException) and not item.finished and not self._queue.empty():
            item = self._queue.get_nowait()  # cumulative: the newest output supersedes the others
        if isinstance(item, BaseException):
            self._done()
            raise item
        if item.finished:
            self._done()
        return item

    def _done(self) -> None:
        if not self.finished:
            self.finished = True
            self._release()

    def close(self) -> None:
        """Stop listening; abort the request if it has not finished."""
        if not self.finished:
            self.engine._submit(_Abort(self.request_id))
            self._done()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> Self:  # `async with await engine.add_request(...) as stream:`
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


# -- commands from the asyncio side, applied by the engine thread between steps ---------------------
@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: Any
    params: SamplingParams | None
    priority: int
    arrival_time: float  # time.monotonic() when add_request was called
    stream: RequestStream


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[Any], Any]
    future: asyncio.Future


_Command = _Add | _Abort | _Call


@dataclass
class _Live:
    """Engine-thread state of an accepted request."""

    stream: RequestStream
    arrival_time: float
    last: RequestOutput | None = None
    num_tokens: int = 0
    last_token_time: float = 0.0


class AsyncEngine:
    def __init__(self, engine: Any, start: bool = True) -> None:
        self.engine = engine  # an LLMEngine; touched only by the engine thread once started
        self.metrics = EngineMetrics()
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = False
        self._stop_reason = "the engine was shut down"
        self._thread: threading.Thread | None = None
        self._live: dict[str, _Live] = {}  # engine thread only
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}  # engine thread only
        self._lock = threading.Lock()
        self._in_flight = 0  # streams not finished yet (asyncio side)
        self._stats = EngineStats()  # the engine's, as of the last step (engine thread writes, any reads)
        # read once, here: the engine's config is its one owner, and the engine belongs to its thread
        self._queue_limit = engine.scheduler_config.max_num_queued_requests
        cfg = engine.config
        self.metrics.describe_cache(cfg.cache.block_size, cfg.cache.num_blocks, engine.kv_bytes_per_device(),
                                    cfg.model.num_kv_heads // cfg.tensor_parallel_size, cfg.tensor_parallel_size,
                                    len(getattr(engine, "replicas", (engine,))))
        if start:
            self.start()

    @classmethod
    def from_engine_args(cls, args: Any, start: bool = True) -> AsyncEngine:
        """The engine EngineArgs ask for (engine.create_engine: an LLMEngine, or data-parallel
        replicas of one), on its own engine thread (vLLM's constructor name)."""
        from jaxsched.engine import create_engine

        return cls(create_engine(args), start=start)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._publish_stats()
            self._thread = threading.Thread(target=self._run, name="jaxsched-engine", daemon=True)
            self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def shutdown(self, timeout: float | None = 10.0, reason: str = "the engine was shut down") -> None:
        """Stop the engine thread after its current step; requests still in flight fail with
        EngineDeadError(reason). Waits up to `timeout` seconds for the thread (0: do not wait)."""
        if not self._stopping:
            self._stop_reason = reason
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None and timeout != 0:
            self._thread.join(timeout)

    # -- the asyncio side ----------------------------------------------------------------------
    @property
    def num_queued(self) -> int:
        """Requests accepted (or being accepted) that are not in the running batch."""
        with self._lock:
            return max(0, self._in_flight - self._stats.num_requests_running)

    def stats(self) -> EngineStats:
        """The engine's figures as of its last step (LLMEngine.stats() is for the engine thread only)."""
        return self._stats

    async def add_request(self, prompt: Any, sampling_params: SamplingParams | None = None,
                          request_id: str | None = None, priority: int = 0) -> RequestStream:
        """Queue a request; returns its stream once the engine has accepted it. Raises ValueError for
        bad input (as LLMEngine.make_request), QueueFullError when max_num_queued_requests are queued."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running (it was shut down or never started)")
        # Refused here, before the command queue, so that a flood never reaches the engine thread;
        # the scheduler checks the same limit against its waiting queue.
        limit = self._queue_limit
        if limit is not None and self.num_queued >= limit:
            raise QueueFullError(f"{self.num_queued} requests are queued (max_num_queued_requests is {limit}); "
                                 "retry later")
        rid = request_id if request_id is not None else uuid.uuid4().hex
        stream = RequestStream(self, rid, asyncio.get_running_loop())
        with self._lock:
            self._in_flight += 1
        self._submit(_Add(rid, prompt, sampling_params, priority, time.monotonic(), stream))
        try:
            await stream._accepted
        except asyncio.CancelledError:
            stream.close()
            raise
        except BaseException:
            stream._done()
            raise
        return stream

    async def generate(self, prompt: Any, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Cumulative RequestOutputs of one request; leaving the loop early aborts it."""
        stream = await self.add_request(prompt, sampling_params, request_id, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with an output whose finish_reason is "abort"."""
        self._submit(_Abort(request_id))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(llm_engine) on the engine thread between two steps (to inspect its state safely)."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running (it was shut down or never started)")
        fut = asyncio.get_running_loop().create_future()
        self._submit(_Call(fn, fut))
        return await fut

    def _submit(self, cmd: _Command) -> None:
        self._commands.put(cmd)
        self._wakeup.set()

    def _release(self) -> None:
        with self._lock:
            self._in_flight -= 1

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stopping:
            try:
                self._apply_commands()
                if not eng.has_unfinished_requests():
                    self._publish_stats()
                    self._flush()  # replies to the commands just applied, before sleeping
                    self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                t0 = time.perf_counter()
                try:
                    outs = eng.step()
                except StepFailedError as e:  # the engine ended the requests it spoiled; the rest go on
                    logger.error("%s: %s", e, e.request_ids, exc_info=e.__cause__)
                    outs = e.outputs
                except Exception as e:
                    logger.exception("engine step failed on the host; failing every request in flight")
                    self._fail_all(e)
                    outs = []
                self._emit(outs)
                if not outs and time.perf_counter() - t0 < 2e-4:
                    self._wakeup.wait(1e-3)  # nothing could be scheduled: do not spin
                    self._wakeup.clear()
            except Exception:  # a bug in this loop must not kill the thread: log it and go on
                logger.exception("engine loop error")
            finally:
                self._flush()
        dead = EngineDeadError(self._stop_reason)
        if self._live:
            self.engine.abort_request(list(self._live))  # the LLMEngine may be reused
        for live in self._live.values():
            self._post(live.stream, dead)
        self._live.clear()
        while not self._commands.empty():  # commands that came in while stopping
            match self._commands.get_nowait():
                case _Add(stream=stream):
                    self._post(stream, dead)
                case _Call(future=fut):
                    fut.get_loop().call_soon_threadsafe(resolve_future, fut, None, dead)
        self._flush()

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            match cmd:
                case _Add():
                    self._add(cmd)
                case _Abort(request_id=rid):
                    self._abort(rid)
                case _Call(fn=fn, future=fut):
                    try:
                        res, exc = fn(self.engine), None
                    except Exception as e:  # noqa: BLE001 - handed to the caller's await
                        res, exc = None, e
                    fut.get_loop().call_soon_threadsafe(resolve_future, fut, res, exc)

    def _add(self, cmd: _Add) -> None:
        rid = cmd.request_id
        try:
            if rid in self._live:
                raise InvalidRequestError(f"request_id {rid!r} is already in flight; use a unique id", "request_id")
            eng = self.engine
            eng.add_request_obj(eng.make_request(rid, cmd.prompt, cmd.params, arrival_time=cmd.arrival_time,
                                                 priority=cmd.priority))
        except Exception as e:  # noqa: BLE001 - bad input or a full queue: the caller's add_request raises it
            self._post(cmd.stream, e)
            return
        self._live[rid] = _Live(cmd.stream, cmd.arrival_time)
        self._post(cmd.stream, _ACCEPTED)

    def _abort(self, rid: str) -> None:
        live = self._live.pop(rid, None)
        if live is None:
            return
        self.engine.abort_request(rid)
        self._post(live.stream, _aborted(rid, live.last))

    def _emit(self, outs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for o in outs:
            live = self._live.get(o.request_id)
            if live is None:  # added to the LLMEngine directly, or aborted meanwhile
                continue
            self._observe(live, o, now)
            live.last = o
            if o.error is not None:  # this request failed on its own; the others in its step go on
                del self._live[o.request_id]
                if not o.finished:  # one sample of several (n > 1) failed: the others would go on unseen
                    self.engine.abort_request(o.request_id)
                self._post(live.stream, EngineStepError(f"the request failed: {o.error}", o.error_param))
                continue
            self._post(live.stream, o)
            if o.finished:
                del self._live[o.request_id]
        self._publish_stats()

    def _observe(self, live: _Live, o: RequestOutput, now: float) -> None:
        n = self.metrics.observe(o, live.arrival_time, live.num_tokens, live.last_token_time, now)
        if n > live.num_tokens:
            live.num_tokens, live.last_token_time = n, now

    def _fail_all(self, exc: Exception) -> None:
        """After a step failed outside the device: fail and abort every request in flight."""
        err = EngineStepError(f"an engine step failed ({type(exc).__name__}: {exc}); the request was aborted "
                              "(retry it)")
        live, self._live = self._live, {}
        try:
            self.engine.abort_request(list(live))
        except Exception:
            logger.exception("could not abort %d requests after a failed step", len(live))
        for entry in live.values():
            self._post(entry.stream, err)

    def _publish_stats(self) -> None:
        self._stats = self.engine.stats()  # one reference swap: readers on other threads see old or new
        self.metrics.publish(self._stats)

    def _post(self, stream: RequestStream, item: Any) -> None:
        self._outbox.setdefault(stream.loop, []).append((stream, item))

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: nobody listens, free the requests
                for stream, _ in items:
                    if self._live.pop(stream.request_id, None) is not None:
                        self.engine.abort_request(stream.request_id)


def _deliver(items: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in items:
        stream._put(item)


def resolve_future(fut: asyncio.Future, res: Any, exc: BaseException | None) -> None:
    """Complete `fut` (on its loop) unless its waiter gave up."""
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(res)


def _aborted(rid: str, last: RequestOutput | None) -> RequestOutput:
    if last is None:
        return RequestOutput(rid, None, [], [], True)
    comps = [c if c.finish_reason else dataclasses.replace(c, finish_reason="abort") for c in last.outputs]
    return dataclasses.replace(last, outputs=comps, finished=True)
