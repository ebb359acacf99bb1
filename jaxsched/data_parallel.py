"""DataParallelEngine: data_parallel_size LLMEngine replicas on disjoint device groups, behind
LLMEngine's interface (what LLM, AsyncEngine and the CLI use; engine.create_engine builds it).

    replica i = LLMEngine(args with data_parallel_size=1, devices=jax.devices()[i*tp:(i+1)*tp])

Requests. A request is validated by replica 0's make_request (every replica has the same config, so
the same checks and, as a single engine, the same seed sequence), then dealt to the replica with the
fewest unfinished requests (the scheduler's, so an n > 1 request counts as its n samples; ties go to
the lowest index) and stays there: its KV is on that replica's devices. An id is refused while it
(or one of its sample ids) is in flight on any replica, so ids are unique across replicas and an
abort, by a request's id or a sample's, goes to the one replica holding it.

Steps. step() steps every replica that has unfinished requests, each on its own thread (one
single-thread executor per replica, so a replica always runs on the same thread): jax releases the
GIL while a device runs, so on several accelerators the replicas' steps overlap. Their outputs are
concatenated in replica order. When a replica's step fails on the device (StepFailedError), the other
replicas' outputs of that step are not lost: the StepFailedError raised carries every output of the
step (the failed requests' with `error` set; errors.StepFailedError.request_ids names those). Any
other exception (a bug on the host) is re-raised after every replica's step has returned.

Stats. Counts and counters are summed over the replicas; kv_cache_usage_perc is recomputed from
the totals (blocks in use over usable blocks, all replicas), so a replica with a larger pool weighs
more; last_step_padded_tokens sums the replicas that ran in the last step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from jaxsched.config import EngineArgs
from jaxsched.engine import LLMEngine, PromptType
from jaxsched.errors import InvalidRequestError, StepFailedError
from jaxsched.output_processor import tracked_ids
from jaxsched.outputs import RequestOutput
from jaxsched.request import Request, SamplingParams
from jaxsched.stats import EngineStats


def replica_device_groups(tensor_parallel_size: int, data_parallel_size: int, devices: Sequence[Any] | None = None
                          ) -> list[list[Any]]:
    """The device group of each replica: consecutive runs of tensor_parallel_size devices of
    `devices` (default: jax.devices()). Raises ValueError, saying what to change, when the product
    exceeds the devices present."""
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


class _Runners:
    """engine.runner for a data-parallel engine: replica 0's runner (all replicas compile the same
    buckets), except warmup_seconds, the replicas' total (they warm up one after another)."""

    def __init__(self, replicas: list[LLMEngine]) -> None:
        self._replicas = replicas

    @property
    def warmup_seconds(self) -> float:
        return sum(r.runner.warmup_seconds for r in self._replicas)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._replicas[0].runner, name)


