"""Several hosts: one engine core whose mesh spans every process of a jax.distributed cluster.

Every process (one per host) holds an EngineCore over the same global devices and runs the same
jitted SPMD step; the collectives inside it (the row-parallel all-reduces, the logits gather) cross
hosts. Process 0, the leader, runs the front end and is the only one that receives requests.
Because the scheduler is deterministic, the others need only the leader's inputs, not its
decisions: before each step the leader sends what changed since the last one (requests added, with
their sampling seeds drawn, and aborts, as the same EngineCoreRequest / AbortRequests a core gets,
and its step-cost observations); every follower applies them to its own core and steps, and all of
them schedule the same batch and sample the same tokens (the sampler runs on the replicated
logits). Only the leader's outputs go anywhere.

The channel: ZeroMQ from the leader (a ROUTER bound on a free port of its host) to each follower (a
DEALER), carrying msgspec messages (core_messages.py), so nothing is unpickled from the network.
The leader's address reaches the followers through jax's own broadcast at start-up
(multihost_utils.broadcast_one_to_all), the one collective the channel uses; a follower waiting for
the next step waits on its socket, never inside a collective that could time out while the server
is idle, and learns that the leader is gone from the socket's disconnect.

Every host sizes its KV pool from its own memory and all take the smallest (same_pool_on_every_host).
Limits: the swap pool is off (a host would have to copy only its own shards out; preemption
recomputes); a step that fails on one host's device and not on another's leaves the hosts apart.
"""

from __future__ import annotations

import atexit
import logging
import socket
from collections.abc import Callable

import msgspec
import numpy as np

from jaxsched.config import EngineArgs
from jaxsched.core.step_cost import StepShape
from jaxsched.engine.core import EngineCore, StepFailure
from jaxsched.engine.core_client import InprocClient
from jaxsched.engine.core_messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    encoder,
)
from jaxsched.parallel.hosts import initialize

logger = logging.getLogger(__name__)

_POLL_MS = 1000
_ADDRESS_BYTES = 256  # the leader's tcp address, broadcast as a fixed-size array
_HELLO_SECONDS = 120.0  # how long the leader waits for every follower to connect


class StepInputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What a follower applies before the step it is for (or, with `end`, where it stops)."""

    # requests added and aborted, in the order the leader did them
    ops: list[EngineCoreRequest | AbortRequests] = []
    end: str | None = None  # "idle": the leader's batch is done (LLM.generate); "stop": shut down
    # the leader's step-cost inputs since the last message ((T, S, context, seconds); context -1 =
    # a warm-up seed): the followers' models learn the same, so every host sizes steps the same
    costs: list[tuple[int, int, int, float]] = []


class _Channel:
    """The leader's ROUTER and one DEALER per follower; the leader's address goes out by jax's broadcast."""

    def __init__(self, args: EngineArgs, process_id: int, num_processes: int) -> None:
        import zmq
        from jax.experimental import multihost_utils

        self.ctx = zmq.Context()
        self.leader = process_id == 0
        addr = np.zeros(_ADDRESS_BYTES, np.uint8)
        if self.leader:
            self.sock = self.ctx.socket(zmq.ROUTER)
            self.sock.setsockopt(zmq.LINGER, 1000)
            port = self.sock.bind_to_random_port("tcp://*")
            coordinator = args.distributed_coordinator
            host = coordinator.rpartition(":")[0] if coordinator not in (None, "auto") else socket.gethostname()
            raw = f"tcp://{host}:{port}".encode()
            addr[:len(raw)] = np.frombuffer(raw, np.uint8)
        addr = np.asarray(multihost_utils.broadcast_one_to_all(addr))
        if self.leader:
            self.followers = self._wait_for_hellos(num_processes - 1)
        else:
            self.sock = self.ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self.sock.connect(bytes(addr).rstrip(b"\0").decode())
            self.sock.send(str(process_id).encode())
        self.encode = encoder().encode
        self.decode = msgspec.msgpack.Decoder(StepInputs).decode

    def _wait_for_hellos(self, n: int) -> list[bytes]:
        import zmq

        followers: list[bytes] = []
        while len(followers) < n:
            if not self.sock.poll(_HELLO_SECONDS * 1000, zmq.POLLIN):
                raise RuntimeError(f"only {len(followers)} of {n} other processes connected to process 0 within "
                                   f"{_HELLO_SECONDS:g} s")
            ident, _ = self.sock.recv_multipart()
            followers.append(ident)
        return followers

    def publish(self, msg: StepInputs) -> None:
        data = self.encode(msg)
        for ident in self.followers:
            self.sock.send_multipart([ident, data], copy=False)

    def receive(self, process_id: int) -> StepInputs:
        """The leader's next message, waiting as long as it takes; RuntimeError when the leader is gone."""
        import zmq

        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(_POLL_MS))
            if self.sock in ready:
                return self.decode(self.sock.recv(copy=False).buffer)
            if self.monitor in ready:
                raise RuntimeError(f"process {process_id} lost the leader (process 0): its connection closed")

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


