"""Servers for tests, on loopback: the app under uvicorn in a thread of the test process, or
`jaxsched serve` in a subprocess."""

from __future__ import annotations

import contextlib
import gc
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import uvicorn

from serving.server import KEEP_ALIVE_SECONDS, GracefulServer, freeze_heap


@contextlib.contextmanager
def uvicorn_thread(app, engine=None, front_ends=(), shutdown_timeout: float = 5) -> Iterator[str]:
    """Serve `app` on a free port in a thread; yields its URL; stops it on exit. With `front_ends`
    (the gRPC server), as `jaxsched serve` runs them: on the same loop, under GracefulServer, whose
    exit also shuts `engine` down. The heap is frozen while it serves, as `jaxsched serve` freezes
    it, and given back to the collector on exit (the test process goes on)."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                            timeout_keep_alive=KEEP_ALIVE_SECONDS)
    srv = GracefulServer(config, engine, shutdown_timeout, front_ends) if front_ends else uvicorn.Server(config)
    freeze_heap()
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(10)
        gc.unfreeze()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 300) -> None:
    """Until GET /health answers 200; fails with the server's log if it exits or takes too long."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"the server exited: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"the server did not come up in {timeout:.0f} s"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
