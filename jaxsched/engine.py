"""LLMEngine, the step loop (LLM, offline generation on top of it, is in llm.py).

What runs each step (LLMEngine.step):
    out     = scheduler.schedule()              who runs, how many tokens each, which buckets, block moves
    step    = runner.dispatch(out)              block moves, then one jitted call: model + sampler
    res     = runner.collect(step)              wait for it, read the sampled tokens
    got     = scheduler.update(out, sampled)    append tokens, stop checks, free finished blocks
    outputs = output_processor.process(...)     detokenize, stop strings, logprobs, RequestOutputs

Overlapped scheduling (async_scheduling, vLLM's --async-scheduling): step() schedules and
dispatches step N+1 *before* it collects step N, so the host's work (scheduling, packing, reading,
detokenizing) runs while the device computes, and the device finds the next step queued when it
finishes one. Step N+1 is scheduled as if every running request got its token from step N; its
decode rows take those tokens on the device (runner.py), and the host reads them one step later.
A request that step N ends (EOS, a stop token or string) costs one wasted row in step N+1, whose
token update() drops; one that ends by length is not scheduled again. The outputs are the
synchronous engine's. Penalty tables are built on the host from the tokens read, and the sampler
folds a row's pending token in on the device (batch.pending_src), so penalties do not wait. A
grammar's next token mask needs the token its row samples (grammar.py, depends_on_tokens), so the
step after one with such a row waits for it (reads its tokens before scheduling); a fixed mask
(allowed_token_ids) does not. A step that swaps a request out waits too: the copy needs the pages
of the step in flight. The default (None) is on, except on a CPU where no core is reserved for the
host and the model keeps every core busy: there the host's work only delays the device's threads
(cpu_affinity.auto_async_scheduling).
Everything is decided once, up front: cpu_reserved_cores' and async_scheduling's defaults by
__init__ (they need the model, the platform and the process's cores), the rest by config.resolve();
__init__ then only builds the pieces.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import logging
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxsched import host_malloc
from jaxsched.config import EngineArgs, EngineConfig, ModelConfig, resolve, token_budget
from jaxsched.cpu_affinity import (
    auto_async_scheduling,
    auto_reserved_cores,
    reserve,
    reserved_now,
    size_xla_pools,
)
from jaxsched.detokenizer import byte_table
from jaxsched.errors import InvalidRequestError, StepFailedError
from jaxsched.output_processor import OutputProcessor
from jaxsched.outputs import RequestOutput
from jaxsched.penalties import check_penalty_capacity
from jaxsched.request import Request, RequestStatus, SamplingParams
from jaxsched.stats import HOST_PHASES, EngineStats
from jaxsched.step_cost import StepShape

if TYPE_CHECKING:
    from jaxsched.runner import InFlight, StepResult
    from jaxsched.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

# Engines that may have a step running on the device (overlapped scheduling leaves the last one
# unread when the work ends by abort, or when the caller stops stepping). jax's CPU client, torn down
# at interpreter exit while a computation still runs, deadlocks: the process hung for minutes after
# 43 steps of 2,048 tokens with 2,000 requests queued. So at exit each such step is waited for first.
_ENGINES: weakref.WeakSet = weakref.WeakSet()
_at_exit_registered = False


def _wait_for_steps_in_flight() -> None:
    import jax

    for eng in list(_ENGINES):
        step = eng._in_flight
        if step is not None and step.ints is not None:
            with contextlib.suppress(Exception):  # a failed step has nothing left to wait for
                jax.block_until_ready((step.ints, step.floats))


def _register(engine: LLMEngine) -> None:
    """Track `engine` for _wait_for_steps_in_flight. The exit hook is registered once, after jax
    was imported (here, at the first engine): atexit runs hooks last-registered first, so it runs
    before jax's own."""
    global _at_exit_registered
    _ENGINES.add(engine)
    if not _at_exit_registered:
        atexit.register(_wait_for_steps_in_flight)
        _at_exit_registered = True

