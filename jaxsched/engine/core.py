"""EngineCore: the scheduler and the model runner in one loop, token ids in and token ids out.

What runs each step (EngineCore.step):
    out     = scheduler.schedule()              who runs, how many tokens each, which buckets, block moves
    step    = runner.dispatch(out)              block moves, then the jitted calls: model + sampler
    res     = runner.collect(step)              wait for it, read the sampled tokens
    got     = scheduler.update(out, sampled)    append tokens, stop token ids, max_tokens, free blocks
    outputs = [EngineCoreOutput ...]            per request: its new token ids, logprob arrays, finish

The core knows no text: a request comes in as an EngineCoreRequest (token ids and checked sampling
parameters, core_messages.py) and leaves as EngineCoreOutputs. Detokenizing, stop strings and
n > 1 grouping are the front end's (frontend.py); a stop string found there comes back as an abort.
The same object runs in the caller's thread (LLMEngine, tests), on a thread of its own or in a
process of its own (core_client.py: run_loop is the loop both use).

Overlapped scheduling (async_scheduling, vLLM's --async-scheduling): step() schedules and
dispatches step N+1 *before* it collects step N, so the host's work (scheduling, packing, reading)
runs while the device computes, and the device finds the next step queued when it finishes one.
Step N+1 is scheduled as if every running request got its token from step N; its decode rows take
those tokens on the device (runner.py), and the host reads them one step later. A request that
step N ends (EOS, a stop token, or a stop string the front end finds) costs one wasted row in step
N+1, whose token update() drops; one that ends by length is not scheduled again. The outputs are
the synchronous engine's. Penalty tables are built on the host from the tokens read, and the
sampler folds a row's pending token in on the device (batch.pending_src), so penalties do not
wait. A grammar's next token mask needs the token its row samples (grammar.py,
depends_on_tokens), so the step after one with such a row waits for it (reads its tokens before
scheduling); a fixed mask (allowed_token_ids) does not. A step that swaps a request out waits too:
the copy needs the pages of the step in flight. The default (None) is on, except on a CPU where
no core is reserved for the host and the model keeps every core busy: there the host's work only
delays the device's threads (cpu_affinity.auto_async_scheduling).

Everything is decided once, up front, by config.resolve() from the platform's record
(jaxsched/platforms): cpu_reserved_cores="auto" alone is counted before jax starts (reserve_count:
XLA sizes its CPU pools when it starts), and resolve() takes that count. __init__ then only
builds the pieces.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import jax

from jaxsched.config import EngineArgs, EngineConfig, ModelConfig, quantization_of, resolve, token_budget
from jaxsched.core.block_manager import BlockManager
from jaxsched.core.buckets import bucket_pairs
from jaxsched.core.kv_groups import kv_groups
from jaxsched.core.request import Request, RequestStatus
from jaxsched.core.scheduler import Scheduler
from jaxsched.core.stats import HOST_PHASES, EngineStats
from jaxsched.core.step_cost import StepCostModel, StepShape
from jaxsched.engine.core_messages import (
    AbortRequests,
    CoreInfo,
    CoreInput,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    LogprobArrays,
    Shutdown,
    UtilityOutput,
    UtilityRequest,
    sample_ids,
    sample_seed,
)
from jaxsched.engine.tokenizer import load_tokenizer
from jaxsched.errors import InvalidRequestError
from jaxsched.models.demo import demo_model_path
from jaxsched.models.hub import local_args
from jaxsched.models.loader import build_model, forget_gguf_readers, load_model_source
from jaxsched.models.quantize import GROUP, grouped, quantize_model
from jaxsched.parallel.hosts import same_pool_on_every_host
from jaxsched.parallel.mesh import engine_devices, head_layout, make_mesh
from jaxsched.platforms import expected, host_malloc
from jaxsched.platforms import of as platform_of
from jaxsched.platforms.cpu_affinity import auto_reserved_cores, reserve, reserved_now, size_xla_pools
from jaxsched.runner.memory_report import MemoryReport, code_bytes, device_bytes, resident_bytes
from jaxsched.runner.model_runner import (
    ModelRunner,
    device_memory,
    largest_temporary_bytes,
    temporary_bytes_bound,
    weights_bytes,
)
from jaxsched.structured.grammar import GrammarCompiler

if TYPE_CHECKING:
    from jaxsched.core.scheduler import SchedulerOutput
    from jaxsched.runner.model_runner import InFlight, StepResult

logger = logging.getLogger(__name__)

# Cores that may have a step running on the device (overlapped scheduling leaves the last one
# unread when the work ends by abort, or when the caller stops stepping). jax's CPU client, torn down
# at interpreter exit while a computation still runs, deadlocks: the process hung for minutes after
# 43 steps of 2,048 tokens with 2,000 requests queued. So at exit each such step is waited for first.
_CORES: weakref.WeakSet = weakref.WeakSet()
_at_exit_registered = False


def _wait_for_steps_in_flight() -> None:
    for core in list(_CORES):
        step = core._in_flight
        if step is not None and step.ints is not None:
            with contextlib.suppress(Exception):  # a failed step has nothing left to wait for
                jax.block_until_ready((step.ints, step.floats))


def _register(core: EngineCore) -> None:
    """Track `core` for _wait_for_steps_in_flight. The exit hook is registered once, after jax
    was imported (here, at the first core): atexit runs hooks last-registered first, so it runs
    before jax's own."""
    global _at_exit_registered
    _CORES.add(core)
    if not _at_exit_registered:
        atexit.register(_wait_for_steps_in_flight)
        _at_exit_registered = True


