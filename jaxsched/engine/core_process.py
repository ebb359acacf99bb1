"""An engine core in a process of its own: its step loop holds a GIL nobody else wants.

    front end (any process)                          core process (spawned; jax starts here)
      ProcessClient._send --PUSH ipc://...-in-->       EngineCore.run_loop: inputs between steps
      reader thread       <--PUSH ipc://...-out--      a step's EngineCoreOutputs, a utility's reply

ZeroMQ carries msgspec's msgpack (core_messages.py: token ids, numpy arrays as bytes): no pickle on
the sockets, which are Unix-domain sockets in a private temporary folder. The one pickle is the
start-up: EngineArgs go to the spawned child and its EngineConfig comes back over the process's own
pipe (multiprocessing's), which nothing outside the two processes can reach.

Liveness: the reader thread wakes every POLL_SECONDS to look at the process; a core process that
ends for any reason (SIGKILL included) puts a CoreDead in the outbox within that time. The core
process in turn exits when its parent is gone, and ignores SIGINT, which a terminal sends to the
whole process group: the front end decides when the core stops.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import multiprocessing
import os
import signal
import tempfile
import threading
from typing import Any

from jaxsched import envs, platforms
from jaxsched.config import EngineArgs
from jaxsched.engine.core_client import LoopClient, Outbox
from jaxsched.engine.core_messages import CoreInput, Shutdown, encoder, input_decoder, output_decoder

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.1  # how often the reader looks at the core process while no output comes


class ProcessClient(LoopClient):
    def __init__(self, args: EngineArgs, index: int = 0, outbox: Outbox | None = None) -> None:
        """Start core `index` of args.data_parallel_size in a new process and wait until it is ready
        (its model loaded and warmed up). Raises RuntimeError, with the core's own error, when it
        cannot start."""
        import zmq

        super().__init__(outbox, index)
        self._folder = tempfile.TemporaryDirectory(prefix="jaxsched-core-")
        in_addr = f"ipc://{self._folder.name}/in"
        out_addr = f"ipc://{self._folder.name}/out"
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.bind(in_addr)
        self._out = self._ctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(out_addr)
        self._encoder = encoder()
        self._send_lock = threading.Lock()
        mp = multiprocessing.get_context("spawn")
        mine, theirs = mp.Pipe()
        self.process = mp.Process(target=run_core_process, name=f"jaxsched-core{index}",
                                  args=(args, index, in_addr, out_addr, theirs, logging.getLogger().level),
                                  daemon=True)
        self.process.start()
        theirs.close()
        try:
            kind, *rest = _wait_for(mine, self.process)
        except EOFError:
            why = f"the engine core process exited with code {self.process.exitcode} while starting (see its log above)"
            kind, rest = "failed", [why]
        if kind != "ready":
            self.process.join(5)
            self._close()
            raise RuntimeError(f"engine core {index} could not start: {rest[0]}")
        self.config, self.info, self._stats = rest
        self._stopping = False
        self._shutdown_lock = threading.Lock()
        self._closed = False
        # before multiprocessing's own exit hook (hooks run last-registered first), which would end
        # the daemonic core with SIGTERM: the core gets its Shutdown and exits by itself
        atexit.register(self.shutdown)
        self._reader = threading.Thread(target=self._read, name=f"jaxsched-core{index}-reader", daemon=True)
        self._reader.start()

    def _send(self, msg: CoreInput) -> None:
        data = self._encoder.encode(msg)
        with self._send_lock:  # zmq sockets are not thread-safe: the event loop and the output thread send
            self._in.send(data, copy=False)

    def _read(self) -> None:
        import zmq

        decode = output_decoder().decode
        poller = zmq.Poller()
        poller.register(self._out, zmq.POLLIN)
        while True:
            if poller.poll(POLL_SECONDS * 1000):
                try:
                    self._receive(decode(self._out.recv(copy=False).buffer))
                except Exception as e:
                    logger.exception("could not read engine core %d's output", self.index)
                    self._died(f"the engine core's output could not be read: {type(e).__name__}: {e}")
                    return
                continue
            if not self.process.is_alive():
                code = self.process.exitcode
                why = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
                if self._stopping and code == 0:
                    self._died("the engine core was shut down", expected=True)
                else:
                    self._died(f"the engine core process died ({why})")
                return

    def shutdown(self, timeout: float | None = 10.0) -> None:
        with self._shutdown_lock:  # the server's shutdown thread and the exit hook may both come
            if self._closed:
                return
            if self.process.is_alive() and not self._stopping:
                self._stopping = True
                with contextlib.suppress(Exception):  # it is going anyway
                    self._send(Shutdown())
                self.process.join(timeout)
                if self.process.is_alive():
                    logger.warning("engine core %d did not stop within %s s: killing it", self.index, timeout)
                    self.process.kill()
                    self.process.join(5)
            self._stopping = True
            self._reader.join(2 * POLL_SECONDS + 1)
            self._close()
            self._closed = True

    def _close(self) -> None:
        self._in.close(0)
        self._out.close(0)
        self._ctx.term()
        self._folder.cleanup()


def _name_process(name: str) -> None:
    """The name `ps` and /proc/PID/comm show (Linux; elsewhere nothing): an operator sees which
    process is the engine core."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _own_devices(index: int, tp: int, dp: int) -> list[Any]:
    """Data-parallel core `index`'s devices, chosen before jax starts in this process. Where the
    platform has a visible-devices variable (GPUs: CUDA_VISIBLE_DEVICES) it is narrowed to group
    `index`, so that no other core's memory is claimed here; a CPU's devices are the same cores in
    every process, so there the core takes group `index` of them."""
    env = platforms.expected().visible_devices_env
    if env is not None:
        envs.narrow_visible_devices(env, index, tp)
    import jax

    from jaxsched.parallel.data_parallel import replica_device_groups

    if platforms.of(jax.devices()[0].platform).visible_devices_env:  # the process sees its group only
        return jax.devices()[:tp]
    return replica_device_groups(tp, dp)[index]


