"""ModelRunner: the weights and the KV pool on the device, one compiled model program per (T, S)
bucket and the sampler's program(s) per S, and dispatch(scheduler output) / collect(step) -> sampled
tokens.

A step is a SchedulerOutput: its block moves (swap out, copy-on-write, swap in), then the batch
packed into fixed-shape arrays and two calls dispatched back to back: the model's program, whose
logits stay on the device, then the sampler's. The sampler does not depend on T, so it is compiled
once per S rather than into every pair's program: it was about half of each pair's compile time
(docs/PERFORMANCE.md, "Decisions in the code"). Where XLA turns a lax.cond into a wait for the device
(a GPU), the sampler is a few programs without conds and the host picks one per step; on a CPU the
host picks between the argmax alone and the program with conds (the platform record's sampler_branches). All
compilation happens in warm_up(), ahead of time;
a step only looks its executables up, so it can never compile. The KV pool is donated to every
call and updated in place.
Per step: two host-to-device copies (the batch's flat buffers) and two device-to-host copies
(sampled ids + logprobs, packed). With speculative decoding every (T, S) pair also has a program
of width Q (each row's logits at Q positions: its proposals verified, core/speculation.py), and
the sampler one of S Q rows; a step with proposals runs those. A draft model (speculative_config
method "draft_model") runs inside every model program, on the same batch, into its own KV pool under
the same block tables; in a program of width Q it then proposes each row's tokens itself (_draft).

dispatch() starts a step and returns at once; collect() waits for it and reads its tokens. Each
step also leaves its sampled ids on the device (prev_ids), where the next step's decode rows take
their input token from: that is what lets the engine schedule step N+1 before reading step N's
tokens (overlapped scheduling, engine.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsched import platforms
from jaxsched.config import EngineConfig, ModelConfig
from jaxsched.core.buckets import bucket_pairs
from jaxsched.core.kv_groups import kv_groups
from jaxsched.core.limits import MAX_LOGIT_BIAS
from jaxsched.core.scheduler import SchedulerOutput, prompt_logprobs_buckets
from jaxsched.envs import cache_dir
from jaxsched.models.layers import pack_linear_weights, untie_lm_head
from jaxsched.parallel.mesh import place
from jaxsched.runner.batch import SAMPLER_I32, BatchDescriptor, BatchPacker, SamplerRows, flat_sizes
from jaxsched.runner.block_table import OVERFLOW_CHUNK, apply_writes, group_tables, step_block_tables
from jaxsched.runner.sampler import SamplerOutput, sample
from jaxsched.runner.sampler import needs as sampler_needs
from jaxsched.structured.grammar import mask_words
from pallas_kernels import backends, tuning

logger = logging.getLogger(__name__)

SWAP_CHUNKS = (8, 32, 128)  # blocks per swap copy call


@dataclass
class StepResult:
    """What executing one SchedulerOutput gives back."""

    sampled: SamplerOutput  # S rows (none for a step with no rows)
    started: float  # time.monotonic() when the step began
    rejected: dict[str, str] = field(default_factory=dict)  # request id -> why its row could not be stored
    # seconds the host waited on the device: from collect() until the results were read, and the
    # block moves (a swap-out copy waits for the step in flight, as its pages must be final)
    device_seconds: float = 0.0
    done: float = 0.0  # time.perf_counter() when its results were read (0: no rows)
    prompt: PromptLogprobs | None = None  # a prompt logprobs step's, every token of T
    drafts: np.ndarray | None = None  # i32[S, Q - 1] a draft model's proposals, in a step verifying them


@dataclass
class InFlight:
    """A step dispatched to the device whose results the host has not read yet (ModelRunner.dispatch;
    collect() reads them). With overlapped scheduling the next step is scheduled meanwhile."""

    out: SchedulerOutput
    started: float  # time.monotonic() when the step began
    S: int = 0  # its sequence bucket; 0: no rows (block moves only, or nothing)
    ints: object = None  # the step's device outputs (SamplerOutput packed), read by collect()
    floats: object = None
    prompt: object = None  # a prompt logprobs step's (ints, floats) of every token (_prompt_logprobs)
    drafts: object = None  # a draft model's proposals i32[S, Q - 1], in a step verifying them
    rejected: dict[str, str] = field(default_factory=dict)
    device_seconds: float = 0.0  # block moves waited for at dispatch
    pack_seconds: float = 0.0  # host time packing its batch
    launch_seconds: float = 0.0  # host time dispatching its programs (they run on after it)
    device_start: float = 0.0  # time.perf_counter() when its model program's call returned (the device had it)
    call_start: float = 0.0  # time.perf_counter() when the engine's step() that dispatched it began
    # a constrained row's next token mask is built on the host from this step's token: the next
    # step must wait for it (Engine.step)
    needs_tokens: bool = False
    idle_after: bool = False  # the engine had no requests left after dispatching it (an abort)
    first_run: bool = False  # its model or sampler program ran for the first time (one-time costs)


@dataclass
class PromptLogprobs:
    """Host copy of a prompt logprobs step's figures, per token of T (batch.prompt_targets says
    which token each scores)."""

    logprob: np.ndarray  # f32[T] of the target token
    rank: np.ndarray  # i32[T]
    top_ids: np.ndarray  # i32[T, k], k = max_logprobs
    top_logprobs: np.ndarray  # f32[T, k]

    @classmethod
    def unpack(cls, ints: np.ndarray, floats: np.ndarray, k: int) -> PromptLogprobs:
        T = ints.size // (1 + k)
        return cls(floats[:T], ints[:T], ints[T:].reshape(T, k), floats[T:].reshape(T, k))


def _chunked(pairs: list[tuple[int, int]]):
    """Split block pairs into chunks of the compiled sizes: (pairs, padded size) each."""
    i = 0
    while i < len(pairs):
        rest = len(pairs) - i
        C = next((c for c in SWAP_CHUNKS if c >= rest), SWAP_CHUNKS[-1])
        yield pairs[i : i + C], C
        i += C


def _with_blocks(pool_shape: tuple[int, ...], n: int) -> tuple[int, ...]:
    """A pool's shape [L, NB, ...] (either page layout) with n blocks instead of NB."""
    return (pool_shape[0], n, *pool_shape[2:])