class DeviceFailure(Exception):
    """Inside step(): the device (or the runner's call into it) failed on these steps."""

    def __init__(self, outs: list[SchedulerOutput], cause: BaseException) -> None:
        super().__init__(str(cause))
        self.outs = outs
        self.cause = cause


class StepFailure(Exception):
    """A step failed on the device; the core ended the requests whose KV it may have spoiled
    (`outputs`, each with error set). Every other request is intact."""

    def __init__(self, outputs: list[EngineCoreOutput], cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.outputs = outputs
        self.cause = cause


class EngineCore:
    # the methods a UtilityRequest may name (a core in another process runs nothing else)
    UTILITIES = frozenset({"reset_prefix_cache", "set_async_scheduling", "take_cost_errors",
                           "keep_cost_errors", "set_speculation"})

    def __init__(self, args: EngineArgs | None = None, devices: Sequence[Any] | None = None,
                 engine_index: int = 0, **kwargs: Any) -> None:
        """devices: the jax devices this core runs on, tensor_parallel_size of them (a data-parallel
        core's group); None: the first tensor_parallel_size devices (of every process, with
        several hosts)."""
        args = local_args(args if args is not None else EngineArgs.from_kwargs(**kwargs))
        self.engine_index = engine_index
        t0 = time.perf_counter()
        path = args.model or str(demo_model_path())
        model_cfg, getter, _kind = load_model_source(path)
        spec = args.speculative_config
        draft_source = load_model_source(spec.model) if spec is not None and spec.model is not None else None
        reserved = self._start_process(args, model_cfg, devices)  # before anything starts jax
        devices = engine_devices(args.tensor_parallel_size, devices)
        mesh = make_mesh(devices) if len(devices) > 1 or devices[0] != jax.devices()[0] else None
        self.config = cfg = self._resolve(args, model_cfg, path, devices, reserved,
                                          draft_source[0] if draft_source else None)
        self.devices = tuple(devices)
        # the core's tokenizer serves grammars only (llguidance reads its vocabulary): no text here
        self.tokenizer = load_tokenizer(cfg.tokenizer_path)
        # the checkpoint's config as resolved (a sliding window no shorter than the context dropped)
        model = build_model(cfg.checkpoint_model, cfg.dtype, getter, attention_backend=cfg.attention_backend, seed=cfg.seed,
                            layer_weights=cfg.layer_weights, mesh=mesh, heads=cfg.heads if mesh else None)
        forget_gguf_readers()  # weights and tokenizer are loaded: the file's reader is not needed again
        if cfg.quantization:
            groups = grouped(cfg.quantization, cfg.model)
            n = quantize_model(model, cfg.quantization, cfg.quantize_embedding, groups)
            logger.info("quantized %d weights to %s (%s)%s", n, cfg.quantization,
                        f"in groups of {GROUP} inputs, as the GGUF file's blocks" if groups else "per output channel",
                        ", embedding and lm_head included" if cfg.quantize_embedding else "")
        logger.info("loaded %s (%s, %s) in %.1f s", path, model_cfg.architecture, cfg.dtype, time.perf_counter() - t0)
        draft = self._load_draft(args, draft_source, mesh) if draft_source else None
        self.block_manager = BlockManager(cfg.cache.num_blocks, cfg.cache.block_size,
                                          enable_prefix_caching=cfg.enable_prefix_caching,
                                          groups=kv_groups(cfg.model))
        # the step-cost model sizes steps (step_cost_model), and speculative decoding's proposals
        spec = cfg.scheduler.speculative
        self.cost_model = StepCostModel(bucket_pairs(cfg.scheduler.token_buckets, cfg.scheduler.seq_buckets),
                                        widths=(1, spec.width) if spec is not None else (1,)) \
            if cfg.step_cost_model or (spec is not None and cfg.speculation_by_cost) else None
        target = cfg.target_tpot_ms / 1e3 if cfg.target_tpot_ms is not None else None
        self.scheduler = Scheduler(cfg.scheduler, self.block_manager, policy=cfg.scheduling_policy,
                                   cost_model=self.cost_model, target_step_seconds=target,
                                   size_steps=cfg.step_cost_model)
        self.runner = ModelRunner(model, cfg, mesh, draft=draft)
        del model, draft  # the runner holds the weights (packed, on a CPU): the module's copies may go
        host_malloc.release_freed()
        before_warm_up = resident_bytes()
        self.cost_seeds = self._warm_up()
        # the load's host copies and the warm-up runs' temporary buffers, kept by malloc (the steps
        # keep the largest one again from their first run on: the report's workspace)
        host_malloc.release_freed()
        # what the compiled programs keep of the host's memory (the report's programs on a CPU)
        self._warm_up_kept = max(0, resident_bytes() - before_warm_up)
        self.eos_token_ids = tuple(sorted({*model_cfg.eos_token_ids, *(
            [int(self.tokenizer.eos_token_id)] if self.tokenizer.eos_token_id is not None else [])}))
        self.grammars = GrammarCompiler(self.tokenizer, model_cfg.vocab_size, self.eos_token_ids)
        self.runner.packer.grammar_executor = lambda: self.grammars.executor
        self._init_loop_state()
        self._log_pool()
        self.memory = self._memory_report(devices[0], args.gpu_memory_utilization)
        logger.info(self.memory.lines())
        _register(self)

    def _start_process(self, args: EngineArgs, model_cfg: ModelConfig, devices: Sequence[Any] | None) -> int:
        """The platform's process settings, applied before jax starts its threads (they take their
        malloc arena, and XLA sizes its CPU pools, when they first run): malloc kept (and thread
        arenas where this engine's programs allow), XLA's pools sized for the cores left to the
        model. Returns cpu_reserved_cores as a count ("auto" decided here, before jax starts)."""
        host_malloc.apply_once()
        max_len = args.max_model_len or model_cfg.max_position_embeddings
        self.temporary_bound = temporary_bytes_bound(model_cfg, args.max_num_seqs, token_budget(args, max_len), max_len)
        host_malloc.allow_thread_arenas(self.temporary_bound)
        reserved = reserve_count(args, model_cfg, devices)
        size_xla_pools(reserved)
        return reserved

    def _load_draft(self, args: EngineArgs, source, mesh) -> Any:
        """speculative_config's draft model, built in the engine's dtype and attention backend (and
        quantized as the target is), once its tokenizer is found to be the target's."""
        cfg, path = self.config, args.speculative_config.model
        draft_cfg, getter, _kind = source
        ours, theirs = self.tokenizer.get_vocab(), load_tokenizer(path).get_vocab()
        if ours != theirs:
            differ = sorted(set(ours.items()) ^ set(theirs.items()))[:3]
            raise ValueError(f"speculative_config.model {path!r}: the draft's tokenizer differs from the target's "
                             f"({len(theirs)} against {len(ours)} tokens; e.g. {differ}); a draft must share the "
                             "target's tokenizer (pick a smaller model of the same family)")
        t0 = time.perf_counter()
        draft = build_model(cfg.draft_model, cfg.dtype, getter, attention_backend=cfg.attention_backend,
                            seed=cfg.seed + 1, layer_weights=cfg.layer_weights, mesh=mesh,
                            heads=head_layout(cfg.draft_model, 1) if mesh else None)
        forget_gguf_readers()
        quantization = quantization_of(args, draft_cfg)
        if quantization:
            quantize_model(draft, quantization, cfg.quantize_embedding, grouped(quantization, draft_cfg))
        logger.info("loaded the draft model %s (%s, %d layers) in %.1f s", path, draft_cfg.architecture,
                    draft_cfg.num_layers, time.perf_counter() - t0)
        return draft

    def _resolve(self, args: EngineArgs, model_cfg: ModelConfig, path: str, devices: Sequence[Any],
                 reserved: int, draft: ModelConfig | None = None) -> EngineConfig:
        """config.resolve on these devices: memory sized from this process's devices of the engine;
        with several hosts, every host takes the smallest pool any of them has room for."""
        tp = len(devices)
        local = [d for d in devices if d.process_index == jax.process_index()]
        cfg = resolve(args, model_cfg, path, devices[0].platform, reserved=reserved,
                      weights_bytes=lambda run_cfg, dtype: weights_bytes(
                          run_cfg, dtype, tp, quantization_of(args, run_cfg), args.quantize_embedding),
                      memory=lambda: device_memory(local[0], len(local)), draft=draft)
        if jax.process_count() > 1:
            cfg = same_pool_on_every_host(cfg)
        if tp > 1:
            logger.info("tensor parallel over %d devices (%s): %s", tp, ", ".join(str(d) for d in devices),
                        cfg.heads.describe(cfg.checkpoint_model))
        return cfg

    def _warm_up(self) -> list[tuple[int, int, float]]:
        """Compile (and with warm_up_runs, run) every program; time the cost model's seeds: a full
        decode step of each decode-sized token bucket. Returns the seeds (T, S, seconds)."""
        cfg = self.config
        # before warm-up, so that the seeds are timed as the steps will run; 0 undoes an earlier
        # engine's reserve in this process (and does nothing otherwise, or on a GPU)
        reserve(cfg.cpu_reserved_cores)
        self.runner.warm_up(run=cfg.warm_up_runs)
        if host_malloc.state == "threads":
            self._check_thread_arenas()
        seeds: list[tuple[int, int, float]] = []
        if self.cost_model is not None:
            sc = cfg.scheduler
            pairs = [self.scheduler.bucket_pair(T, min(T, sc.max_num_seqs))
                     for T in sc.token_buckets if T <= max(sc.max_num_seqs, sc.token_buckets[0])]
            seeds = self.runner.time_pairs(pairs)
            for T, S, seconds in seeds:
                self.cost_model.seed(T, S, seconds)
            if sc.speculative is not None:
                # the steps that verify proposals: each decode-sized T with a row per 1 + k tokens
                Q = sc.speculative.width
                wide = [self.scheduler.bucket_pair(T, max(1, min(T // Q, sc.max_num_seqs))) for T, _ in pairs]
                for T, S, seconds in self.runner.time_pairs(list(dict.fromkeys(wide)), Q=Q):
                    self.cost_model.seed(T, S, seconds, Q)
        if cfg.cpu_reserved_cores:  # again: threads started during warm-up
            reserve(cfg.cpu_reserved_cores)
        return seeds

    def _check_thread_arenas(self) -> None:
        largest = largest_temporary_bytes(self.runner.step_programs())
        if largest > host_malloc.THREAD_HEAP_BYTES // 2:  # the bound fell short: say so, and how to avoid it
            logger.warning("a program's temporary buffer is %.1f MiB, over the %.0f MiB a thread arena holds, "
                           "and threads allocate from arenas of their own (an engine of this process with "
                           "smaller programs chose them, or the bound fell short): its host memory is mapped "
                           "afresh at every run. Set JAXSCHED_HOST_MALLOC=keep to keep one arena",
                           largest / 2**20, host_malloc.THREAD_HEAP_BYTES // 2 / 2**20)
        logger.info("host malloc: threads allocate from arenas of their own (%d arenas; the largest program "
                    "temporary buffer %.1f MiB)", host_malloc.arena_count(), largest / 2**20)

    def _init_loop_state(self) -> None:
        """What the step loop keeps between steps."""
        # every step time fed to the cost model, when someone keeps them (a multi-host leader sends
        # them to the other hosts, whose models must stay identical: parallel/multihost.py)
        self.cost_feed: list[tuple[int, int, int, float]] | None = None
        self.measure_costs = True  # False: the model is fed from elsewhere (a multi-host follower)
        # step times measured, applied to the model at the start of the next step() (a fixed point:
        # a multi-host leader sends them before that step, so every host schedules with the same)
        self._costs: list[tuple[StepShape, float]] = []
        # when a list: (predicted, measured) seconds of every step timed, the prediction made before
        # the model saw that step (bench_offline.py reports the error distribution)
        self.cost_errors: list[tuple[float, float]] | None = None
        self._last_done = 0.0  # when the last step's results were read (step-time estimates)
        self._groups: dict[str, list[str]] = {}  # n > 1: request id -> its samples' ids
        # several hosts (parallel/multihost.py): a leader hands each input it applied to the
        # followers, and sends them ahead of each step
        self.on_input: Callable[[EngineCoreRequest | AbortRequests], None] | None = None
        self.before_step: Callable[[], None] | None = None
        self._longest_step = 0.0
        self._step_seconds = 0.0  # stats(): wall time of the steps, and the device's part of it
        self._device_seconds = 0.0
        self._busy_seconds = 0.0  # stats().device_busy_seconds / _steps
        self._busy_steps = 0
        self._phase_seconds = dict.fromkeys(HOST_PHASES, 0.0)  # host work by phase
        self.async_scheduling = self.config.async_scheduling
        self._in_flight: InFlight | None = None  # the step dispatched last, whose tokens are not read yet
        self._overlap_pauses = 0  # steps read before the next was scheduled, for its proposals (step())

    def _log_pool(self) -> None:
        cfg, tp = self.config, len(self.devices)
        logger.info("KV pool: %d blocks of %d tokens, %s, attention backend %s, %.1f MiB per device on each of %d "
                    "(%d of %d KV heads each); swap pool: %d blocks", cfg.cache.num_blocks - 1, cfg.cache.block_size,
                    cfg.cache.dtype, cfg.attention_backend, self.kv_bytes_per_device() / 2**20, tp,
                    cfg.model.num_kv_heads // tp, cfg.model.num_kv_heads, cfg.scheduler.num_host_blocks)

    def _memory_report(self, device, utilization: float) -> MemoryReport:
        """Where the memory of one of this core's devices went, read off the arrays (memory_report.py)."""
        r, cfg = self.runner, self.config
        local = sum(1 for d in self.devices if d.process_index == device.process_index)
        total, _ = device_memory(device, local)
        weights, kv = device_bytes(r.weights), device_bytes(r.kv)
        programs = r.step_programs()
        workspace = largest_temporary_bytes(programs)
        # a GPU reports its programs' code; a CPU does not, and its programs live in host memory,
        # the device's there: what the warm-up's compilations kept of it
        code = code_bytes(programs) or (self._warm_up_kept if platform_of(device.platform).host_runs_model else 0)
        budget = int(utilization * total)
        usable = cfg.cache.num_usable_blocks
        return MemoryReport(weights=weights, kv_pool=kv, kv_blocks=usable,
                            kv_tokens=usable * cfg.cache.block_size // r.kv_groups.num_groups,
                            swap=sum(x.nbytes for x in r.host_kv) if r.host_kv is not None else 0,
                            workspace=workspace, budget=budget, left=budget - weights - kv - workspace - code,
                            programs=code, draft_weights=device_bytes(r._draft_leaves),
                            draft_kv_pool=device_bytes(r.kv[2:]))

    # -- what the front end reads once ---------------------------------------------------------
    @property
    def model_config(self) -> ModelConfig:
        """The checkpoint's architecture (head counts as in its config.json)."""
        return self.config.checkpoint_model

    def kv_bytes_per_device(self) -> int:
        """The KV pool's bytes on each of this core's devices (every block, null page included)."""
        from jaxsched.sizing import kv_bytes_per_block

        c = self.config
        per_block = kv_bytes_per_block(c.model, c.cache.block_size, c.cache.dtype, c.tensor_parallel_size)
        if c.draft_model is not None:  # the draft model's KV, in the same blocks
            per_block += kv_bytes_per_block(c.draft_model, c.cache.block_size, c.cache.dtype)
        return c.cache.num_blocks * per_block

    def info(self) -> CoreInfo:
        return CoreInfo(list(self.eos_token_ids), self.runner.warmup_seconds, self.kv_bytes_per_device(), self.memory,
                        len(self.devices))

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request checked by the front end (frontend.InputProcessor). With n > 1 its samples
        run as sibling Requests ("{i}_{id}") that share the prompt's KV blocks; all are queued or
        none is. Raises InvalidRequestError when its id (or a sample's) is in flight, QueueFullError
        when max_num_queued_requests wait already."""
        params = req.sampling_params
        rid, n = req.request_id, params.n
        if params.prompt_logprobs is not None:  # its program, before any step needs it (once per engine)
            self.runner.ensure_prompt_logprobs(run=self.config.warm_up_runs)
        ids = sample_ids(rid, n)
        taken = next((i for i in ([rid, *ids] if n > 1 else ids)
                      if i in self.scheduler.requests or i in self._groups), None)
        if taken is not None:
            raise InvalidRequestError(f"request_id {taken!r} is already in flight; use a unique id", "request_id")
        base = Request(request_id=rid, prompt_token_ids=req.prompt_token_ids, sampling_params=params,
                       arrival_time=req.arrival_time, priority=req.priority, eos_token_ids=self.eos_token_ids,
                       sample_seed=req.sample_seed, constraint=self.constraint(params), cache_salt=req.cache_salt,
                       deadline=req.deadline, queue_deadline=req.queue_deadline)
        if n == 1:
            samples = [base]
        else:
            # With prefix caching off, the samples share blocks only among themselves.
            salt = req.cache_salt if self.config.enable_prefix_caching else int.from_bytes(
                hashlib.blake2b(rid.encode(), digest_size=8).digest(), "little")
            samples = [dataclasses.replace(base, request_id=sid, sample_seed=sample_seed(req.sample_seed, i),
                                           group_id=rid, group_size=n, output_token_ids=[], block_hashes=[],
                                           cache_salt=salt, constraint=base.constraint and base.constraint.fork())
                       for i, sid in enumerate(ids)]
        added: list[str] = []
        try:
            for s in samples:
                self.scheduler.add_request(s)
                added.append(s.request_id)
        except Exception:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise
        if n > 1:
            self._groups[rid] = ids
        if self.on_input is not None:
            self.on_input(req)

    def constraint(self, params):
        """The TokenConstraint of a request's params (grammar.py), or None. A grammar the front end
        compiled with this core's compiler (in process) costs nothing here; else it is compiled
        now, once per grammar text (GrammarCompiler's cache)."""
        from jaxsched.structured.grammar import AllowedTokens

        if params.allowed_token_ids is not None:
            return AllowedTokens(params.allowed_token_ids, self.model_config.vocab_size)
        if params.structured_outputs is None:
            return None
        banned = self.eos_token_ids if params.ignore_eos else ()
        return self.grammars.compile(params.structured_outputs).constraint(banned)

    def _members(self, rid: str) -> list[str]:
        """The sample ids that end with `rid`: an n > 1 request's (by its id or a sample's), else itself."""
        req = self.scheduler.requests.get(rid)
        gid = req.group_id if req is not None and req.group_id is not None else rid
        return list(self._groups.get(gid, [rid]))

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        """End requests: by a request's id (with n > 1 all its samples), or by a sample's id (that
        sample alone: the front end ends a sample whose text reached a stop string). Unknown ids are
        ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        ended = [s for rid in ids for s in self._groups.get(rid, (rid,))]
        gids = {r.group_id for s in ended if (r := self.scheduler.requests.get(s)) is not None and r.group_id}
        self.scheduler.finish_requests(ended, RequestStatus.FINISHED_ABORTED)
        for gid in gids | (set(ids) & self._groups.keys()):
            if not any(s in self.scheduler.requests for s in self._groups.get(gid, ())):
                self._groups.pop(gid, None)
        if self._in_flight is not None and not self.scheduler.has_unfinished_requests():
            self._in_flight.idle_after = True  # read at the next step, whenever that comes: not timed
        if self.on_input is not None:
            self.on_input(AbortRequests(ids))

    def has_unfinished_requests(self) -> bool:
        """Whether a request is still in flight. (A step still running on the device whose requests
        all ended does not count: the next step() reads it.)"""
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> EngineStats:
        """Queue lengths, KV usage, preemptions, prefix-cache and padding figures (vLLM's names),
        and the steps' wall and device-wait seconds."""
        return dataclasses.replace(self.scheduler.stats(), step_seconds=self._step_seconds,
                                   longest_step_seconds=self._longest_step,
                                   device_seconds=self._device_seconds, device_busy_seconds=self._busy_seconds,
                                   device_busy_steps=self._busy_steps, spec_decode_overlap_pauses=self._overlap_pauses,
                                   **{f"{k}_seconds": v for k, v in self._phase_seconds.items()})

    # -- utilities (UtilityRequest names these) ------------------------------------------------
    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

    def set_async_scheduling(self, on: bool) -> None:
        self.async_scheduling = bool(on)

    def set_speculation(self, on: bool) -> None:
        """Make speculative proposals or not, on an engine built with speculative_config (the same
        compiled programs either way: `jaxsched bench --speculation both` compares the two)."""
        if on and self.scheduler.proposer is None:
            raise ValueError("this engine was built without speculative_config: nothing to turn on")
        self.scheduler.speculating = bool(on)

    def keep_cost_errors(self) -> None:
        """Start keeping (predicted, measured) seconds of every timed step (take_cost_errors reads them)."""
        if self.cost_model is not None:
            self.cost_errors = []

    def take_cost_errors(self) -> list[tuple[float, float]]:
        errors, self.cost_errors = list(self.cost_errors or ()), [] if self.cost_errors is not None else None
        return errors

    def call(self, method: Any, args: Sequence[Any] = ()) -> Any:
        if callable(method):
            return method(self, *args)
        if method not in self.UTILITIES:
            raise ValueError(f"unknown engine core utility {method!r}: one of {', '.join(sorted(self.UTILITIES))}")
        return getattr(self, method)(*args)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """One step: schedule, dispatch, collect, update. Returns the outputs of the requests that
        got tokens or ended. With overlapped scheduling these are the tokens of the step dispatched
        by the previous call; this call's step runs on. Raises StepFailure (carrying the outputs
        built so far, the failed requests' with error set) when a step failed on the device."""
        t0 = time.perf_counter()
        outputs = self._start_step()
        prev = self._in_flight  # dispatched by the last call, its tokens unread
        try:
            # its tokens feed this step's token masks, or its rows' proposals (speculative decoding:
            # the overlap pauses where a row may be given some, scheduler.may_propose)
            if prev is not None and (prev.needs_tokens or (self.scheduler.proposer is not None
                                                           and self.scheduler.may_propose(prev.out))):
                self._overlap_pauses += not prev.needs_tokens
                outputs += self._apply(prev, [prev])
                prev = None
            alone = prev is None  # nothing in flight: the device starts on this step at once
            step = self._dispatch(self._schedule(), t0)
            if prev is not None:  # the device runs `step` while the host reads and applies `prev`
                outputs += self._apply(prev, [prev, step])
                prev = None
            if self.async_scheduling and step.S and self.scheduler.has_unfinished_requests():
                self._in_flight = step
            else:  # synchronous, or the last step of the work: its rows can only be wasted, read it now
                outputs += self._apply(step, [step], alone=alone)
        except DeviceFailure as e:
            raise self._step_failed(e, outputs, prev) from e.cause
        seconds = time.perf_counter() - t0
        self._step_seconds += seconds
        self._longest_step = max(self._longest_step, seconds)
        return outputs

    def _start_step(self) -> list[EngineCoreOutput]:
        """Between steps: the cost model fed, other hosts told (multi-host), and the requests past
        their deadlines ended (their final outputs)."""
        self.apply_cost_observations()
        expired = self.scheduler.expire(time.monotonic()) if self.scheduler.has_deadlines else []
        if expired and self.on_input is not None:  # the other hosts drop them too
            self.on_input(AbortRequests([r.request_id for r in expired]))
        if self.before_step is not None:
            self.before_step()
        return self._final_outputs(expired)

    def _schedule(self) -> SchedulerOutput:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        self._phase_seconds["schedule"] += time.perf_counter() - t0
        return out

    def _dispatch(self, out: SchedulerOutput, call_start: float) -> InFlight:
        """Hand step `out` to the device; its programs run on after this returns."""
        try:
            step = self.runner.dispatch(out)
        except Exception as e:
            raise DeviceFailure([out], e) from e
        self._phase_seconds["pack"] += step.pack_seconds
        self._phase_seconds["launch"] += step.launch_seconds
        step.call_start = call_start
        return step

    def _apply(self, step: InFlight, in_flight: list[InFlight], alone: bool = False) -> list[EngineCoreOutput]:
        """Read a dispatched step's tokens and apply them: its outputs. in_flight: every step
        dispatched and not yet applied, which a failure spoils too. alone: read right after its
        dispatch, with nothing before it in flight (its device time is timed)."""
        self._in_flight = None  # read now, or spoiled with the others if that fails
        try:
            res = self.runner.collect(step)
        except Exception as e:
            raise DeviceFailure([s.out for s in in_flight], e) from e
        self._device_seconds += res.device_seconds
        # (a step with block moves is left out: its copies were queued before the model's program)
        if alone and res.done and not step.first_run and not step.out.has_block_moves:
            self._busy_seconds += res.done - step.device_start
            self._busy_steps += 1
        if res.done:
            self._observe(step, res)
        t0 = time.perf_counter()
        failed = self.fail(res.rejected)  # before update: the tokens of their rows do not count
        prompt = self._prompt_logprobs(step.out, res) if res.prompt is not None else {}
        got = self.scheduler.update(step.out, res.sampled.sampled,
                                    None if res.drafts is None else res.drafts.tolist())
        t1 = time.perf_counter()
        outputs = failed + self._outputs(step.out, got, res, prompt)
        self._phase_seconds["update"] += t1 - t0
        self._phase_seconds["output"] += time.perf_counter() - t1
        return outputs

    def _step_failed(self, e: DeviceFailure, outputs: list[EngineCoreOutput], prev: InFlight | None) -> StepFailure:
        """The one place a device failure is handled. The outputs built before it go out; a step
        still unread whose tokens were computed before the failed call (a dispatch failed behind
        it) is applied; every request whose KV the failed steps may have spoiled is ended, the
        earlier step recovered first."""
        self._in_flight = None
        if prev is not None and not any(out is prev.out for out in e.outs):
            try:
                outputs += self._apply(prev, [prev])
            except DeviceFailure as also:
                e.outs[:0] = also.outs
        why = f"the step failed on the device: {type(e.cause).__name__}: {e.cause}"
        spoiled: dict[str, str] = {}
        for out in e.outs:
            spoiled.update(dict.fromkeys(self.scheduler.recover(out), why))
        return StepFailure(outputs + self.fail(spoiled), e.cause)

    def _prompt_logprobs(self, out: SchedulerOutput, res: StepResult) -> dict[str, tuple[int, LogprobArrays]]:
        """Request id -> (first prompt token, its entries) of the prompt tokens this step scored that
        its request still owed (a recompute after preemption scores them again: not sent twice)."""
        pl = res.prompt
        got: dict[str, tuple[int, LogprobArrays]] = {}
        at = 0  # the row's first token in T
        for row in out.scheduled.values():
            req, n = row.request, row.num_new_tokens
            k = req.sampling_params.prompt_logprobs
            if k is not None and not req.is_finished:
                # position p scores prompt token p + 1; the tokens owed start at prompt_logprobs_done
                lo = max(row.start + 1, req.prompt_logprobs_done)
                hi = min(row.start + n, req.num_prompt_tokens - 1) + 1
                if hi > lo:
                    j = slice(at + lo - 1 - row.start, at + hi - 1 - row.start)
                    got[req.request_id] = (lo, LogprobArrays(pl.logprob[j], pl.rank[j], pl.top_ids[j, :k],
                                                             pl.top_logprobs[j, :k]))
                    req.prompt_logprobs_done = hi
            at += n
        return got

    def _outputs(self, out: SchedulerOutput, got: list[int], res: StepResult,
                 prompt: dict[str, tuple[int, LogprobArrays]] | None = None) -> list[EngineCoreOutput]:
        """The outputs of the requests that got a token in step `out` (rows `got`). The step's start
        is each row's first scheduling time; a sample that failed ends its siblings."""
        rows = list(out.scheduled.values())
        for row in rows:
            if not row.request.first_scheduled_time:
                row.request.first_scheduled_time = res.started
        sampled = res.sampled
        outputs = []
        broken: dict[str, str] = {}
        Q = out.width
        for i in got:
            row = rows[i]
            req = row.request
            k = req.sampling_params.logprobs
            first = not req.first_token_time
            if first:
                req.first_token_time = time.monotonic()
            c = row.num_output  # 1, or with proposals verified the kept ones and one more
            o = EngineCoreOutput(req.request_id, req.output_token_ids[-c:])
            if k is not None:
                j = slice(i * Q, i * Q + c)  # a row's logits positions are Q apart in a wide step
                o.logprobs = LogprobArrays(sampled.logprob[j], sampled.rank[j], sampled.top_ids[j, :k],
                                           sampled.top_logprobs[j, :k])
            if first:
                o.first_scheduled_time = req.first_scheduled_time
            if prompt and req.request_id in prompt:
                o.prompt_logprobs_start, o.prompt_logprobs = prompt.pop(req.request_id)
            if req.is_finished:
                self._finished(req, o)
                if req.error is not None and req.group_id is not None:
                    broken[req.group_id] = req.error
            outputs.append(o)
        for rid, (start, arrays) in (prompt or {}).items():  # a prefill chunk that sampled no token
            outputs.append(EngineCoreOutput(rid, [], prompt_logprobs=arrays, prompt_logprobs_start=start))
        for gid, why in broken.items():  # a sample's grammar refused its token: the request fails whole
            outputs += self.fail({s: f"a sample of this request failed: {why}" for s in self._groups.get(gid, ())})
        return outputs

    def _finished(self, req: Request, o: EngineCoreOutput) -> None:
        reason = req.finish_reason
        o.finish_reason = reason.value if reason is not None else None
        o.stop_reason = req.stop_reason if isinstance(req.stop_reason, int) else None
        o.error, o.error_param = req.error, req.error_param
        o.num_preemptions = req.num_preemptions
        if req.group_id is not None and all(s not in self.scheduler.requests for s in self._groups.get(req.group_id, ())):
            self._groups.pop(req.group_id, None)

    def fail(self, reasons: dict[str, str]) -> list[EngineCoreOutput]:
        """End requests that failed (sample id -> why), with their sibling samples: FINISHED_ERROR,
        and their final outputs, with error set."""
        ended: dict[str, str] = {}
        for rid, why in reasons.items():
            if rid not in self.scheduler.requests:
                continue
            logger.error("request %r failed: %s", rid, why)
            for s in self._members(rid):
                if s in self.scheduler.requests and s not in ended:
                    ended[s] = why if s == rid else f"a sample of this request failed: {why}"
        if not ended:
            return []
        reqs = [self.scheduler.requests[s] for s in ended]
        for req in reqs:
            req.error, req.error_param = ended[req.request_id], None
        self.scheduler.finish_requests(list(ended), RequestStatus.FINISHED_ERROR)
        return self._final_outputs(reqs)

    def _final_outputs(self, reqs: list[Request]) -> list[EngineCoreOutput]:
        """The last outputs (no new token) of requests ended between steps."""
        outputs = []
        for req in reqs:
            o = EngineCoreOutput(req.request_id, [])
            self._finished(req, o)
            outputs.append(o)
        return outputs

    def fail_all(self, why: str) -> list[EngineCoreOutput]:
        """End every request in flight with an error (after a failure on the host, outside a step's
        device work, no request's state can be trusted)."""
        return self.fail(dict.fromkeys(list(self.scheduler.requests), why))

    def _observe(self, step: InFlight, res: StepResult) -> None:
        """Feed the cost model what the step cost the engine: from the start of the step() call
        that dispatched it, or the read of the step before it if that came later (with overlap, the
        steps' reads are one step's wall time apart: host or device, whichever bounds it), to the
        read of its results. A step that ran a model or sampler program for the first time (one-time
        costs) is not fed."""
        seconds = res.done - max(step.call_start, self._last_done)
        self._last_done = res.done
        out = step.out
        if step.first_run:
            return
        if self.cost_model is not None and self.measure_costs and not step.idle_after:
            self._costs.append((StepShape(out.token_bucket, out.seq_bucket, out.context, out.width), seconds))

    def apply_cost_observations(self) -> None:
        """Feed the step times measured since the last step to the cost model (and cost_feed)."""
        for shape, seconds in self._costs:
            if self.cost_errors is not None:
                self.cost_errors.append((self.cost_model.predict(shape), seconds))
            self.cost_model.observe(shape, seconds)
            if self.cost_feed is not None:
                self.cost_feed.append((shape.T, shape.S, shape.context, seconds))
        self._costs.clear()

    # -- the loop of a core that runs on its own (a thread or a process: core_client.py) -----------
    def handle(self, msg: CoreInput) -> EngineCoreOutputs | None:
        """Apply one input between steps; a reply for the client, when there is one. A request the
        core refuses (a duplicate id, a full queue) is answered with its error output."""
        if isinstance(msg, EngineCoreRequest):
            try:
                self.add_request(msg)
            except Exception as e:  # noqa: BLE001 - the front end checked it; a refusal ends it alone
                param = getattr(e, "param", None)
                return EngineCoreOutputs([EngineCoreOutput(msg.request_id, [], finish_reason="error",
                                                           error=str(e), error_param=param)],
                                         engine_index=self.engine_index)
            return None
        if isinstance(msg, AbortRequests):
            self.abort_requests(msg.request_ids)
            return None
        if isinstance(msg, UtilityRequest):
            try:
                result, error = self.call(msg.method, msg.args), None
            except Exception as e:  # noqa: BLE001 - handed to the caller
                result, error = None, f"{type(e).__name__}: {e}"
            return EngineCoreOutputs(utility=UtilityOutput(msg.call_id, result, error), engine_index=self.engine_index)
        raise TypeError(f"an engine core cannot handle a {type(msg).__name__}")

    def run_loop(self, receive: Callable[[bool], CoreInput | None], send: Callable[[EngineCoreOutputs], None]) -> None:
        """Step while there is work, applying inputs between steps, until a Shutdown comes.
        receive(block): the next input, or None when none is waiting and block is False. send: a
        step's outputs (with the core's stats), or a reply. A step that fails on the device has
        ended its requests (their outputs carry the error); a failure anywhere else on the host
        ends every request in flight with an error; the loop goes on either way."""
        applied = False  # inputs applied since the stats last went out
        while True:
            block = not self.scheduler.has_unfinished_requests()
            if block and applied:  # idle now: the front end sees the queues as they are (an abort's)
                send(EngineCoreOutputs(stats=self.stats(), engine_index=self.engine_index))
                applied = False
            while (msg := receive(block)) is not None:
                if isinstance(msg, Shutdown):
                    return
                reply = self.handle(msg)
                if reply is not None:
                    send(reply)
                block, applied = False, True
            if not self.scheduler.has_unfinished_requests():
                continue
            applied = False
            failed_all = step_failure = None
            try:
                outputs = self.step()
            except StepFailure as e:
                logger.error("a step failed on the device: %s", e, exc_info=e.cause)
                outputs, step_failure = e.outputs, str(e)
            except Exception as e:
                logger.exception("engine step failed on the host; failing every request in flight")
                failed_all = (f"an engine step failed ({type(e).__name__}: {e}); the request was aborted "
                              "(retry it)")
                try:
                    outputs = self.fail_all(failed_all)
                except Exception:
                    logger.exception("could not end the requests in flight")
                    outputs = []
            send(EngineCoreOutputs(outputs, self.stats(), engine_index=self.engine_index, step_failure=step_failure,
                                   failed_all=failed_all))


def reserve_count(args: EngineArgs, model_cfg: ModelConfig, devices: Sequence[Any] | None) -> int:
    """EngineArgs.cpu_reserved_cores as a count, "auto" decided (and logged) before jax starts; None
    is the library's default, 0."""
    n = args.cpu_reserved_cores
    if n != "auto":
        return n or 0
    from jax._src import xla_bridge

    started = xla_bridge.backends_are_initialized()
    if devices is not None:  # any sequence of devices (a list, a numpy array of them)
        platform = platform_of(next(iter(devices)).platform)
    else:
        platform = platform_of(jax.default_backend()) if started else expected()
    cpu = platform.host_runs_model
    own = devices is None and args.tensor_parallel_size == 1 and args.distributed_coordinator is None
    n, why = auto_reserved_cores(model_cfg, cpu=cpu, jax_started=started, own_devices=own,
                                 async_scheduling=args.async_scheduling is not False, reserved=reserved_now())
    logger.info("cpu_reserved_cores=auto: %d (%s)", n, why)
    return n

