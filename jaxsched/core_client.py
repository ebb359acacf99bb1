"""EngineCoreClient: one interface over every way engine cores run.

    InprocClient         one core, stepped by the caller's own thread (LLMEngine, LLM, the bench):
                         get_output() runs a step; nothing runs between calls
    ThreadClient         one core on a thread of its own, running EngineCore.run_loop
    ProcessClient        one core in a process of its own (core_process.py), the same loop, behind
                         ZeroMQ sockets carrying msgspec messages
    DataParallelClient   N of the two above, each its own loop: requests routed by prefix-cache hit
                         and load, outputs merged as they come (no core waits for another)

The front end (frontend.py) talks to any of them the same way: add_request, abort_requests,
get_output, call_utility, stats, shutdown. Outputs of cores that run on their own wait in an Outbox
(a thread-safe queue with a wake-up callback), in the order they came; a core that dies puts a
CoreDead there, so whoever reads outputs learns of it at once (the liveness mechanism).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from jaxsched.config import EngineArgs, EngineConfig
from jaxsched.core_messages import (
    AbortRequests,
    CoreDead,
    CoreInfo,
    CoreInput,
    EngineCoreOutputs,
    EngineCoreRequest,
    Shutdown,
    UtilityRequest,
)
from jaxsched.engine_core import EngineCore, StepFailure, sample_ids
from jaxsched.stats import EngineStats

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


class _LoopClient(EngineCoreClient):
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


class ThreadClient(_LoopClient):
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


class DataParallelClient(EngineCoreClient):
    """N cores, each with its own loop, behind one client. A request goes to the core that has the
    longest prefix of its prompt cached (as far as this client routed it: the prompt's full blocks,
    hashed in a chain as the block manager hashes them, remembered per core), unless that core is
    overloaded; otherwise, and for a prompt no core has seen, to the least loaded core (fewest
    unfinished samples; ties to the lowest index). Overloaded: it has no free seat
    (max_num_seqs unfinished) while another core has one, or a full batch more than the least
    loaded core. Outputs come as each core produces them."""

    PREFIX_ENTRIES = 1 << 16  # block hashes remembered, least recently used forgotten first

    def __init__(self, clients: Sequence[_LoopClient], outbox: Outbox) -> None:
        self.clients = list(clients)
        self.outbox = outbox
        self.num_cores = len(self.clients)
        first = self.clients[0]
        self.config, self.info = first.config, first.info
        self.seats = self.config.scheduler.max_num_seqs
        self.block_size = self.config.cache.block_size
        self._lock = threading.Lock()
        self._load = [0] * self.num_cores
        self._core_of: dict[str, int] = {}  # a counted sample's core id -> the core holding it
        self._request_of: dict[str, str] = {}  # a counted sample's core id -> its request's id
        self._samples: dict[str, list[str]] = {}  # request id -> its samples still counted
        self._prefix: OrderedDict[int, int] = OrderedDict()  # block chain hash -> the core it went to

    # -- routing -------------------------------------------------------------------------------
    def _chain(self, req: EngineCoreRequest) -> list[int]:
        P = self.block_size
        ids = req.prompt_token_ids
        h = hash(("jaxsched-prefix", req.cache_salt))
        out = []
        for start in range(0, len(ids) - P + 1, P):
            h = hash((h, tuple(ids[start:start + P])))
            out.append(h)
        return out

    def route(self, req: EngineCoreRequest) -> int:
        """The core `req` goes to (see the class docstring); remembers its prompt's blocks there."""
        chain = self._chain(req)
        with self._lock:
            load = self._load
            least = min(range(self.num_cores), key=lambda i: (load[i], i))
            hit = None
            for h in reversed(chain):
                hit = self._prefix.get(h)
                if hit is not None:
                    break
            if hit is not None and not self._overloaded(hit, load[least]):
                target = hit
            else:
                target = least
            for h in chain:
                self._prefix[h] = target
                self._prefix.move_to_end(h)
            while len(self._prefix) > self.PREFIX_ENTRIES:
                self._prefix.popitem(last=False)
            ids = sample_ids(req.request_id, req.sampling_params.n)
            self._load[target] += len(ids)
            self._samples[req.request_id] = list(ids)
            for sid in ids:
                self._core_of[sid] = target
                self._request_of[sid] = req.request_id
        return target

    def _overloaded(self, i: int, least: int) -> bool:
        n = self._load[i]
        return (n >= self.seats > least) or n - least >= self.seats

    def load(self) -> list[int]:
        """Unfinished samples per core, as this client counts them."""
        with self._lock:
            return list(self._load)

    def core_of(self, request_id: str) -> int | None:
        """The core holding a request (by its id or a sample's); None when none does."""
        with self._lock:
            samples = self._samples.get(request_id, [request_id])
            return self._core_of.get(samples[0]) if samples else None

    def _release(self, core_ids: Sequence[str]) -> None:
        """Samples that ended (finished, failed or aborted): their seats are free again."""
        with self._lock:
            for sid in core_ids:
                i = self._core_of.pop(sid, None)
                if i is None:
                    continue
                self._load[i] -= 1
                rid = self._request_of.pop(sid)
                left = self._samples[rid]
                left.remove(sid)
                if not left:
                    del self._samples[rid]

    # -- the client interface ------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        i = self.route(req)
        try:
            self.clients[i].add_request(req)
        except BaseException:
            self._release(sample_ids(req.request_id, req.sampling_params.n))
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        """By a request's id (all its samples) or a sample's (that sample), as EngineCore takes them."""
        by_core: dict[int, list[str]] = {}
        ended: list[str] = []
        with self._lock:
            for rid in request_ids:
                samples = self._samples.get(rid, [rid] if rid in self._core_of else [])
                if samples:
                    by_core.setdefault(self._core_of[samples[0]], []).append(rid)
                    ended += samples
        for i, rids in by_core.items():
            self.clients[i].abort_requests(rids)
        self._release(ended)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | CoreDead | None:
        item = self.outbox.get(timeout)
        if isinstance(item, EngineCoreOutputs):
            done = [o.request_id for o in item.outputs if o.finish_reason is not None]
            if done:
                self._release(done)
        return item

    def call_utility_async(self, method: str | Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        futures = [c.call_utility_async(method, *args) for c in self.clients]
        combined: concurrent.futures.Future = concurrent.futures.Future()
        left = [len(futures)]
        lock = threading.Lock()

        def one_done(_: concurrent.futures.Future) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            error = next((f.exception() for f in futures if f.exception() is not None), None)
            if error is not None:
                combined.set_exception(error)
            else:
                combined.set_result([r for f in futures for r in f.result()])

        for f in futures:
            f.add_done_callback(one_done)
        return combined

    def stats(self) -> EngineStats:
        """The cores' EngineStats summed; kv_cache_usage_perc over all cores' blocks."""
        each = [c.stats() for c in self.clients]
        summed = {f.name: sum(getattr(s, f.name) for s in each) for f in dataclasses.fields(EngineStats)
                  if f.name != "kv_cache_usage_perc"}
        return EngineStats(**summed, kv_cache_usage_perc=sum(s.kv_cache_usage_perc for s in each) / len(each))

    @property
    def dead(self) -> str | None:
        return next((c.dead for c in self.clients if c.dead is not None), None)

    def shutdown(self) -> None:
        for c in self.clients:
            c.shutdown()

    @property
    def local_cores(self) -> list[EngineCore]:
        return [core for c in self.clients for core in c.local_cores]


def replica_device_groups(tensor_parallel_size: int, data_parallel_size: int, devices: Sequence[Any] | None = None
                          ) -> list[list[Any]]:
    """The device group of each data-parallel core: consecutive runs of tensor_parallel_size devices
    of `devices` (default: jax.devices()). Raises ValueError, saying what to change, when the
    product exceeds the devices present."""
    if devices is None:
        import jax

        devices = jax.devices()
    devices = list(devices)
    tp, dp = tensor_parallel_size, data_parallel_size
    if tp * dp > len(devices):
        platform = devices[0].platform if devices else "?"
        hint = (" (on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N, set before jax starts, "
                "simulates N devices)") if platform == "cpu" else ""
        raise ValueError(
            f"tensor_parallel_size={tp} x data_parallel_size={dp} needs {tp * dp} devices, but {len(devices)} "
            f"{platform} device(s) are present; lower data_parallel_size or tensor_parallel_size so that their "
            f"product is at most {len(devices)}{hint}")
    return [devices[i * tp:(i + 1) * tp] for i in range(dp)]


def data_parallel_cores(args: EngineArgs, devices: Sequence[Any] | None = None) -> list[EngineCore]:
    """data_parallel_size cores in this process, one per device group. Core 0 sizes its pool from
    memory; the others get its block count: requests are checked against core 0's config, so every
    core must hold what it accepts. The device check runs before any core loads."""
    groups = replica_device_groups(args.tensor_parallel_size, args.data_parallel_size, devices)
    one = dataclasses.replace(args, data_parallel_size=1)
    cores = [EngineCore(one, devices=groups[0], engine_index=0)]
    one = dataclasses.replace(one, num_gpu_blocks_override=cores[0].config.cache.num_blocks)
    for i, group in enumerate(groups[1:], 1):
        cores.append(EngineCore(one, devices=group, engine_index=i))
    return cores


def make_client(args: EngineArgs, devices: Sequence[Any] | None = None, own_loop: bool = False) -> EngineCoreClient:
    """The client EngineArgs ask for. One core: stepped by the caller (InprocClient), or with
    own_loop on a thread of its own; engine_core_process (None: the platform's choice, taken by
    the caller: serving/cli.py) puts each core in a process of its own. data_parallel_size > 1:
    that many cores, each with its own loop."""
    if args.engine_core_process:
        from jaxsched.core_process import ProcessClient

        if devices is not None:
            raise ValueError("engine_core_process=True picks its devices in the core's own process: pass no devices")
        outbox = Outbox()
        clients: list[_LoopClient] = [ProcessClient(args, 0, outbox)]
        if args.data_parallel_size == 1:
            return clients[0]
        blocks = clients[0].config.cache.num_blocks
        rest = dataclasses.replace(args, num_gpu_blocks_override=blocks)
        clients += [ProcessClient(rest, i, outbox) for i in range(1, args.data_parallel_size)]
        return DataParallelClient(clients, outbox)
    if args.data_parallel_size > 1:
        outbox = Outbox()
        return DataParallelClient([ThreadClient(c, outbox) for c in data_parallel_cores(args, devices)], outbox)
    core = EngineCore(args, devices=devices)
    return ThreadClient(core) if own_loop else InprocClient(core)