def device_memory(dev=None, sharing: int = 1) -> tuple[int, int]:
    """(total, free) bytes of `dev` (default: the first device). On a CPU, host memory divided among
    the `sharing` simulated devices that hold one engine's shards (they all live in it)."""
    dev = dev or jax.devices()[0]
    stats = dev.memory_stats() if platforms.of(dev.platform).memory_stats else None
    if stats and "bytes_limit" in stats:
        total = int(stats["bytes_limit"])
        return total, total - int(stats.get("bytes_in_use", 0))
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    free = total
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except OSError:
        pass
    return total // sharing, free // sharing


def weights_bytes(model_config: ModelConfig, dtype: str, shards: int = 1, quantization: str | None = None,
                  quantize_embedding: bool = False) -> int:
    """The model's weights in `dtype` on one of `shards` devices (the split weights' 1 / shards,
    the replicated ones whole), from its shapes alone (nothing is allocated); with `quantization`,
    the weights quantize_model quantizes at a byte each plus a float32 scale per output channel, or
    a float16 scale and minimum per GROUP inputs (a GGUF file's blocks: quantize.grouped)."""
    from jaxsched.models.loader import build_model
    from jaxsched.models.quantize import GROUP, QUANTIZED_LAYER_WEIGHTS, grouped
    from jaxsched.parallel.mesh import param_spec

    abstract = nnx.eval_shape(lambda: build_model(model_config, dtype, None))
    quantized = (*QUANTIZED_LAYER_WEIGHTS, *(("embed", "lm_head") if quantize_embedding else ())) \
        if quantization else ()
    total = 0
    for path, x in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(abstract))):
        name = str(path[-1].key)
        split = "model" in param_spec(name, x.ndim, model_config.vocab_size % shards == 0)
        # the axis a weight's scales are per group of or per channel across
        along = x.shape[-1 if name == "embed" else -2] if name in quantized else 0
        if name in quantized and along % GROUP == 0 and grouped(quantization, model_config):
            n = x.size + 2 * 2 * x.size // GROUP
        elif name in quantized:  # int8 / fp8 values, and a scale per output channel (per row for embed)
            n = x.size + 4 * (x.size // along)
        else:
            n = x.size * x.dtype.itemsize
        total += n // (shards if split else 1)
    return total


def temporary_bytes_bound(model_config: ModelConfig, max_num_seqs: int, max_num_batched_tokens: int,
                          max_model_len: int) -> int:
    """An upper bound of the temporary buffer (all intermediates, one host block per run on a CPU)
    of the largest program an engine of these sizes compiles, from shapes alone, before jax starts
    (host_malloc.allow_thread_arenas). The sampled sampler holds five [S, V] float32 arrays (six
    counted here); a model program ~(2F + 4D) floats per token (6D counted) and its [S, V] logits;
    XLA's attention, where it runs (the numba kernels keep theirs out of the buffer, counted anyway:
    "auto" is not resolved yet), four [T, N, max_model_len] arrays of scores and a [S, max_model_len,
    K, H] chunk of each pool at most. Checked against compiled programs' own figures in
    tests/test_host_malloc.py."""
    S, T, V = max_num_seqs, max_num_batched_tokens, model_config.vocab_size
    sampler = 6 * S * V
    attention = 4 * T * model_config.num_heads * max_model_len \
        + 2 * S * max_model_len * model_config.num_kv_heads * model_config.head_dim
    model = T * (2 * model_config.intermediate_size + 6 * model_config.hidden_size) + 2 * S * V + attention
    return 4 * max(sampler, model)


def largest_temporary_bytes(executables) -> int:
    """The largest temporary buffer of these compiled programs, as XLA reports it (0 where it does not)."""
    largest = 0
    for exe in executables:
        analysis = exe.memory_analysis()
        largest = max(largest, getattr(analysis, "temp_size_in_bytes", 0) if analysis is not None else 0)
    return largest


# Programs that compile faster than this are not written to the persistent cache. jax's default
# (1 s) left out the model's programs of small buckets; the block-copy programs compile about as
# fast as they would load (docs/PERFORMANCE.md, "Decisions in the code").
CACHE_MIN_COMPILE_SECONDS = 0.2


def enable_compilation_cache() -> None:
    """Turn on jax's persistent compilation cache (in the jaxsched cache folder) unless the user
    chose a folder already, so a second start of the same model and buckets skips compilation."""
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_SECONDS)


