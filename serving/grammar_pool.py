"""Grammar compiles shared fairly among clients, with a time limit that cannot be used to starve others.

A structured output's grammar compiles on a worker thread (llguidance holds no GIL while it works,
but a compile cannot be interrupted). A few clients sending slow schemas must not make everyone
else's schemas time out, so:
- jobs wait in one queue per client, and the workers take the clients in turn (round robin): a
  client with a hundred compiles waiting gets one worker at a time while another client waits;
- a compile that outlives its time limit keeps its thread until it ends (nothing can stop it), so
  a thread is added in its place, up to `max_stuck` such threads: the `workers` threads stay for
  everyone else;
- a client whose compile is still running past its limit gets its next ones refused at once
  (GrammarBusyError, the server's 429) until that compile ends.
Clients are told apart by the caller (the server: the remote address).
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class GrammarBusyError(RuntimeError):
    """The client has a compile still running past its time limit."""


@dataclass(eq=False)
class _Job:
    client: str
    fn: Callable[[], Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    started: bool = False
    timed_out: bool = False  # the caller gave up: a running job now counts as stuck


@dataclass
class _State:
    queues: dict[str, collections.deque] = field(default_factory=dict)  # client -> its waiting jobs
    turn: collections.deque = field(default_factory=collections.deque)  # clients with jobs, in turn order
    stuck: collections.Counter = field(default_factory=collections.Counter)  # client -> compiles past their limit
    threads: int = 0
    idle: int = 0


class GrammarPool:
    def __init__(self, workers: int = 2, max_stuck: int = 4, name: str = "grammar") -> None:
        self.workers, self.max_stuck, self.name = workers, max_stuck, name
        self._s = _State()
        self._cv = threading.Condition()

    @property
    def stuck(self) -> int:
        with self._cv:
            return sum(self._s.stuck.values())

    async def run(self, client: str, fn: Callable[[], Any], timeout: float) -> Any:
        """fn() on a worker, in the client's turn. TimeoutError after `timeout` seconds (the job is
        dropped if it has not started; if it has, it runs on, counted against the client)."""
        loop = asyncio.get_running_loop()
        job = _Job(client, fn, loop.create_future(), loop)
        with self._cv:
            s = self._s
            if s.stuck[client]:
                raise GrammarBusyError(f"{s.stuck[client]} structured-output grammar(s) of this client are still "
                                       "compiling past the time limit: retry once they end, with a simpler schema")
            q = s.queues.get(client)
            if q is None:
                q = s.queues[client] = collections.deque()
                s.turn.append(client)
            q.append(job)
            self._grow()
            self._cv.notify()
        try:
            return await asyncio.wait_for(asyncio.shield(job.future), timeout)
        except TimeoutError:
            job.future.add_done_callback(_consume)  # nobody reads it now: no "never retrieved" warning
            with self._cv:
                if not job.started:
                    self._drop(job)
                elif not job.future.done():
                    job.timed_out = True
                    self._s.stuck[client] += 1
                    self._grow()  # a thread for everyone else in its place
            raise

    # -- under the lock ---------------------------------------------------------------------------
    def _wanted(self) -> int:
        """Threads to keep: the workers, plus one per compile past its limit (at most max_stuck)."""
        return self.workers + min(sum(self._s.stuck.values()), self.max_stuck)

    def _grow(self) -> None:
        s = self._s
        if s.idle == 0 and s.threads < self._wanted() and s.turn:
            s.threads += 1
            threading.Thread(target=self._work, name=f"{self.name}-{s.threads}", daemon=True).start()

    def _drop(self, job: _Job) -> None:
        q = self._s.queues.get(job.client)
        if q is not None and job in q:
            q.remove(job)
            if not q:
                del self._s.queues[job.client]
                self._s.turn.remove(job.client)

    def _next(self) -> _Job | None:
        s = self._s
        if not s.turn:
            return None
        client = s.turn.popleft()
        q = s.queues[client]
        job = q.popleft()
        if q:
            s.turn.append(client)  # its next job waits for the other clients' turns
        else:
            del s.queues[client]
        job.started = True
        return job

    # -- a worker ---------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cv:
                s = self._s
                s.idle += 1
                while (job := self._next()) is None:
                    if s.threads > self._wanted():
                        s.idle -= 1
                        s.threads -= 1
                        return  # an extra thread whose stuck compile has ended
                    self._cv.wait()
                s.idle -= 1
            try:
                result, error = job.fn(), None
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                result, error = None, e
            with self._cv:
                if job.timed_out:
                    self._s.stuck[job.client] -= 1
                    if not self._s.stuck[job.client]:
                        del self._s.stuck[job.client]
            try:
                job.loop.call_soon_threadsafe(_settle, job.future, result, error)
            except RuntimeError:  # the caller's event loop has closed: nobody waits for it
                pass


def _consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
