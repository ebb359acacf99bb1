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
import sys
import threading
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
          log_level: str = "info") -> None:
    """Serve `app` until SIGINT / SIGTERM, then shut down within shutdown_timeout (+ a few seconds)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=30)
    if threading.current_thread() is not threading.main_thread():  # signals are the main thread's
        GracefulServer(config, engine, shutdown_timeout).run()
        return
    # After its graceful shutdown uvicorn re-raises a caught SIGTERM with the handler it found; with
    # the default one the process would die there, before the caller's cleanup (a multi-host engine's
    # other processes would lose process 0 without being told to stop). Exit through SystemExit.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        GracefulServer(config, engine, shutdown_timeout).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