PromptType = str | dict[str, Any]
PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, devices: Sequence[Any] | None = None, **kwargs: Any) -> None:
        """devices: the jax devices this engine runs on, tensor_parallel_size of them (a data-parallel
        replica's group); None: the first tensor_parallel_size devices (of every process, with
        several hosts)."""
        import jax

        from jaxsched.block_manager import BlockManager
        from jaxsched.buckets import bucket_pairs
        from jaxsched.models.loader import build_model, forget_gguf_readers, load_model_source
        from jaxsched.parallel import engine_devices, make_mesh
        from jaxsched.runner import (
            ModelRunner,
            device_memory,
            largest_temporary_bytes,
            temporary_bytes_bound,
            weights_bytes,
        )
        from jaxsched.scheduler import Scheduler
        from jaxsched.step_cost import StepCostModel
        from jaxsched.tokenizer import load_tokenizer

        args = args if args is not None else EngineArgs.from_kwargs(**kwargs)
        if args.model is None:
            from jaxsched.models.demo import demo_model_path

            path = str(demo_model_path())
        else:
            path = args.model
        t0 = time.perf_counter()
        model_cfg, getter, _kind = load_model_source(path)
        # before anything starts jax's backends, whose threads take their malloc arena when they first
        # allocate, and whose CPU pools are sized then (host_malloc.py, cpu_affinity.py)
        max_len = args.max_model_len or model_cfg.max_position_embeddings
        self.temporary_bound = temporary_bytes_bound(model_cfg, args.max_num_seqs, token_budget(args, max_len), max_len)
        host_malloc.allow_thread_arenas(self.temporary_bound)
        auto = args.cpu_reserved_cores == "auto"
        args = dataclasses.replace(args, cpu_reserved_cores=reserve_count(args, model_cfg, devices))
        size_xla_pools(args.cpu_reserved_cores)
        devices = engine_devices(args.tensor_parallel_size, devices)
        tp = len(devices)
        mesh = make_mesh(devices) if tp > 1 or devices[0] != jax.devices()[0] else None
        platform = devices[0].platform
        if auto and args.cpu_reserved_cores and platform != "cpu":  # jax found an accelerator after all
            logger.info("cpu_reserved_cores=auto: 0 after all (jax runs the model on %s, not the host's cores)", platform)
            args = dataclasses.replace(args, cpu_reserved_cores=0)
        if args.async_scheduling is None:
            on, why = auto_async_scheduling(model_cfg, cpu=platform == "cpu", reserved=args.cpu_reserved_cores or 0,
                                            multi_host=args.distributed_coordinator is not None)
            (logger.info if platform == "cpu" else logger.debug)("async_scheduling: %s (%s)", "on" if on else "off", why)
            args = dataclasses.replace(args, async_scheduling=on)
        # this process's devices of the engine (all of them on one host): memory is sized from them
        local = [d for d in devices if d.process_index == jax.process_index()]
        cfg = resolve(args, model_cfg, path, platform,
                      weights_bytes=lambda run_cfg, dtype: weights_bytes(run_cfg, dtype, tp),
                      memory=lambda: device_memory(local[0], len(local)))
        if jax.process_count() > 1:  # every host must allocate (and schedule for) the same pool
            from jaxsched.distributed import same_pool_on_every_host

            cfg = same_pool_on_every_host(cfg)
        self.config: EngineConfig = cfg
        self.tokenizer = load_tokenizer(cfg.tokenizer_path)
        model = build_model(model_cfg, cfg.dtype, getter, attention_backend=cfg.attention_backend, seed=cfg.seed,
                            layer_weights=cfg.layer_weights, mesh=mesh, heads=cfg.heads if tp > 1 else None)
        forget_gguf_readers()  # weights and tokenizer are loaded: the file's reader is not needed again
        logger.info("loaded %s (%s, %s) in %.1f s", path, model_cfg.architecture, cfg.dtype, time.perf_counter() - t0)
        if tp > 1:
            logger.info("tensor parallel over %d devices (%s): %s", tp, ", ".join(str(d) for d in devices),
                        cfg.heads.describe(model_cfg))
        self.devices = tuple(devices)
        self.block_manager = BlockManager(cfg.cache.num_blocks, cfg.cache.block_size,
                                          enable_prefix_caching=cfg.enable_prefix_caching)
        self.cost_model = StepCostModel(bucket_pairs(cfg.scheduler.token_buckets, cfg.scheduler.seq_buckets)) \
            if cfg.step_cost_model else None
        target = cfg.target_tpot_ms / 1e3 if cfg.target_tpot_ms is not None else None
        self.scheduler = Scheduler(cfg.scheduler, self.block_manager, policy=cfg.scheduling_policy,
                                   cost_model=self.cost_model, target_step_seconds=target)
        self.runner = ModelRunner(model, cfg, mesh)
        del model  # the runner holds the weights (packed, on a CPU): the module's copies may go
        # before warm-up, so that the cost model's seeds are timed as the steps will run; 0 undoes an
        # earlier engine's reserve in this process (and does nothing otherwise, or on a GPU)
        reserve(cfg.cpu_reserved_cores)
        self.runner.warm_up(run=cfg.warm_up_runs)
        if host_malloc.thread_arenas:
            largest = largest_temporary_bytes(self.runner.step_programs())
            if largest > host_malloc.THREAD_HEAP_BYTES // 2:  # the bound fell short: say so, and how to avoid it
                logger.warning("a program's temporary buffer is %.1f MiB, over the %.0f MiB a thread arena holds, "
                               "and threads allocate from arenas of their own (an engine of this process with "
                               "smaller programs chose them, or the bound fell short): its host memory is mapped "
                               "afresh at every run. Set JAXSCHED_HOST_MALLOC=keep to keep one arena",
                               largest / 2**20, host_malloc.THREAD_HEAP_BYTES // 2 / 2**20)
            logger.info("host malloc: threads allocate from arenas of their own (%d arenas; the largest program "
                        "temporary buffer %.1f MiB)", host_malloc.arena_count(), largest / 2**20)
        # the cost model's cold start: a full decode step of each decode-sized token bucket, timed
        self.cost_seeds: list[tuple[int, int, float]] = []
        if self.cost_model is not None:
            sc = cfg.scheduler
            self.cost_seeds = self.runner.time_pairs(
                [self.scheduler.bucket_pair(T, min(T, sc.max_num_seqs))
                 for T in sc.token_buckets if T <= max(sc.max_num_seqs, sc.token_buckets[0])])
            for T, S, seconds in self.cost_seeds:
                self.cost_model.seed(T, S, seconds)
        if cfg.cpu_reserved_cores:  # again: threads started during warm-up
            reserve(cfg.cpu_reserved_cores)
        # every step time fed to the cost model, when someone keeps them (a multi-host leader sends
        # them to the other hosts, whose models must stay identical: distributed.py)
        self.cost_feed: list[tuple[int, int, int, float]] | None = None
        self.measure_costs = True  # False: the model is fed from elsewhere (a multi-host follower)
        # step times measured, applied to the model at the start of the next step() (a fixed point:
        # a multi-host leader sends them before that step, so every host schedules with the same)
        self._costs: list[tuple[StepShape, float]] = []
        # when a list: (predicted, measured) seconds of every step timed, the prediction made before
        # the model saw that step (bench_offline.py reports the error distribution)
        self.cost_errors: list[tuple[float, float]] | None = None
        self._last_done = 0.0  # when the last step's results were read (step-time estimates)
        logger.info("KV pool: %d blocks of %d tokens, %s, attention backend %s, %.1f MiB per device on each of %d "
                    "(%d of %d KV heads each); swap pool: %d blocks", cfg.cache.num_blocks - 1, cfg.cache.block_size,
                    cfg.cache.dtype, cfg.attention_backend, self.kv_bytes_per_device() / 2**20, tp,
                    cfg.model.num_kv_heads // tp, cfg.model.num_kv_heads, cfg.scheduler.num_host_blocks)
        byte_table(self.tokenizer)  # built now (~0.1 s for a 50k vocabulary), not at the first request
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler.finish_requests, cfg.enable_prefix_caching)
        eos = set(model_cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = tuple(sorted(eos))
        from jaxsched.grammar import GrammarCompiler

        self.grammars = GrammarCompiler(self.tokenizer, model_cfg.vocab_size, self.eos_token_ids)
        self.runner.packer.grammar_executor = lambda: self.grammars.executor
        self._rng = np.random.default_rng(cfg.seed)
        self._next_id = 0
        self._step_seconds = 0.0  # stats(): wall time of the steps, and the device's part of it
        self._device_seconds = 0.0
        self._busy_seconds = 0.0  # stats().device_busy_seconds / _steps
        self._busy_steps = 0
        self._phase_seconds = dict.fromkeys(HOST_PHASES, 0.0)  # host work by phase
        self.async_scheduling = cfg.async_scheduling
        self._in_flight: InFlight | None = None  # the step dispatched last, whose tokens are not read yet
        _register(self)

    @property
    def model_config(self):
        """The checkpoint's architecture (head counts as in its config.json)."""
        return self.config.checkpoint_model

    def kv_bytes_per_device(self) -> int:
        """The KV pool's bytes on each of this engine's devices (every block, null page included)."""
        from jaxsched.sizing import kv_bytes_per_block

        c = self.config
        return c.cache.num_blocks * kv_bytes_per_block(c.model, c.cache.block_size, c.cache.dtype,
                                                       c.tensor_parallel_size)

    @property
    def cache_config(self):
        return self.config.cache

    @property
    def scheduler_config(self):
        return self.config.scheduler

    # -- requests ------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType | Sequence[int]) -> tuple[list[int], str | None]:
        """A prompt as token ids (+ its text). Raises ValueError on an empty or malformed prompt."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty: pass at least one character or token id", "prompt")
            return list(self.tokenizer.encode(prompt)), prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
            elif "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            else:
                raise InvalidRequestError("a dict prompt needs 'prompt' (text) or 'prompt_token_ids' (a list of ints)",
                                          "prompt")
        elif isinstance(prompt, (list, tuple)):
            ids, text = prompt, None
        else:
            raise InvalidRequestError(
                f"prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}", "prompt")
        V = self.model_config.vocab_size
        ids = list(ids)
        if not ids:
            raise InvalidRequestError("prompt_token_ids is empty: pass at least one token id", "prompt")
        for t in ids:
            if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < V:
                raise InvalidRequestError(f"prompt_token_ids must be integers in [0, {V}) (the vocab size), got {t!r}",
                                          "prompt")
        return [int(t) for t in ids], text

    def make_request(self, request_id: str, prompt: PromptType | Sequence[int],
                     params: SamplingParams | None = None, arrival_time: float | None = None,
                     priority: int = 0) -> Request:
        """Validate and build a Request without adding it (so a batch can be checked up front)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}", "sampling_params")
        if not isinstance(priority, int) or isinstance(priority, bool) or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            raise InvalidRequestError(f"priority must be a 64-bit integer (lower runs first), got {priority!r}",
                                      "priority")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise InvalidRequestError(
                f"logprobs must be <= max_logprobs ({self.config.max_logprobs}), got {params.logprobs}", "logprobs")
        V = self.model_config.vocab_size
        for name, what, ids in (("stop_token_ids", "stop_token_ids", params.stop_token_ids),
                                ("allowed_token_ids", "allowed_token_ids", params.allowed_token_ids),
                                ("logit_bias", "logit_bias keys", [t for t, _ in params.logit_bias or ()])):
            for t in ids or ():
                if t >= V:
                    raise InvalidRequestError(f"{what} must be token ids in [0, {V}) (the vocab size), got {t}", name)
        if params.top_k > V:  # keeps every token, as top_k = 0 does (vLLM clamps it to the vocab too)
            params = dataclasses.replace(params, top_k=0)
        ids, text = self.tokenize_prompt(prompt)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise InvalidRequestError("cache_salt must be a non-empty string", "cache_salt")
        check_penalty_capacity(params, ids, self.eos_token_ids, self.scheduler_config.max_model_len,
                               self.model_config.vocab_size, self.config.penalty_capacity)
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**31 - 1))
        req = Request(request_id=request_id, prompt_token_ids=ids, sampling_params=params,
                      arrival_time=time.monotonic() if arrival_time is None else arrival_time,
                      priority=priority, eos_token_ids=self.eos_token_ids, sample_seed=seed % (2**31 - 1),
                      prompt=text, constraint=self.constraint(params),
                      # prefix caching: requests share cached blocks only with requests of the same salt
                      cache_salt=int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little")
                      if salt else 0)
        self.scheduler.check_fits(req)
        return req

    def constraint(self, params: SamplingParams):
        """The TokenConstraint of a request's params (grammar.py), or None. A grammar is compiled
        here (cached) unless it was compiled ahead, as the server does (GrammarCompiler.compile)."""
        from jaxsched.grammar import AllowedTokens

        if params.allowed_token_ids is not None:
            return AllowedTokens(params.allowed_token_ids, self.model_config.vocab_size)
        if params.structured_outputs is None:
            return None
        banned = self.eos_token_ids if params.ignore_eos else ()
        return self.grammars.compile(params.structured_outputs).constraint(banned)

    def add_request(self, request_id: str, prompt: PromptType | Sequence[int],
                    params: SamplingParams | None = None, arrival_time: float | None = None,
                    priority: int = 0) -> None:
        self.add_request_obj(self.make_request(request_id, prompt, params, arrival_time, priority))

    def add_request_obj(self, req: Request) -> None:
        """Queue a request made by make_request. With n > 1 its samples become sibling requests
        that share the prompt's KV blocks (output_processor.py); all are queued or none is."""
        samples = self.outputs.add(req)  # refuses an id (or a sample's id) already in flight
        try:
            for sample in samples:
                self.scheduler.add_request(sample)
        except Exception:
            self.scheduler.finish_requests(self.outputs.forget(req.request_id), RequestStatus.FINISHED_ABORTED)
            raise

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """End requests (an n > 1 request, or any of its samples, ends all its samples)."""
        self.scheduler.finish_requests(self.outputs.forget(request_ids), RequestStatus.FINISHED_ABORTED)
        if self._in_flight is not None and not self.scheduler.has_unfinished_requests():
            self._in_flight.idle_after = True  # read at the next step, whenever that comes: not timed

    def has_unfinished_requests(self) -> bool:
        """Whether a request is still in flight. (A step still running on the device whose requests
        all ended does not count: the next step() reads it.)"""
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> EngineStats:
        """Queue lengths, KV usage, preemptions, prefix-cache and padding figures (vLLM's names),
        and the steps' wall and device-wait seconds."""
        return dataclasses.replace(self.scheduler.stats(), step_seconds=self._step_seconds,
                                   device_seconds=self._device_seconds, device_busy_seconds=self._busy_seconds,
                                   device_busy_steps=self._busy_steps,
                                   **{f"{k}_seconds": v for k, v in self._phase_seconds.items()})

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: the outputs of the requests that got tokens. With overlapped scheduling these
        are the tokens of the step dispatched by the previous call; this call's step runs on."""
        t0 = time.perf_counter()
        self.apply_cost_observations()
        outputs: list[RequestOutput] = []
        device = 0.0
        prev = self._in_flight
        if prev is not None and prev.needs_tokens:  # its tokens feed this step's token masks
            self._in_flight = None
            outputs, device = self._complete(prev, [prev])
            prev = None
        t1 = time.perf_counter()
        out = self.scheduler.schedule()
        self._phase_seconds["schedule"] += time.perf_counter() - t1
        alone = prev is None  # nothing in flight: the device starts on this step at once
        try:
            try:
                step = self.runner.dispatch(out)
                self._phase_seconds["pack"] += step.pack_seconds
                self._phase_seconds["launch"] += step.launch_seconds
            except Exception as e:  # on the device: end the requests whose KV it may have spoiled
                if prev is not None:  # its tokens were computed before the failed call: apply them
                    self._in_flight = None
                    try:
                        outputs, device = self._complete(prev, [prev])
                    except StepFailedError as failed_too:
                        failed_too.outputs += self._failed([out], e).outputs
                        raise
                raise self._failed([out], e) from e
            step.call_start = t0
            if prev is not None:  # the device runs `step` while the host reads and processes `prev`
                self._in_flight = None
                outputs, device = self._complete(prev, [prev, step])
            if self.async_scheduling and step.S and self.scheduler.has_unfinished_requests():
                self._in_flight = step
            else:  # synchronous, or the last step of the work: its rows can only be wasted, read it now
                more, d = self._complete(step, [step], alone=alone)
                outputs += more
                device += d
        except StepFailedError as e:  # outputs already built (a previous step's final ones) go out too
            e.outputs[:0] = outputs
            raise
        self._step_seconds += time.perf_counter() - t0
        self._device_seconds += device
        return outputs

    def _complete(self, step: InFlight, in_flight: list[InFlight],
                  alone: bool = False) -> tuple[list[RequestOutput], float]:
        """Read a dispatched step's tokens and apply them: (outputs, seconds waited on the device).
        in_flight: every step dispatched and not yet applied, which a failure spoils too. alone:
        read right after its dispatch, with nothing before it in flight (its device time is timed)."""
        try:
            res = self.runner.collect(step)
        except Exception as e:
            raise self._failed([s.out for s in in_flight], e) from e
        # (a step with block moves is left out: its copies were queued before the model's program)
        if alone and res.done and not step.first_run and not step.out.has_block_moves:
            self._busy_seconds += res.done - step.device_start
            self._busy_steps += 1
        if res.done:
            self._observe(step, res)
        t0 = time.perf_counter()
        failed = self.outputs.fail(res.rejected)  # before update: the tokens of their rows do not count
        got = self.scheduler.update(step.out, res.sampled.sampled)
        t1 = time.perf_counter()
        outputs = failed + self.outputs.process(step.out, got, res)
        self._phase_seconds["update"] += t1 - t0
        self._phase_seconds["output"] += time.perf_counter() - t1
        return outputs, res.device_seconds

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
            self._costs.append((StepShape(out.token_bucket, out.seq_bucket, out.context), seconds))

    def apply_cost_observations(self) -> None:
        """Feed the step times measured since the last step to the cost model (and cost_feed)."""
        for shape, seconds in self._costs:
            if self.cost_errors is not None:
                self.cost_errors.append((self.cost_model.predict(shape), seconds))
            self.cost_model.observe(shape, seconds)
            if self.cost_feed is not None:
                self.cost_feed.append((shape.T, shape.S, shape.context, seconds))
        self._costs.clear()

    def _failed(self, outs: list[SchedulerOutput], e: Exception) -> StepFailedError:
        """A step failed on the device: end every request whose KV it may have spoiled, and drop
        the steps in flight with it."""
        self._in_flight = None
        why = f"the step failed on the device: {type(e).__name__}: {e}"
        spoiled: dict[str, str] = {}
        for out in outs:
            spoiled.update(dict.fromkeys(self.scheduler.recover(out), why))
        return StepFailedError(self.outputs.fail(spoiled), e)

    def next_request_id(self) -> str:
        self._next_id += 1
        return str(self._next_id - 1)