class ModelRunner:
    def __init__(self, model: nnx.Module, config: EngineConfig, mesh=None, draft: nnx.Module | None = None) -> None:
        """mesh: the engine's ("data", "model") mesh (parallel.make_mesh), which the model's weights
        were placed on; None: one default device. draft: speculative_config's draft model
        (config.draft_model its config), placed like the model."""
        self.config = config
        self.mesh = mesh
        self._replicated = None if mesh is None else NamedSharding(mesh, P())
        # the pool is split on its KV-head axis (axis 2 in both page layouts)
        self._pool_sharding = None if mesh is None else NamedSharding(mesh, P(None, None, "model"))
        # a multi-process mesh takes global arrays only: host data is placed shard by shard (parallel.place)
        self._multiprocess = jax.process_count() > 1
        self.platform = platforms.of((jax.devices()[0] if mesh is None else mesh.devices.flat[0]).platform)
        self.model_config = cfg = config.model
        self.cache_config = cache = config.cache
        self.scheduler_config = sched = config.scheduler
        self.max_logprobs = config.max_logprobs
        n_devices = 1 if mesh is None else mesh.devices.size
        self.packed_matmuls = self.platform.packed_matmuls(config.attention_backend, n_devices)
        # a tied lm_head becomes the table's packed home (layers.untie_lm_head, vocab_logits, token_rows)
        # a draft model: its weights follow the model's in every program's weights argument
        self.draft_graphdef, self._draft_leaves, self._draft_def = None, (), None
        if draft is not None:
            self.draft_graphdef, draft_state = self._split(draft)
            leaves, self._draft_def = jax.tree_util.tree_flatten(draft_state)
            self._draft_leaves = tuple(leaves)
        self.graphdef, self.state = self._split(model)
        self.max_blocks_per_seq = M = cache.max_blocks_per_seq
        # the layer groups sliding windows free pages in (core/kv_groups.py); one group without them
        self.kv_groups = groups = kv_groups(cfg)
        self.packer = BatchPacker(sched.max_num_batched_tokens, sched.max_num_seqs, M, cache.block_size,
                                  config.penalty_capacity, cfg.vocab_size, groups=groups)
        backend = backends.get(config.attention_backend)
        # [Lg, NB, K, P, H] each (Lg = L without layer groups), K pages transposed for the CPU
        # backends; a bfloat16 pool is uint16 bits for them (pool_storage.py)
        self._pool_shapes = backend.pool_shapes(groups.size, cache.num_blocks, cfg.num_kv_heads,
                                                cache.block_size, cfg.head_dim)
        if draft is not None:  # the draft's own two, the same blocks (the same block tables) of its layers
            d = config.draft_model
            self._pool_shapes = (*self._pool_shapes, *backend.pool_shapes(d.num_layers, cache.num_blocks,
                                                                          d.num_kv_heads, cache.block_size, d.head_dim))
        dt = backend.pool_dtype(cache.dtype)
        self.kv = self._new_pool(dt)
        self.block_table = self._new_block_table()  # i32[R + 1, M], updated by every model program
        self._table_writer = None  # the overflow writes' program (block_table.py), compiled at warm-up
        self._executables: dict[tuple[int, int], object] = {}  # (T, S) -> the model's program
        # speculative decoding: Q, the logits positions per row of a step that verifies proposals,
        # and (T, S) -> the model's program of that width (its sampler's rows are S * Q)
        spec = sched.speculative
        self.width = spec.width if spec is not None else 1
        self._wide: dict[tuple[int, int], object] = {}
        # prompt logprobs: S -> the model's program that also takes logprobs at every token, of the
        # one (T, S) such steps have (scheduler.prompt_logprobs_buckets)
        self.prompt_logprobs_buckets = prompt_logprobs_buckets(sched)
        self._prompt: dict[int, object] = {}
        self._extra_out = None  # the last model program's outputs past the first four (launch()): prompt logprobs, or proposals
        # S -> the sampler's programs, one per variant, cheapest first: a feature set (a program
        # without lax.cond, sampler.py), or None for the program with conds (tuning.SAMPLER_PROGRAMS)
        self.sampler_variants: tuple[frozenset[str] | None, ...] = tuning.SAMPLER_PROGRAMS[config.sampler_branches]
        self._samplers: dict[int, tuple] = {}
        self._use_compiler_options = True  # off once jaxlib rejects them (_compiled())
        self.warmup_seconds = 0.0
        self.ran: set[tuple[int, int]] = set()  # bucket pairs whose program has run (first runs are slow)
        self.model_dispatched = 0.0  # time.perf_counter() when the last model program's call returned
        self.sampler_ran: set[tuple[int, int]] = set()  # (S, variant index) of the sampler programs run
        # The swap pool: host memory laid out like the device pool, NBh blocks instead of NB.
        nh = sched.num_host_blocks
        self.host_kv = tuple(np.zeros(_with_blocks(x.shape, nh), dt) for x in self.kv) if nh else None
        self._swap_out_exe: dict[int, object] = {}
        self._swap_in_exe: dict[int, object] = {}
        self._copy_exe: dict[int, object] = {}
        self.penalty_capacity = config.penalty_capacity  # W of the penalty tables
        # per S: the penalty and constraint tables of a step where no row uses them, kept on the device
        self._idle_tables: dict[int, tuple] = {}

    def _split(self, model: nnx.Module):
        """(graphdef, state) of a model as the programs take it: a tied lm_head becomes the table's
        packed home (layers.untie_lm_head, vocab_logits, token_rows) and the layers' matmuls run in
        numba_matmul's kernel (layers.linear) where the platform packs them."""
        if self.packed_matmuls:
            untie_lm_head(model)
        graphdef, state = nnx.split(model)
        return graphdef, pack_linear_weights(state) if self.packed_matmuls else state


    @property
    def state(self):
        """The model's weights (an nnx State, as nnx.split gives it)."""
        return jax.tree_util.tree_unflatten(self._state_def, self._state_leaves)

    @state.setter
    def state(self, state) -> None:
        # The programs take the weights as a flat tuple of arrays: a compiled call flattens its
        # arguments at every dispatch, and an nnx State's Variables flatten in Python, a tuple in C++
        # (docs/PERFORMANCE.md, "Decisions in the code")
        leaves, self._state_def = jax.tree_util.tree_flatten(state)
        self._state_leaves = tuple(leaves)
        # every program's first argument: the model's weights' leaves, then the draft's (built once,
        # not at every dispatch)
        self.weights = self._state_leaves + self._draft_leaves

    def _new_pool(self, dt):
        def zeros():
            return tuple(jnp.zeros(shape, dt) for shape in self._pool_shapes)

        if self.mesh is None:
            return zeros()
        # allocated by a jit with out_shardings: each device allocates only its own shard
        return jax.jit(zeros, out_shardings=(self._pool_sharding,) * len(self._pool_shapes))()

    def _input(self, shape: tuple[int, ...], dtype, sharding=None) -> jax.ShapeDtypeStruct:
        """The abstract input of a compiled call: replicated on the mesh unless `sharding` says."""
        if self.mesh is None:
            return jax.ShapeDtypeStruct(shape, dtype)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding or self._replicated)

    def _put(self, x: np.ndarray, sharding=None):
        """Host data for a compiled call. On one process the call places numpy input itself; on
        several, every input must be a global array (each process supplies its local shards)."""
        if not self._multiprocess:
            return x
        return place(x, sharding or self._replicated)

    def _fetch(self, *xs) -> list[np.ndarray]:
        """Replicated (or single-device) results in host memory, in one transfer; with several
        processes each one reads its own replica."""
        if not self._multiprocess:
            # jax.device_get's way (every copy started before the first is waited for) without its
            # tree walk and profiler wrapper, which cost more than the copies (docs/PERFORMANCE.md,
            # "Decisions in the code")
            for x in xs:
                x.copy_to_host_async()
            return [np.asarray(x) for x in xs]
        return [np.asarray(x.addressable_data(0)) for x in xs]

    def _table_shapes(self, S: int) -> list[tuple[tuple[int, int], object]]:
        """(shape, dtype) of the step's tables besides the flat buffers, in the order _step takes
        them: penalty ids and counts, token mask, logit_bias ids and values."""
        W, V = self.penalty_capacity, self.model_config.vocab_size
        return [((S, W), np.int32), ((S, W), np.float32), ((S, mask_words(V)), np.int32),
                ((S, MAX_LOGIT_BIAS), np.int32), ((S, MAX_LOGIT_BIAS), np.float32)]

    def _forward(self, weights, kv, table, prev_ids, flat_i32, *, T: int, S: int, Q: int = 1, P: bool = False):
        """The model's part of a step. weights: the state's leaves (the `state` setter). table: the
        device block table (block_table.py), which the step's writes update. prev_ids:
        i32[Smax], the tokens the last step sampled per row (padded to max_num_seqs): decode rows
        scheduled before the host read them take them from here (batch.from_prev), and so do
        penalised rows' tables (batch.pending_src). Returns the pool, the logits f32[S, V] and the
        sampler's int32 row fields (batch.SAMPLER_I32, i32[7 S]), and the table. Q > 1 (speculative
        decoding): each row's logits at Q positions, its last num_spec + 1 tokens (then its last
        again): logits f32[S Q, V] and the row fields repeated for them, i32[7 S Q], each position
        sampling as the output index it would have (sample_index + j), so that a verified token is
        the one the step without proposals would have drawn. P (prompt logprobs): also, at every
        token, the logprob and rank of batch.prompt_targets' token and the max_logprobs most likely
        (_prompt_logprobs): two more outputs."""
        n = len(self._state_leaves)
        model = nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self._state_def, weights[:n]))
        # the model reads no float32 field (they are all the sampler's): a stand-in of zeros, unused
        _, n_f32 = flat_sizes(T, S)
        batch = BatchDescriptor.from_flat(flat_i32, jnp.zeros(n_f32, jnp.float32), T, S)
        table, batch.block_tables = step_block_tables(table, batch)  # once a step, for every layer
        if self.kv_groups.num_groups > 1:  # each group's tables [G, S, M] and slot mapping [G, T]
            batch.block_tables, batch.slot_mapping = group_tables(batch.block_tables, batch, self.kv_groups.num_groups,
                                                                  self.cache_config.block_size)
        src = batch.from_prev
        batch.token_ids = jnp.where(src > 0, prev_ids[jnp.maximum(src - 1, 0)], batch.token_ids)
        src = batch.pending_src
        batch.pending_token = jnp.where(src > 0, prev_ids[jnp.maximum(src - 1, 0)], -1)
        drafts = ()
        if self.draft_graphdef is not None:
            draft = nnx.merge(self.draft_graphdef, jax.tree_util.tree_unflatten(self._draft_def, weights[n:]))
            kv, dkv = kv[:2], kv[2:]
            dkv, drafts = self._draft(draft, dkv, batch, T=T, S=S, Q=Q)
        if Q > 1:
            last = batch.logits_indices[:, None]
            batch.logits_indices = jnp.minimum(last - batch.num_spec[:, None] + jnp.arange(Q), last).reshape(-1)
        extra = ()
        if P:  # the rows' last hidden states, then every token's, whose logits are taken in chunks
            batch.logits_indices = jnp.concatenate([batch.logits_indices, jnp.arange(T, dtype=jnp.int32)])
            with self._row_limits(batch, T, S):
                h, kv = model(kv, batch, hidden=True)
            logits = model.head(h[:S])
            extra = self._prompt_logprobs(model, h[S:], batch.prompt_targets)
        else:
            with self._row_limits(batch, T, S, Q):
                logits, kv = model(kv, batch)  # replicated: gathered over the vocabulary (layers.vocab_logits)
        if self.draft_graphdef is not None:
            kv, extra = (*kv, *dkv), (*extra, *drafts)
        fields = [getattr(batch, name) for name in SAMPLER_I32]
        if Q > 1:
            fields = [jnp.repeat(x, Q) for x in fields]
            j = SAMPLER_I32.index("sample_index")
            fields[j] = fields[j] + jnp.tile(jnp.arange(Q, dtype=jnp.int32), S)
        return (kv, logits, jnp.concatenate(fields), table, *extra)

    def _draft(self, draft, dkv, batch, *, T: int, S: int, Q: int):
        """The draft model's part of a step, before the model's: it runs on the step's batch (its KV
        follows the model's token for token, under the same block tables); in a step of width Q
        (verifying proposals) each row's last token before its num_spec proposals gives the first
        proposal, and Q - 1 decode passes over the S rows (a scan) each take the one before and
        give the next, writing its K/V at its position (the step's lookahead slots; the last
        pass only writes). The proposals are greedy (a point mass: the step's verification rule,
        scheduler.kept_proposals, is exact for them) and are written into batch.token_ids in
        place of the packer's placeholders. Returns (the draft's pool, (i32[S, Q - 1],)), or its
        pool and () in a step without proposals."""
        first = batch.logits_indices - batch.num_spec if Q > 1 else batch.logits_indices
        with self._row_limits(batch, T, S):
            out, dkv = draft(dkv, dataclasses.replace(batch, logits_indices=first), hidden=Q == 1)
        if Q == 1:
            return dkv, ()
        P = self.cache_config.block_size
        rows = jnp.arange(S, dtype=jnp.int32)
        real = rows < batch.num_seqs[0]
        base = batch.positions[first]  # each row's last token before its proposals
        # padding rows (past num_seqs) have no token, as in any batch; a row with fewer proposals
        # than a pass's writes the null page's slot 0 and reads one token
        qsl = jnp.minimum(jnp.arange(S + 1, dtype=jnp.int32), batch.num_seqs[0])

        def one(carry, j):
            dkv, tok = carry
            active = real & (j <= batch.num_spec)
            pos = jnp.where(active, base + j, 0)
            block = jnp.take_along_axis(batch.block_tables, (pos // P)[:, None], axis=1)[:, 0]
            step = dataclasses.replace(batch, token_ids=jnp.where(real, tok, 0), positions=pos,
                                       slot_mapping=jnp.where(active, block * P + pos % P, 0), query_start_loc=qsl,
                                       seq_lens=jnp.where(active, pos + 1, real.astype(jnp.int32)),
                                       logits_indices=rows)
            with self._row_limits(step, S, S):
                logits, dkv = draft(dkv, step)
            return (dkv, jnp.argmax(logits, axis=-1).astype(jnp.int32)), tok

        e1 = jnp.argmax(out, axis=-1).astype(jnp.int32)
        (dkv, _), toks = jax.lax.scan(one, (dkv, e1), jnp.arange(1, Q, dtype=jnp.int32))
        drafts = toks.T  # [S, Q - 1]
        j = jnp.arange(1, Q, dtype=jnp.int32)[None, :]
        at = jnp.where(j <= batch.num_spec[:, None], first[:, None] + j, T)  # T: out of range, dropped
        batch.token_ids = batch.token_ids.at[at].set(drafts, mode="drop")
        return dkv, (drafts,)

    def _prompt_logprobs(self, model, h, targets):
        """Per token of h [T, D]: the logprob of its target (the prompt's next token; -1: none, any
        value), its rank, and the max_logprobs most likely tokens with their logprobs, as
        (ints i32[T + T k]: ranks then ids, floats f32[T + T k]: logprobs then the top ones). The
        logits are taken a chunk of rows at a time (lax.map), so no [T, V] array is ever held."""
        T, D = h.shape
        C = next(c for c in (64, 32, 16, 8, 4, 2, 1) if T % c == 0)
        k = self.max_logprobs

        def chunk(args):
            hc, tc = args
            lg = model.head(hc).astype(jnp.float32)  # [C, V]
            lp = jax.nn.log_softmax(lg, axis=-1)
            t = jnp.maximum(tc, 0)[:, None]
            mine = jnp.take_along_axis(lp, t, axis=-1)[:, 0]
            rank = (jnp.sum(lg > jnp.take_along_axis(lg, t, axis=-1), axis=-1) + 1).astype(jnp.int32)
            if k:
                top_lp, top_ids = jax.lax.top_k(lp, k)
            else:
                top_lp, top_ids = jnp.zeros((C, 0), jnp.float32), jnp.zeros((C, 0), jnp.int32)
            return mine, rank, top_ids.astype(jnp.int32), top_lp

        mine, rank, ids, top = jax.lax.map(chunk, (h.reshape(T // C, C, D), targets.reshape(T // C, C)))
        return (jnp.concatenate([rank.reshape(-1), ids.reshape(-1)]),
                jnp.concatenate([mine.reshape(-1), top.reshape(-1)]))

    def _row_limits(self, batch, T: int, S: int, Q: int = 1):
        """With packed matmuls: the step's real tokens and sequences, so that the kernels skip its
        padding rows (numba_matmul.row_limits; padding comes last in both). T == S: the tokens'
        count, at least the sequences'. Q > 1: the S Q logits rows, Q per real sequence."""
        if not self.packed_matmuls:
            return contextlib.nullcontext()
        from pallas_kernels import numba_matmul

        limits = {S: batch.num_seqs[0], T: batch.query_start_loc[-1]}
        if Q > 1:
            rows = batch.num_seqs[0] * Q
            limits[S * Q] = jnp.maximum(limits[S * Q], rows) if S * Q in limits else rows
        return numba_matmul.row_limits(limits)

    def _sample(self, logits, rows_i32, flat_f32, tables, *, S: int, features: frozenset[str] | None):
        """The sampler's part of a step, a program of its own per S and variant (the model's is per
        (T, S)): tables: _table_shapes's arrays. Returns the packed sampler output, and this step's
        prev_ids (i32[Smax]) for the next."""
        rows = SamplerRows.from_flat(rows_i32, flat_f32, S, *tables)
        ints, floats = sample(logits, rows, self.max_logprobs, features)
        # SamplerOutput: the sampled ids come first (a wide step's S Q rows may outnumber
        # max_num_seqs; nothing reads its ids on the device: speculation runs steps in turns)
        n = min(S, self.scheduler_config.max_num_seqs)
        next_ids = jnp.zeros(self.scheduler_config.max_num_seqs, jnp.int32).at[:n].set(ints[:n])
        return ints, floats, next_ids

    def compile(self, T: int, S: int, Q: int = 1, P: bool = False):
        """The model's program for bucket pair (T, S), taking each row's logits at Q positions (and
        with P every token's prompt logprobs)."""
        n_i32, _ = flat_sizes(T, S)
        # with a mesh: the pool stays split on its heads, the logits, rows and block table replicated
        extra = (2 if P else 0) + (1 if Q > 1 and self.draft_graphdef is not None else 0)
        out = {} if self.mesh is None else {"out_shardings": ((self._pool_sharding,) * len(self.kv), self._replicated,
                                                              self._replicated, self._replicated,
                                                              *((self._replicated,) * extra))}
        fn = jax.jit(self._forward, static_argnames=("T", "S", "Q", "P"), donate_argnums=(1, 2), **out)
        return self._compiled(fn.lower(self.weights, self.kv, self.block_table,
                                       self._input((self.scheduler_config.max_num_seqs,), jnp.int32),
                                       self._input((n_i32,), jnp.int32), T=T, S=S, Q=Q, P=P))

    def compile_sampler(self, S: int, features: frozenset[str] | None = None):
        """The sampler's program for S rows and one variant (sampler.sample's `features`): shared by
        every T."""
        # with a mesh: the sampled ids and logprobs replicated (each process of a multi-host engine
        # reads its own copy)
        out = {} if self.mesh is None else {"out_shardings": (self._replicated,) * 3}
        fn = jax.jit(self._sample, static_argnames=("S", "features"), **out)
        _, n_f32 = flat_sizes(0, S)  # the float32 buffer holds row fields only (as SamplerRows reads it)
        tables = tuple(self._input(shape, dt) for shape, dt in self._table_shapes(S))
        return self._compiled(fn.lower(self._input((S, self.model_config.vocab_size), jnp.float32),
                                       self._input((len(SAMPLER_I32) * S,), jnp.int32),
                                       self._input((n_f32,), jnp.float32), tables, S=S, features=features))

    def _compiled(self, lowered):
        options = self.platform.step_compiler_options(self.config.attention_backend) \
            if self._use_compiler_options else {}
        if not options:
            return lowered.compile()
        try:
            return lowered.compile(compiler_options=options)
        except Exception as e:  # XLA raises a plain XlaRuntimeError for an unknown option
            if "option" not in str(e):
                raise
            # The options are experimental XLA flags; a jaxlib without them must still run (slower).
            logger.warning("this jaxlib rejects the XLA options %s (%s); compiling without them, which is "
                           "slower on a CPU (docs/PERFORMANCE.md)", sorted(options), str(e).splitlines()[0][:200])
            self._use_compiler_options = False
            return lowered.compile()

    # -- swapping ------------------------------------------------------------------------------
    # Block copies run in chunks of a few fixed sizes (compiled at warm-up like the step), each
    # chunk one device call for all layers: no host round trip per block.
    # (Every array of the pool: K and V, and a draft model's K and V.)
    @staticmethod
    def _gather_blocks(kv, ids):  # ids i32[C] -> every pool's blocks ids, any page layout: [L, C, ...]
        return tuple(x[:, ids] for x in kv)

    @staticmethod
    def _scatter_blocks(kv, ids, *blocks):  # padding ids point at the null page, which takes zeros
        return tuple(x.at[:, ids].set(b) for x, b in zip(kv, blocks, strict=True))

    def _swap_chunks(self) -> tuple[int, ...]:
        return SWAP_CHUNKS if self.host_kv is not None else ()

    def _compile_swaps(self) -> None:
        for C in SWAP_CHUNKS:  # copy-on-write copies, needed with or without a swap pool
            if C not in self._copy_exe:
                ids = self._input((C,), jnp.int32)
                self._copy_exe[C] = jax.jit(self._copy_blocks, donate_argnums=(0,)).lower(
                    self.kv, ids, ids).compile()
        for C in self._swap_chunks():
            if C in self._swap_out_exe:
                continue
            ids = self._input((C,), jnp.int32)
            blocks = (self._input(_with_blocks(x.shape, C), x.dtype, self._pool_sharding) for x in self.kv)
            self._swap_out_exe[C] = jax.jit(self._gather_blocks).lower(self.kv, ids).compile()
            self._swap_in_exe[C] = jax.jit(self._scatter_blocks, donate_argnums=(0,)).lower(
                self.kv, ids, *blocks).compile()

    @staticmethod
    def _copy_blocks(kv, src, dst):  # device to device; padding copies the null page onto itself
        return tuple(x.at[:, dst].set(x[:, src]) for x in kv)

    def swap(self, blocks_to_swap_out: list[tuple[int, int]], blocks_to_swap_in: list[tuple[int, int]],
             blocks_to_copy: list[tuple[int, int]] = ()) -> None:
        """Copy (device block, host block) pairs out, then device blocks (src, dst) for copy-on-write,
        then (host block, device block) pairs in. Out goes first: a block it frees may be the
        destination of a copy or a swap-in; copies go before swap-ins, whose destination may be a
        copy's source freed later in the same step."""
        for pairs_chunk, C in _chunked(blocks_to_swap_out):
            dev = np.zeros(C, np.int32)
            dev[: len(pairs_chunk)] = [d for d, _ in pairs_chunk]
            blocks = jax.device_get(self._swap_out_exe[C](self.kv, self._put(dev)))
            host = [h for _, h in pairs_chunk]
            for pool, b in zip(self.host_kv, blocks, strict=True):
                pool[:, host] = b[:, : len(host)]
        for pairs_chunk, C in _chunked(list(blocks_to_copy)):
            src = np.zeros(C, np.int32)
            dst = np.zeros(C, np.int32)
            src[: len(pairs_chunk)] = [s for s, _ in pairs_chunk]
            dst[: len(pairs_chunk)] = [d for _, d in pairs_chunk]
            self.kv = self._copy_exe[C](self.kv, self._put(src), self._put(dst))
        for pairs_chunk, C in _chunked(blocks_to_swap_in):
            dev = np.zeros(C, np.int32)
            dev[: len(pairs_chunk)] = [d for _, d in pairs_chunk]
            host = [h for h, _ in pairs_chunk]
            blocks = []
            for pool in self.host_kv:
                b = np.zeros(_with_blocks(pool.shape, C), pool.dtype)
                b[:, : len(host)] = pool[:, host]
                blocks.append(self._put(b, self._pool_sharding))
            self.kv = self._swap_in_exe[C](self.kv, self._put(dev), *blocks)

    def step_programs(self) -> list:
        """The compiled programs of a step: the model's of every bucket pair (and width) and every sampler variant."""
        return (list(self._executables.values()) + list(self._wide.values()) + list(self._prompt.values())
                + [p for programs in self._samplers.values() for p in programs])

    def bucket_pairs(self) -> list[tuple[int, int]]:
        sc = self.scheduler_config
        return bucket_pairs(sc.token_buckets, sc.seq_buckets)

    def warm_up(self, run: bool = False) -> float:
        """Compile every (T, S) bucket pair, and with `run` run each program once on a batch of
        padding (EngineArgs.warm_up_runs). Returns the seconds it took (also logged)."""
        enable_compilation_cache()
        t0 = time.perf_counter()
        pairs = self.bucket_pairs()
        Q = self.width
        for T, S in pairs:
            if (T, S) not in self._executables:
                self._executables[(T, S)] = self.compile(T, S)
            if Q > 1 and (T, S) not in self._wide:
                self._wide[(T, S)] = self.compile(T, S, Q)
            for R in (S, S * Q) if Q > 1 else (S,):  # the sampler's rows
                if R not in self._samplers:
                    self._samplers[R] = tuple(self.compile_sampler(R, f) for f in self.sampler_variants)
        self._compile_swaps()
        if self._table_writer is None:
            ids = self._input((OVERFLOW_CHUNK,), jnp.int32)
            self._table_writer = jax.jit(apply_writes, donate_argnums=(0,)).lower(self.block_table, ids, ids).compile()
        V = self.model_config.vocab_size
        for S in self._samplers:  # placed, not jnp.zeros: nothing to compile
            (pi, pc, m, bi, bv) = self._table_shapes(S)
            self._idle_tables[S] = (self._device(np.zeros(*pi)), self._device(np.zeros(*pc)),
                                    self._device(np.full(m[0], -1, m[1])),  # all ones: every token allowed
                                    self._device(np.full(bi[0], V, bi[1])),  # id V: no entry
                                    self._device(np.zeros(*bv)))
        self._prev_ids = self._device(np.zeros(self.scheduler_config.max_num_seqs, np.int32))
        compiled = time.perf_counter() - t0
        if run:
            for T, S in pairs:
                self.run_once(T, S)
                if Q > 1:
                    self.run_once(T, S, Q)
            self._run_sampler_variants()
        self.warmup_seconds = time.perf_counter() - t0
        logger.info("warm-up: compiled %d bucket pairs (T in %s, S in %s) in %.1f s%s", len(pairs),
                    list(self.scheduler_config.token_buckets), list(self.scheduler_config.seq_buckets), compiled,
                    f", ran each once in {self.warmup_seconds - compiled:.1f} s" if run else "")
        return self.warmup_seconds

    def ensure_prompt_logprobs(self, run: bool = False) -> float:
        """Compile the prompt logprobs program (scheduler.prompt_logprobs_buckets) if it is not yet,
        and with `run` run it once on padding. The engine calls it when a request first asks for
        prompt logprobs, before that request is scheduled (no step compiles): compiled at every
        warm-up, it was a fifth of a small engine's start for a feature few requests use
        (docs/PERFORMANCE.md, "Decisions in the code"). Returns the seconds it took."""
        T, S = self.prompt_logprobs_buckets
        if S in self._prompt:
            return 0.0
        t0 = time.perf_counter()
        self._prompt[S] = self.compile(T, S, P=True)
        if run:
            self._fetch(*self.run(self.packer.pack(SchedulerOutput(token_bucket=T, seq_bucket=S, prompt_logprobs=True))))
        seconds = time.perf_counter() - t0
        logger.info("compiled the prompt logprobs program (T=%d, S=%d) for the first request that asks for them in "
                    "%.1f s", T, S, seconds)
        return seconds

    def _run_sampler_variants(self) -> None:
        """Run every sampler variant run_once did not (it runs the cheapest) once, on zeros."""
        V = self.model_config.vocab_size
        for S, programs in self._samplers.items():
            _, n_f32 = flat_sizes(0, S)
            args = (self._device(np.zeros((S, V), np.float32)), self._device(np.zeros(len(SAMPLER_I32) * S, np.int32)),
                    self._device(np.zeros(n_f32, np.float32)), self._idle_tables[S])
            self._fetch(*(p(*args)[0] for p in programs[1:]))
            self.sampler_ran.update((S, k) for k in range(len(programs)))

    def run_once(self, T: int, S: int, Q: int = 1) -> None:
        """Run (T, S)'s program (of width Q) on a batch of padding, waiting for it (attention reads
        nothing and the pool's real blocks are untouched: padding writes the null page)."""
        self._fetch(*self.run(self.packer.pack(SchedulerOutput(token_bucket=T, seq_bucket=S, width=Q))))

    def dispatch(self, out: SchedulerOutput) -> InFlight:
        """Start one step: its block moves (even an empty step may have some), then its rows, without
        waiting for the device to finish them. Steps run on the device in the order dispatched."""
        started = time.monotonic()
        step = InFlight(out, started)
        try:
            if out.has_block_moves:
                t0 = time.perf_counter()
                self.swap(out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy)
                step.device_seconds = time.perf_counter() - t0
            if out.is_empty:
                self.packer.end_requests(out)
                return step
            t0 = time.perf_counter()
            batch = self.packer.pack(out)
            t1 = time.perf_counter()
            step.pack_seconds = t1 - t0
            seen = len(self.ran) + len(self.sampler_ran)
            step.ints, step.floats = self.run(batch)
            step.prompt = self._extra_out if batch.prompt_logprobs else None
            step.drafts = self._extra_out[0] if batch.width > 1 and self.draft_graphdef is not None else None
            step.first_run = len(self.ran) + len(self.sampler_ran) > seen  # a program new to either set
            step.launch_seconds = time.perf_counter() - t1
            step.device_start = self.model_dispatched
            # the sampler's rows: S, or S Q in a step verifying proposals
            step.S = batch.num_seqs_bucket * batch.width
            step.rejected, step.needs_tokens = batch.rejected, batch.needs_tokens
            return step
        except Exception:
            self.recover_pool()
            raise

    def collect(self, step: InFlight) -> StepResult:
        """Wait for a dispatched step and read its sampled tokens (and logprobs)."""
        if not step.S:
            return StepResult(SamplerOutput.unpack(np.zeros(0, np.int32), np.zeros(0, np.float32), 0,
                                                   self.max_logprobs), step.started, device_seconds=step.device_seconds)
        t0 = time.perf_counter()
        try:
            drafts = () if step.drafts is None else (step.drafts,)
            ints, floats, *prompt = self._fetch(step.ints, step.floats, *(step.prompt or ()), *drafts)
            drafts = prompt.pop() if drafts else None
        except Exception:
            self.recover_pool()
            raise
        done = time.perf_counter()
        return StepResult(SamplerOutput.unpack(ints, floats, step.S, self.max_logprobs), step.started,
                          step.rejected, step.device_seconds + done - t0, done,
                          PromptLogprobs.unpack(*prompt, self.max_logprobs) if prompt else None, drafts)

    def run(self, batch: BatchDescriptor):
        """Dispatch the model's and the sampler's programs over one packed batch: its packed sampler output,
        still on the device (an array being computed)."""
        T, S, Q = batch.num_tokens_bucket, batch.num_seqs_bucket, batch.width
        if batch.prompt_logprobs:
            exe = self._prompt.get(S) if (T, S) == self.prompt_logprobs_buckets else None
        else:
            exe = (self._executables if Q == 1 else self._wide).get((T, S))
        if exe is None:  # pragma: no cover - the scheduler only produces warmed-up buckets
            raise RuntimeError(f"bucket (T={T}, S={S}, width {Q}) was not compiled at warm-up")
        R = S * Q  # the sampler's rows: Q per row, its row's values repeated (SamplerRows)

        def rows(x):  # (the packer builds a wide step's penalty tables per position itself)
            return self._put(x if Q == 1 or x.shape[0] == R else np.repeat(x, Q, axis=0))

        # tables no row uses are not sent: their idle copies stay on the device (never read, or neutral)
        idle = self._idle_tables[R]
        pen = (rows(batch.penalty_ids), rows(batch.penalty_counts)) if batch.has_penalties else idle[:2]
        mask = (rows(batch.token_mask),) if batch.has_mask else idle[2:3]
        bias = (rows(batch.bias_ids), rows(batch.bias_values)) if batch.has_bias else idle[3:]
        tables = (*pen, *mask, *bias)
        flat_f32 = batch.flat_f32 if Q == 1 else np.repeat(batch.flat_f32.reshape(-1, S), Q, axis=1).reshape(-1)
        if batch.table_overflow is not None:
            self._write_overflow(*batch.table_overflow)
        ints, floats, self._prev_ids = self.launch(exe, R, self._prev_ids, self._put(batch.flat_i32),
                                                   self._put(flat_f32), tables, self.step_needs(batch))
        self.ran.add((T, S, "prompt") if batch.prompt_logprobs else (T, S) if Q == 1 else (T, S, Q))
        return ints, floats

    def step_needs(self, batch: BatchDescriptor) -> frozenset[str] | None:
        """The sampler features a packed batch needs (sampler.needs); None where S has one program."""
        if len(self.sampler_variants) == 1:
            return None
        return sampler_needs(batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.num_logprobs,
                             batch.has_penalties or batch.has_mask or batch.has_bias)

    def launch(self, exe, S: int, prev_ids, flat_i32, flat_f32, tables, needs: frozenset[str] | None = None):
        """One step's two programs, dispatched back to back: `exe` (the model's, for the step's (T, S))
        then S's sampler, the first variant that holds `needs` (sampler.needs; None: every feature).
        Updates the pool; returns (ints, floats, next prev_ids), on the device."""
        self.kv, logits, rows_i32, self.block_table, *self._extra_out = exe(
            self.weights, self.kv, self.block_table, prev_ids, flat_i32)
        self.model_dispatched = time.perf_counter()
        return self.sampler_for(S, needs)(logits, rows_i32, flat_f32, tables)

    def sampler_for(self, S: int, needs: frozenset[str] | None):
        """S's sampler program for a step that needs `needs` (None: any step): the first variant that
        holds them, the last (every feature) otherwise. Recorded in sampler_ran, as it is about to run."""
        k = next((k for k, features in enumerate(self.sampler_variants)
                  if features is None or (needs is not None and needs <= features)), len(self.sampler_variants) - 1)
        self.sampler_ran.add((S, k))
        return self._samplers[S][k]

    def time_pairs(self, pairs: list[tuple[int, int]], repeats: int = 2, Q: int = 1) -> list[tuple[int, int, float]]:
        """(T, S, seconds) of a step of only padding (of width Q) for each pair, the best of `repeats`
        runs: the step-cost model's cold start (attention then reads nothing; the weights' work is
        all there)."""
        times = []
        for T, S in pairs:
            if ((T, S) if Q == 1 else (T, S, Q)) not in self.ran:  # a first run pays one-time costs: not timed
                self.run_once(T, S, Q)
            batch = self.packer.pack(SchedulerOutput(token_bucket=T, seq_bucket=S, width=Q))
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                self._fetch(*self.run(batch))
                best = min(best, time.perf_counter() - t0)
            times.append((T, S, best))
        return times

    def recover_pool(self) -> None:
        """After a failed step: the pool was donated to the call that failed and may be gone; its
        contents are lost either way (the caller ends every request that had KV in it:
        scheduler.recover). The previous step's sampled ids go too: an error that surfaced when
        the step was read is carried by every output of the call, and the next step reads both."""
        try:
            lost = any(x.is_deleted() for x in self.kv)
            if not lost:
                jax.block_until_ready(self.kv)
        except Exception:  # noqa: BLE001 - the failed call's outputs hold its error
            lost = True
        if lost:
            logger.error("the KV pool was lost with the failed step; allocating a fresh one")
            self.kv = self._new_pool(self.kv[0].dtype)
        self._prev_ids = self._device(np.zeros(self.scheduler_config.max_num_seqs, np.int32))
        self.block_table = self._new_block_table()
        self.packer.forget_prev()

    def _new_block_table(self):
        return self._device(np.zeros(self.packer.tables.mirror.shape, np.int32))

    def _write_overflow(self, writes: np.ndarray, values: np.ndarray) -> None:
        """A step's block table writes past its buffer's capacity, in chunks (padding: 0 at 0)."""
        for i in range(0, writes.size, OVERFLOW_CHUNK):
            w = np.zeros(OVERFLOW_CHUNK, np.int32)
            v = np.zeros(OVERFLOW_CHUNK, np.int32)
            chunk = slice(i, i + OVERFLOW_CHUNK)
            w[: writes[chunk].size] = writes[chunk]
            v[: values[chunk].size] = values[chunk]
            self.block_table = self._table_writer(self.block_table, self._put(w), self._put(v))

    def _device(self, x: np.ndarray):
        """A constant input kept on the device(s), replicated."""
        if self.mesh is None:
            return jax.device_put(x)
        return place(x, self._replicated)
