"""Data parallelism: N independent engine cores, one per device group, behind one client that routes
each request by prefix-cache hit and load. Each core runs its own loop; no core waits for another."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from jaxsched import platforms
from jaxsched.config import EngineArgs
from jaxsched.core.stats import EngineStats
from jaxsched.engine.core import EngineCore
from jaxsched.engine.core_client import EngineCoreClient, LoopClient, Outbox
from jaxsched.engine.core_messages import CoreDead, EngineCoreOutputs, EngineCoreRequest, sample_ids

T = TypeVar("T")


class DataParallelClient(EngineCoreClient):
    """N cores, each with its own loop, behind one client. A request goes to the core that has the
    longest prefix of its prompt cached (as far as this client routed it: the prompt's full blocks,
    hashed in a chain as the block manager hashes them, remembered per core), unless that core is
    overloaded; otherwise, and for a prompt no core has seen, to the least loaded core (fewest
    unfinished samples; ties to the lowest index). Overloaded: it has no free seat
    (max_num_seqs unfinished) while another core has one, or a full batch more than the least
    loaded core. Outputs come as each core produces them."""

    PREFIX_ENTRIES = 1 << 16  # block hashes remembered, least recently used forgotten first

    def __init__(self, clients: Sequence[LoopClient], outbox: Outbox) -> None:
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
        apart = ("kv_cache_usage_perc", "longest_step_seconds", "spec_decode_num_accepted_tokens_per_pos")
        summed = {f.name: sum(getattr(s, f.name) for s in each) for f in dataclasses.fields(EngineStats)
                  if f.name not in apart}
        per_pos = [s.spec_decode_num_accepted_tokens_per_pos for s in each]
        return EngineStats(**summed, kv_cache_usage_perc=sum(s.kv_cache_usage_perc for s in each) / len(each),
                           longest_step_seconds=max(s.longest_step_seconds for s in each),
                           spec_decode_num_accepted_tokens_per_pos=tuple(map(sum, zip(*per_pos))) if per_pos else ())

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
        hint = platforms.of(platform).more_devices_hint if devices else ""
        raise ValueError(
            f"tensor_parallel_size={tp} x data_parallel_size={dp} needs {tp * dp} devices, but {len(devices)} "
            f"{platform} device(s) are present; lower data_parallel_size or tensor_parallel_size so that their "
            f"product is at most {len(devices)}{hint}")
    return [devices[i * tp:(i + 1) * tp] for i in range(dp)]


def start_cores(args: EngineArgs, start: Callable[[EngineArgs, int], T]) -> list[T]:
    """args.data_parallel_size cores, `start(args, index)` each (a core, or a client over a core
    process). The KV pool's size is the one setting a core cannot know before it has loaded the
    model and measured the memory left, so core 0 decides it and every other core is started with
    that count: requests are checked against core 0's config, and every core must hold what it
    accepts."""
    first = start(args, 0)
    rest = dataclasses.replace(args, num_gpu_blocks_override=first.config.cache.num_blocks)
    return [first] + [start(rest, i) for i in range(1, args.data_parallel_size)]


def data_parallel_cores(args: EngineArgs, devices: Sequence[Any] | None = None) -> list[EngineCore]:
    """data_parallel_size cores in this process, one per device group (start_cores). The device
    check runs before any core loads."""
    groups = replica_device_groups(args.tensor_parallel_size, args.data_parallel_size, devices)
    def start(a: EngineArgs, i: int) -> EngineCore:
        return EngineCore(dataclasses.replace(a, data_parallel_size=1), devices=groups[i], engine_index=i)

    return start_cores(args, start)