def reserve_count(args: EngineArgs, model_cfg: ModelConfig, devices: Sequence[Any] | None) -> int:
    """EngineArgs.cpu_reserved_cores as a count, "auto" decided (and logged) before jax starts; None
    is the library's default, 0."""
    n = args.cpu_reserved_cores
    if n != "auto":
        return n or 0
    import jax
    from jax._src import xla_bridge

    started = xla_bridge.backends_are_initialized()
    if devices is not None:  # any sequence of devices (a list, a numpy array of them)
        cpu = next(iter(devices)).platform == "cpu"
    else:
        cpu = jax.default_backend() == "cpu" if started else host_malloc.cpu_backend_expected()
    own = devices is None and args.tensor_parallel_size == 1 and args.distributed_coordinator is None
    n, why = auto_reserved_cores(model_cfg, cpu=cpu, jax_started=started, own_devices=own,
                                 async_scheduling=args.async_scheduling is not False, reserved=reserved_now())
    logger.info("cpu_reserved_cores=auto: %d (%s)", n, why)
    return n


def create_engine(args: EngineArgs) -> Any:
    """The engine `args` ask for, behind LLMEngine's interface (what LLM, AsyncEngine and the CLI
    build): one LLMEngine; data_parallel_size replicas dealt requests by load (data_parallel.py); or,
    with distributed_coordinator, this process's part of an engine spread over several hosts
    (distributed.py)."""
    if args.distributed_coordinator is not None:
        from jaxsched.distributed import DistributedEngine

        return DistributedEngine(args)
    if args.data_parallel_size > 1:
        from jaxsched.data_parallel import DataParallelEngine

        return DataParallelEngine(args)
    return LLMEngine(args)
