"""Running the app under uvicorn with a shutdown deadline.

uvicorn on its own waits, after SIGTERM, for every open connection to finish, so one streaming
client that stops reading keeps the process alive for as long as it likes. Here SIGTERM stops
accepting connections (uvicorn), lets requests in flight finish for `shutdown_timeout` seconds,
then fails the ones still running (a stream gets an error event, then [DONE]; a plain request a
503) and gives their clients a moment to read that before uvicorn cancels what is left.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

import uvicorn

from serving.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT = 20.0  # seconds; inside Kubernetes' default 30 s grace period, with room to spare
_FLUSH_SECONDS = 2.0  # after the deadline: for the error events to reach clients that still read


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, shutdown_timeout: float) -> None:
        config.timeout_graceful_shutdown = int(shutdown_timeout + _FLUSH_SECONDS + 0.999)
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        logger.info("shutting down: requests in flight have %.0f s to finish (--shutdown-timeout)",
                    self.shutdown_timeout)
        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, self._deadline)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
            self.engine.shutdown(timeout=0, reason="the server is shutting down")

    def _deadline(self) -> None:
        logger.warning("shutdown deadline (%.0f s) reached: failing the requests still running", self.shutdown_timeout)
        self.engine.shutdown(timeout=0, reason=f"the server shut down before this request finished (its "
                                               f"--shutdown-timeout is {self.shutdown_timeout:g} s)")


def serve(app: Any, engine: AsyncEngine, host: str, port: int, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
          log_level: str = "info", on_exit: Callable[[], None] | None = None) -> None:
    """Serve `app` until SIGINT / SIGTERM, then shut down within shutdown_timeout (+ a few seconds).

    on_exit runs once the server is down, also when the process then exits by the signal that
    stopped it: uvicorn re-raises that signal after its graceful shutdown, and by the default action
    the process would die there, before any cleanup of the caller's (a multi-host engine's leader
    must tell the other processes to stop, or their coordination agents abort)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=30)
    server = GracefulServer(config, engine, shutdown_timeout)
    if on_exit is None or threading.current_thread() is not threading.main_thread():  # signals: main thread only
        try:
            server.run()
        finally:
            if on_exit is not None:
                on_exit()
        return
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