class DataParallelEngine:
    def __init__(self, args: EngineArgs | None = None, devices: Sequence[Any] | None = None, **kwargs: Any) -> None:
        """devices: the devices to split into replica groups (default: jax.devices()); the check
        that there are enough runs before any replica loads."""
        args = args if args is not None else EngineArgs.from_kwargs(**kwargs)
        groups = replica_device_groups(args.tensor_parallel_size, args.data_parallel_size, devices)
        one = dataclasses.replace(args, data_parallel_size=1)
        self.replicas: list[LLMEngine] = [LLMEngine(one, devices=groups[0])]
        # the others get replica 0's pool (sized from memory when it was free): requests are checked
        # against replica 0's config, so every replica must be able to hold what it accepts
        one = dataclasses.replace(one, num_gpu_blocks_override=self.replicas[0].config.cache.num_blocks)
        for group in groups[1:]:
            self.replicas.append(LLMEngine(one, devices=group))
        first = self.replicas[0]
        self.config = first.config
        self.tokenizer = first.tokenizer
        self.eos_token_ids = first.eos_token_ids
        self.runner = _Runners(self.replicas)
        self._executors = [ThreadPoolExecutor(1, thread_name_prefix=f"jaxsched-replica{i}")
                           for i in range(len(self.replicas))]
        self._last_stepped: list[int] = []
        self._next_id = 0

    # -- LLMEngine's read-only interface -------------------------------------------------------
    @property
    def model_config(self):
        return self.replicas[0].model_config

    @property
    def cache_config(self):
        """Replica 0's (every replica has the same, unless their pools were sized from memory)."""
        return self.replicas[0].cache_config

    @property
    def scheduler_config(self):
        return self.replicas[0].scheduler_config

    @property
    def devices(self) -> tuple[Any, ...]:
        """Every replica's devices, replica by replica."""
        return tuple(d for r in self.replicas for d in r.devices)

    def kv_bytes_per_device(self) -> int:
        """The KV pool's bytes on each device (the largest, should replicas' pools differ)."""
        return max(r.kv_bytes_per_device() for r in self.replicas)

    # -- requests ------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType | Sequence[int]) -> tuple[list[int], str | None]:
        return self.replicas[0].tokenize_prompt(prompt)

    def make_request(self, request_id: str, prompt: PromptType | Sequence[int],
                     params: SamplingParams | None = None, arrival_time: float | None = None,
                     priority: int = 0) -> Request:
        """LLMEngine.make_request (replica 0's: the replicas share their config)."""
        return self.replicas[0].make_request(request_id, prompt, params, arrival_time, priority)

    def add_request(self, request_id: str, prompt: PromptType | Sequence[int],
                    params: SamplingParams | None = None, arrival_time: float | None = None,
                    priority: int = 0) -> None:
        self.add_request_obj(self.make_request(request_id, prompt, params, arrival_time, priority))

    def load(self) -> list[int]:
        """Unfinished requests per replica (an n > 1 request counts as its samples)."""
        return [len(r.scheduler.requests) for r in self.replicas]

    def add_request_obj(self, req: Request) -> None:
        """Queue a request on the least loaded replica (fewest unfinished requests, then the lowest
        index); refused if its id, or one of its samples' ids, is in flight on any replica."""
        ids = tracked_ids(req)
        taken = next((i for i in ids for r in self.replicas if i in r.outputs), None)
        if taken is not None:
            raise InvalidRequestError(f"request_id {taken!r} is already in flight; use a unique id", "request_id")
        load = self.load()
        self.replicas[load.index(min(load))].add_request_obj(req)

    def replica_of(self, request_id: str) -> int | None:
        """The index of the replica holding a request (by its id or a sample's), None if none does."""
        return next((i for i, r in enumerate(self.replicas) if request_id in r.outputs), None)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """End requests, each on the replica holding it (an n > 1 request, or any of its samples,
        ends all its samples); unknown ids are ignored, as by LLMEngine."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        by_replica: dict[int, list[str]] = {}
        for rid in ids:
            i = self.replica_of(rid)
            if i is not None:
                by_replica.setdefault(i, []).append(rid)
        for i, rids in by_replica.items():
            self.replicas[i].abort_request(rids)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def stats(self) -> EngineStats:
        """The replicas' EngineStats summed; kv_cache_usage_perc over all replicas' blocks;
        last_step_padded_tokens of the replicas that ran in the last step."""
        each = [r.stats() for r in self.replicas]
        usable = [r.cache_config.num_usable_blocks for r in self.replicas]
        summed = {f.name: sum(getattr(s, f.name) for s in each) for f in dataclasses.fields(EngineStats)
                  if f.name not in ("kv_cache_usage_perc", "last_step_padded_tokens")}
        used = sum(s.kv_cache_usage_perc * u for s, u in zip(each, usable))
        return EngineStats(**summed, kv_cache_usage_perc=used / sum(usable),
                           last_step_padded_tokens=sum(each[i].last_step_padded_tokens for i in self._last_stepped))

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step of every replica with unfinished requests, concurrently; their outputs in
        replica order. A replica's StepFailedError is re-raised carrying every output of the step."""
        busy = [i for i, r in enumerate(self.replicas) if r.has_unfinished_requests()]
        self._last_stepped = busy
        futures: list[Future] = [self._executors[i].submit(self.replicas[i].step) for i in busy]
        outputs: list[RequestOutput] = []
        failed: StepFailedError | None = None
        other: BaseException | None = None
        for fut in futures:  # every one is waited for: no replica is left mid-step
            try:
                outputs.extend(fut.result())
            except StepFailedError as e:
                outputs.extend(e.outputs)
                failed = failed or e
            except BaseException as e:  # noqa: BLE001 - re-raised below, once every replica has returned
                other = other or e
        if other is not None:
            raise other
        if failed is not None:
            raise StepFailedError(outputs, failed.__cause__ or failed) from failed.__cause__
        return outputs

    def next_request_id(self) -> str:
        self._next_id += 1
        return str(self._next_id - 1)

    def shutdown(self) -> None:
        """Stop the replicas' step threads (they are idle between steps; the interpreter also ends them)."""
        for ex in self._executors:
            ex.shutdown(wait=True)
