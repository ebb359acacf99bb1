"""Several hosts: one engine whose mesh spans every process of a jax.distributed cluster.

Every process (one per host) holds an LLMEngine over the same global devices and runs the same
jitted SPMD step; the collectives inside it (the row-parallel all-reduces, the logits gather) cross
hosts. Process 0, the leader, is the only one that receives requests. Because the scheduler is
deterministic, the others need only the leader's inputs, not its decisions: before each step the
leader publishes what changed since the last one (requests added, with their sampling seeds drawn,
and aborts), every follower applies the same changes to its own engine and steps, and all of them
schedule the same batch and sample the same tokens (the sampler runs on the replicated logits).
Only the leader's outputs go anywhere.

The channel is the cluster's key-value store (JAX's coordination service, which
jax.distributed.initialize starts in process 0): one key per step, so a follower that waits for
the next step waits on a store read with a timeout, never inside a collective that could time
out while the server is idle.

Every host sizes its KV pool from its own memory and all take the smallest (same_pool_on_every_host).
Limits: the swap pool is off (a host would have to copy only its own shards out; preemption
recomputes); a step that fails on one host's device and not on another's leaves the hosts apart.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import pickle
from collections.abc import Iterable
from typing import Any

import numpy as np

from jaxsched.config import EngineArgs, EngineConfig
from jaxsched.errors import StepFailedError
from jaxsched.outputs import RequestOutput
from jaxsched.request import Request
from jaxsched.step_cost import StepShape

logger = logging.getLogger(__name__)

_KEEP = 4096  # steps a key stays in the store (followers read each one before the step it names)
_POLL_MS = 1000


_engines = 0  # DistributedEngines made in this process: every process makes them in the same order


@dataclasses.dataclass
class _Message:
    """What a follower applies before the step it is for (or, with `end`, where it stops)."""

    # ("add", pickled Request) / ("abort", [request ids]), in the order the leader did them
    ops: list[tuple[str, Any]]
    end: str | None = None  # "idle": the leader's batch is done (LLM.generate); "stop": shut down
    # the leader's step-cost inputs since the last message ((T, S, context, seconds); context -1 =
    # a warm-up seed): the followers' models learn the same, so every host sizes steps the same
    costs: list[tuple[int, int, int, float]] = dataclasses.field(default_factory=list)


def initialize(args: EngineArgs) -> None:
    """jax.distributed.initialize from the engine arguments (before anything touches a device)."""
    import jax

    if jax.distributed.is_initialized():
        return
    if args.distributed_coordinator == "auto":  # Slurm, Open MPI, Kubernetes, ... (JAX's detection)
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(args.distributed_coordinator, args.num_processes, args.process_id)
    logger.info("process %d of %d; %d local and %d global devices", jax.process_index(), jax.process_count(),
                jax.local_device_count(), jax.device_count())


def same_pool_on_every_host(cfg: EngineConfig) -> EngineConfig:
    """The config with the smallest KV and swap pools any process sized from its own memory: every
    host must allocate the same global pool and schedule against the same block count."""
    from jax.experimental import multihost_utils

    mine = np.array([cfg.cache.num_blocks, cfg.scheduler.num_host_blocks], np.int64)
    least = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 2).min(axis=0)
    if (least == mine).all():
        return cfg
    logger.info("KV pool: %d blocks (the smallest any host has room for; this one had %d)", least[0], mine[0])
    return dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, num_blocks=int(least[0])),
                               scheduler=dataclasses.replace(cfg.scheduler, num_host_blocks=int(least[1])))


def _store():
    # The coordination service's key-value client. JAX keeps it in jax._src.distributed (no public
    # accessor); multihost_utils' own helpers use the same client.
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:  # pragma: no cover - initialize() ran first
        raise RuntimeError("jax.distributed is not initialized")
    return client


class DistributedEngine:
    """This process's part of an engine over several hosts, with LLMEngine's interface. On the
    leader (process 0) it is used as an LLMEngine is; the others call follow()."""

    def __init__(self, args: EngineArgs) -> None:
        import jax

        from jaxsched.engine import LLMEngine

        global _engines
        initialize(args)
        if args.tensor_parallel_size != jax.device_count():
            raise ValueError(
                f"with several hosts one engine spans every device: {jax.process_count()} processes x "
                f"{jax.local_device_count()} local devices, so set tensor_parallel_size={jax.device_count()} "
                f"(got {args.tensor_parallel_size})")
        if args.preemption_mode == "swap":
            raise ValueError("preemption_mode='swap' is not available with several hosts (each host would swap "
                             "only its own shards, which is not implemented); use 'recompute' or 'auto'")
        # preemption recomputes: the swap pool would hold only this host's shards
        self.engine = LLMEngine(dataclasses.replace(args, swap_space=0.0, preemption_mode="recompute"))
        self.process_id = jax.process_index()
        self.is_leader = self.process_id == 0
        self._ops: list[tuple[str, Any]] = []
        self._key = f"jaxsched/{_engines}/step/{{}}"  # a second engine in the same cluster has its own keys
        _engines += 1
        self._step = 0
        self._stopped = False
        eng = self.engine
        if eng.cost_model is not None:
            if self.is_leader:  # its warm-up timings go out with the first message
                eng.cost_feed = [(T, S, -1, sec) for T, S, sec in eng.cost_seeds]
            else:  # forget this host's own timings: the leader's are the ones every host uses
                eng.cost_model = eng.scheduler.cost_model = type(eng.cost_model)(eng.cost_model.pairs)
                eng.measure_costs = False
        if self.is_leader:  # a script that ends (or fails) without shutdown() still releases the others
            atexit.register(self.shutdown)

    def __getattr__(self, name: str) -> Any:  # everything else is the local engine's
        if "engine" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["engine"], name)

    # -- the leader ----------------------------------------------------------------------------
    def add_request_obj(self, req: Request) -> None:
        self._check_leader("add requests")
        # before the engine touches it: the followers start from the same state. A token constraint
        # (an llguidance matcher) does not pickle: each follower builds its own from the params
        blob = pickle.dumps(dataclasses.replace(req, constraint=None))
        self.engine.add_request_obj(req)
        self._ops.append(("add", blob))

    def add_request(self, request_id: str, prompt: Any, params: Any = None, arrival_time: float | None = None,
                    priority: int = 0) -> None:
        self.add_request_obj(self.engine.make_request(request_id, prompt, params, arrival_time, priority))

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        self._check_leader("abort requests")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.engine.abort_request(ids)
        self._ops.append(("abort", ids))

    def step(self) -> list[RequestOutput]:
        self._check_leader("step (the others call follow())")
        if self._stopped:
            raise RuntimeError("this engine was shut down: the other processes no longer follow it")
        self.engine.apply_cost_observations()  # before publishing them: both sides schedule with them
        self._publish(None)
        return self.engine.step()

    def end_batch(self) -> None:
        """Tell the followers that this batch is done (their follow(until="idle") returns)."""
        if self.is_leader:
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
            jax.distributed.shutdown()

    def _publish(self, end: str | None) -> None:
        eng = self.engine
        msg = _Message(self._ops, end, eng.cost_feed or [])
        self._ops = []
        if eng.cost_feed:
            eng.cost_feed = []
        store = _store()
        store.key_value_set_bytes(self._key.format(self._step), pickle.dumps(msg))
        if self._step >= _KEEP:
            store.key_value_delete(self._key.format(self._step - _KEEP))
        self._step += 1

    def _check_leader(self, what: str) -> None:
        if not self.is_leader:
            raise RuntimeError(f"process {self.process_id} follows process 0 and cannot {what}; requests go to "
                               "process 0, the other processes run follow()")

    # -- the followers -------------------------------------------------------------------------
    def follow(self, until: str = "stop") -> tuple[list[str], list[RequestOutput]]:
        """Run the leader's steps until it ends the batch ("idle") or shuts down ("stop"; "idle"
        markers are then skipped). With until="idle", returns the ids of the requests added
        meanwhile, in order, and every output this process's engine produced (the leader's, token
        for token); with "stop" (a server's lifetime) nothing is kept."""
        if self.is_leader:
            raise RuntimeError("process 0 leads; follow() is for the other processes")
        keep = until == "idle"
        store = _store()
        added: list[str] = []
        outs: list[RequestOutput] = []
        while True:
            key = self._key.format(self._step)
            while True:
                try:
                    blob = store.blocking_key_value_get_bytes(key, _POLL_MS)
                    break
                except Exception as e:  # a timeout: the leader is idle; anything else: it is gone
                    if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e).lower():
                        raise RuntimeError(f"process {self.process_id} lost the leader (process 0): {e}") from e
            self._step += 1
            msg: _Message = pickle.loads(blob)
            for T, S, context, seconds in msg.costs:
                if context < 0:
                    self.engine.cost_model.seed(T, S, seconds)
                else:
                    self.engine.cost_model.observe(StepShape(T, S, context), seconds)
            for op, arg in msg.ops:
                if op == "add":
                    req: Request = pickle.loads(arg)
                    req.constraint = self.engine.constraint(req.sampling_params)
                    self.engine.add_request_obj(req)
                    if keep:
                        added.append(req.request_id)
                else:
                    self.engine.abort_request(arg)
            if msg.end == "stop" or (msg.end == "idle" and keep):
                return added, outs
            if msg.end is None:
                try:
                    step = self.engine.step()
                except StepFailedError as e:  # as on the leader: the spoiled requests end, the rest go on
                    logger.error("%s", e, exc_info=e.__cause__)
                    step = e.outputs
                if keep:
                    outs.extend(step)
