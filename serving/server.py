"""Running the app under uvicorn with a shutdown deadline.

uvicorn on its own waits, after SIGTERM, for every open connection to finish, so one streaming
client that stops reading keeps the process alive for as long as it likes. Here SIGTERM stops
accepting connections (uvicorn), lets requests in flight finish for `shutdown_timeout` seconds,
then fails the ones still running (a stream gets an error event, then [DONE]; a plain request a
503) and gives their clients a moment to read that before uvicorn cancels what is left.

Other front ends on the same engine (the gRPC server, serving/grpc_server.py) run on uvicorn's
event loop: they start just before it listens, and stop with it under the same deadline: they
refuse new calls at SIGTERM, and their calls in flight fail with the engine's requests when the
deadline comes.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any, Protocol

import uvicorn

from serving.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT = 20.0  # seconds; inside Kubernetes' default 30 s grace period, with room to spare
_STARTUP_FAILURE = 3  # uvicorn's exit status when it cannot start
ENGINE_DIED = 1  # serve()'s status when the engine's cores went away under it
_FLUSH_SECONDS = 2.0  # after the deadline: for the error events to reach clients that still read
# An idle connection's life on the server. Longer than the clients' own pool expiry (httpx, and the
# openai client on it, drop an idle connection after 5 s): at uvicorn's default, also 5 s, the server
# could close a connection just as a client sent its next request on it, and that request failed with
# "Server disconnected without sending a response" (seen in CI with the openai client, max_retries=0).
KEEP_ALIVE_SECONDS = 30


class FrontEnd(Protocol):
    """Another server on the engine, run on uvicorn's event loop (GrpcFrontEnd)."""

    async def start(self) -> None: ...

    async def stop(self, grace: float | None) -> None: ...


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, shutdown_timeout: float,
                 front_ends: tuple[FrontEnd, ...] = ()) -> None:
        config.timeout_graceful_shutdown = int(shutdown_timeout + _FLUSH_SECONDS + 0.999)
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.front_ends = front_ends
        self.engine_died: str | None = None  # why, when the engine's cores went away under the server
        engine.on_dead.append(self._engine_gone)

    def _engine_gone(self, why: str) -> None:
        """The engine's cores are gone (their streams have failed already): stop serving, as after
        SIGTERM, and let serve() exit non-zero. Called on the engine's output thread; uvicorn's
        main loop reads should_exit within a tenth of a second."""
        logger.error("the engine is gone (%s): the server stops", why)
        self.engine_died = why
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """The other front ends first, so that `started` means every one listens. A front end that
        cannot start stops the process as uvicorn does when it cannot listen (exit status 3)."""
        started: list[FrontEnd] = []
        try:
            for f in self.front_ends:
                await f.start()
                started.append(f)
            await super().startup(sockets)  # sys.exit(3) when it cannot listen
        except (Exception, SystemExit) as e:
            if not isinstance(e, SystemExit):
                logger.error("could not start: %s", e)
            for f in started:
                await f.stop(0)
            raise SystemExit(_STARTUP_FAILURE) from e

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        logger.info("shutting down: requests in flight have %.0f s to finish (--shutdown-timeout)",
                    self.shutdown_timeout)
        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, self._deadline)
        # New calls are refused at once; the ones in flight fail at the deadline, and what is left
        # is cancelled half-way through the flush, so before uvicorn cancels its own tasks.
        grace = self.shutdown_timeout + _FLUSH_SECONDS / 2
        stops = [asyncio.ensure_future(f.stop(grace)) for f in self.front_ends]
        try:
            await super().shutdown(sockets)
            if self.force_exit:  # a second Ctrl-C: no grace for the other front ends either
                await asyncio.gather(*(f.stop(0) for f in self.front_ends), return_exceptions=True)
            pending = [s for s in stops if not s.done()]
            if pending:  # (not awaited when done: the loop would run uvicorn's cancelled tasks again)
                await asyncio.wait(pending)
            for s in stops:
                if s.exception() is not None:
                    logger.error("a front end did not stop cleanly: %s", s.exception())
        finally:
            timer.cancel()
            self.engine.shutdown(timeout=0, reason="the server is shutting down")

    def _deadline(self) -> None:
        logger.warning("shutdown deadline (%.0f s) reached: failing the requests still running", self.shutdown_timeout)
        self.engine.shutdown(timeout=0, reason=f"the server shut down before this request finished (its "
                                               f"--shutdown-timeout is {self.shutdown_timeout:g} s)")


def freeze_heap() -> None:
    """Move everything alive now out of the collector's sight. What a server has built before it
    serves (jax, transformers, the model, the app: hundreds of thousands of objects) lives as long
    as it does; left in the oldest generation, every full collection walks it all, and one large
    request body (40,000 tools, decoded before their count is refused) allocates enough to set one
    off: 0.2 s of a held GIL on this machine, over a second on a busy one, during which /health and
    every stream wait. vLLM's server freezes its heap too."""
    gc.collect()
    gc.freeze()


def serve(app: Any, engine: AsyncEngine, host: str, port: int, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
          log_level: str = "info", on_exit: Callable[[], None] | None = None,
          front_ends: tuple[FrontEnd, ...] = ()) -> int:
    """Serve `app` (and `front_ends`) until SIGINT / SIGTERM, then shut down within shutdown_timeout
    (+ a few seconds).

    on_exit runs once the server is down, also when the process then exits by the signal that
    stopped it: uvicorn re-raises that signal after its graceful shutdown, and by the default action
    the process would die there, before any cleanup of the caller's (a multi-host engine's leader
    must tell the other processes to stop, or their coordination agents abort).

    Returns the process's exit status: 0, or ENGINE_DIED when the engine's cores went away (a core
    process killed, say): the server stops at once then, every stream having ended with an error."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_keep_alive=KEEP_ALIVE_SECONDS)
    server = GracefulServer(config, engine, shutdown_timeout, front_ends)
    if on_exit is None or threading.current_thread() is not threading.main_thread():  # signals: main thread only
        try:
            server.run()
        finally:
            if on_exit is not None:
                on_exit()
        return ENGINE_DIED if server.engine_died else 0
    done = False

    def finish() -> None:
        nonlocal done
        if not done:
            done = True
            on_exit()

    def exit_by(signum: int, frame: Any) -> None:  # uvicorn's re-raise lands here: clean up, then die by it
        finish()
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

    previous = {sig: signal.signal(sig, exit_by) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        finish()
    return ENGINE_DIED if server.engine_died else 0