class MultiHostClient(InprocClient):
    """This process's core of an engine over several hosts, stepped by the caller. On the leader
    (process 0) it is used as any client is, and sends each step's inputs ahead of it; the others
    call follow()."""

    def __init__(self, args: EngineArgs) -> None:
        import jax

        initialize(args)
        if args.tensor_parallel_size != jax.device_count():
            raise ValueError(
                f"with several hosts one engine spans every device: {jax.process_count()} processes x "
                f"{jax.local_device_count()} local devices, so set tensor_parallel_size={jax.device_count()} "
                f"(got {args.tensor_parallel_size})")
        super().__init__(EngineCore(args))  # resolve() turns swapping off for several hosts
        self.process_id = jax.process_index()
        self.is_leader = self.process_id == 0
        self._channel = _Channel(args, self.process_id, jax.process_count())
        self._ops: list[EngineCoreRequest | AbortRequests] = []
        self._stopped = False
        core = self.core
        if core.cost_model is not None:
            if self.is_leader:  # its warm-up timings go out with the first message
                core.cost_feed = [(T, S, -1, sec) for T, S, sec in core.cost_seeds]
            else:  # forget this host's own timings: the leader's are the ones every host uses
                core.cost_model = core.scheduler.cost_model = type(core.cost_model)(core.cost_model.pairs)
                core.measure_costs = False
        if self.is_leader:
            # what the core applies, and its cost observations, go to the followers ahead of each
            # step it takes (the core calls before_step whichever thread runs it)
            core.on_input = self._ops.append
            core.before_step = lambda: self._publish(None)
            atexit.register(self.shutdown)  # a script that ends (or fails) without shutdown() releases the others

    # -- the leader ----------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        self._check_leader("add requests")
        self.core.add_request(req)  # (core.on_input records it for the followers)

    def abort_requests(self, request_ids: list[str]) -> None:
        if self.is_leader:  # a follower gets the leader's own abort of the same request
            self.core.abort_requests(request_ids)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        self._check_leader("step (the others call follow())")
        if self._stopped:
            raise RuntimeError("this engine was shut down: the other processes no longer follow it")
        return super().get_output(timeout)

    def end_batch(self) -> None:
        """Tell the followers that this batch is done (their follow(until="idle") returns)."""
        if self.is_leader and not self._stopped:
            self._publish("idle")

    def shutdown(self) -> None:
        """Tell the followers to stop following (their follow() returns), once; then leave the
        cluster (jax.distributed.shutdown waits for the others to leave too), so that a process
        that exits by a signal, skipping Python's exit handlers, does not take the coordination
        service down under them."""
        import jax

        if self.is_leader and not self._stopped:
            self._stopped = True
            self._publish("stop")
            jax.distributed.shutdown()  # returns once the followers, which got "stop", have left
            self._channel.close()

    def _publish(self, end: str | None) -> None:
        core = self.core
        msg = StepInputs(list(self._ops), end, core.cost_feed or [])
        self._ops.clear()  # (the list core.on_input appends to)
        if core.cost_feed:
            core.cost_feed = []
        self._channel.publish(msg)

    def _check_leader(self, what: str) -> None:
        if not self.is_leader:
            raise RuntimeError(f"process {self.process_id} follows process 0 and cannot {what}; requests go to "
                               "process 0, the other processes run follow()")

    # -- the followers -------------------------------------------------------------------------
    def follow(self, until: str = "stop", on_add: Callable[[EngineCoreRequest], None] | None = None,
               on_outputs: Callable[[EngineCoreOutputs], None] | None = None,
               on_abort: Callable[[list[str]], None] | None = None) -> None:
        """Run the leader's steps until it ends the batch ("idle") or shuts down ("stop"; "idle"
        markers are then skipped). on_add sees each request added, on_abort each abort, on_outputs
        each step's outputs (this process's core gives the leader's, token for token)."""
        if self.is_leader:
            raise RuntimeError("process 0 leads; follow() is for the other processes")
        core = self.core
        while True:
            msg = self._channel.receive(self.process_id)
            for T, S, context, seconds in msg.costs:
                if context < 0:
                    core.cost_model.seed(T, S, seconds)
                else:
                    core.cost_model.observe(StepShape(T, S, context), seconds)
            for op in msg.ops:
                if isinstance(op, EngineCoreRequest):
                    # the leader's clock decides a deadline and sends the abort: none here
                    op.deadline = op.queue_deadline = None
                    core.add_request(op)
                    if on_add is not None:
                        on_add(op)
                else:
                    core.abort_requests(op.request_ids)
                    if on_abort is not None:
                        on_abort(op.request_ids)
            if msg.end == "stop" or (msg.end == "idle" and until == "idle"):
                return
            if msg.end is None:
                failure = None
                try:
                    outputs: list[EngineCoreOutput] = core.step()
                except StepFailure as e:  # as on the leader: the spoiled requests end, the rest go on
                    logger.error("%s", e, exc_info=e.cause)
                    outputs, failure = e.outputs, str(e)
                if on_outputs is not None:
                    on_outputs(EngineCoreOutputs(outputs, step_failure=failure))