def _wait_for(conn: Any, process: Any) -> tuple:
    """The child's start-up message, waiting as long as it runs (loading and warming up a model may
    take minutes)."""
    while not conn.poll(1.0):
        if not process.is_alive():
            raise EOFError
    return conn.recv()


def run_core_process(args: EngineArgs, index: int, in_addr: str, out_addr: str, conn: Any, log_level: int) -> None:
    """The core process's main: build core `index`, report, then run its loop until a Shutdown (or
    until the parent is gone)."""
    import dataclasses

    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when this core stops
    _name_process(f"jaxsched-core{index}")
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s core{index} %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    dp, tp = args.data_parallel_size, args.tensor_parallel_size
    try:
        devices = None
        if dp > 1:
            devices = _own_devices(index, tp, dp)
        from jaxsched.engine.core import EngineCore

        core = EngineCore(dataclasses.replace(args, data_parallel_size=1, engine_core_process=False),
                          devices=devices, engine_index=index)
    except Exception as e:
        logging.getLogger(__name__).exception("engine core %d could not start", index)
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(in_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 1000)
    out.connect(out_addr)
    gc.collect()  # the model, jax and the warm-up's objects live as long as the core: not walked again
    gc.freeze()
    conn.send(("ready", core.config, core.info(), core.stats()))
    conn.close()
    decode = input_decoder().decode
    enc = encoder()
    parent = multiprocessing.parent_process()

    def receive(block: bool) -> CoreInput | None:
        while True:
            if inp.poll(1000 if block else 0):
                return decode(inp.recv(copy=False).buffer)
            if not block:
                return None
            if parent is not None and not parent.is_alive():  # nobody will ever send again
                return Shutdown()

    core.run_loop(receive, lambda outs: out.send(enc.encode(outs), copy=False))
    inp.close(0)
    out.close()
    ctx.term()
    os._exit(0)  # jax's and XLA's threads need no orderly teardown: the work is done
