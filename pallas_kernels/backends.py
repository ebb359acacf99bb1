"""The attention backends: one record each, in one registry.

A record holds everything that depends on which backend runs attention: its attend function, how
its KV pool is laid out and stored, its default block size, where attention_backend="auto" tries
it, and what it cannot run. Adding a backend is one kernel file and one entry in BACKENDS.

The engine resolves EngineArgs.attention_backend with choose(); paged_attention and kv_cache look
records up by name with get().
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import jax.numpy as jnp

# numba_attention imports numba only when its kernel is first called or its support is checked
from jaxsched import platforms
from pallas_kernels import numba_attention
from pallas_kernels.pallas_attention import pallas_attention, validate_pallas
from pallas_kernels.pallas_attention import prepare as pallas_prepare
from pallas_kernels.pallas_attention import unsupported_reason as pallas_unsupported
from pallas_kernels.pool_storage import BF16_BITS, E4M3_BITS, is_fp8, values_dtype
from pallas_kernels.reference_attention import reference_attention
from pallas_kernels.xla_attention import prepare as xla_prepare
from pallas_kernels.xla_attention import xla_attention

AUTO = "auto"


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    # (q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc, num_seqs, *, sm_scale)
    # -> o f[T, N, H]; arguments as in paged_attention's docstring, checked by its validate first
    attend: Callable = field(repr=False)
    # K pages stored [H, P] instead of [P, H] (see the "xla" entry below for why)
    k_transposed: bool
    # a bfloat16 pool stored as uint16 bits (pool_storage.py says why)
    bf16_as_bits: bool
    # tokens per KV block P when EngineArgs.block_size is None
    default_block_size: int
    # platforms (jax's names: "cpu", "gpu", ...) on which "auto" tries this backend; None: every
    # platform. "auto" tries backends in BACKENDS order, so a fallback comes last.
    auto_on: tuple[str, ...] | None
    # (head_dim, block_size, dtype, kv_dtype, platform) -> why this backend cannot run them, or None.
    # dtype is the model's, kv_dtype the pool's values' (kv_cache_dtype resolved: "auto" is dtype).
    why_unsupported: Callable[[int, int, str, str, str], str | None] = field(repr=False)
    # why this backend cannot run per shard under shard_map (tensor parallelism), or None
    why_not_sharded: str | None = None
    # (q, k, v, cos, sin, k_cache, v_cache, layer, slot_mapping) -> (q with rope, k_cache, v_cache)
    # in one kernel, or None where it cannot run those arrays; no function, or None: the layer runs
    # layers.apply_rope and kv_cache.write_kv in XLA (the same values)
    rope_write: Callable | None = field(default=None, repr=False)
    # (T, N, K, H, P, block_tables, seq_lens, query_start_loc, num_seqs) -> what every layer's call
    # derives from the step's metadata alone, computed once a step outside the layer loop and passed
    # to attend as `meta` (layers.paged_attend); None: the backend derives nothing worth hoisting
    prepare: Callable | None = field(default=None, repr=False)
    # attend takes softcap= (Gemma 2's score soft-capping, softcap.py); False: it refuses such models
    softcap: bool = True
    # an fp8 e4m3 pool stored as uint8 bits (the numba kernels' storage, and the XLA ones' on a CPU
    # for the reason bfloat16's is uint16: pool_storage.py)
    fp8_as_bits: bool = False

    def pool_shapes(self, L: int, NB: int, K: int, P: int, H: int):
        """(K pool shape, V pool shape): [L, NB, K, H, P] or [L, NB, K, P, H], and [L, NB, K, P, H]."""
        v = (L, NB, K, P, H)
        return ((L, NB, K, H, P) if self.k_transposed else v), v

    def pool_dtype(self, dtype: str):
        """The array dtype of a pool of `dtype` values (a resolved kv_cache_dtype: "float32",
        "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")."""
        values = values_dtype(dtype)
        if self.bf16_as_bits and values == jnp.bfloat16:
            return BF16_BITS
        if self.fp8_as_bits and values == jnp.float8_e4m3fn:
            return E4M3_BITS
        return values


def _pallas(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc, num_seqs, *, sm_scale,
            meta=None, window=None, softcap=None):
    validate_pallas(q, k_cache, block_tables)  # the Triton lowering's own rules, named before tracing
    return pallas_attention(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc, num_seqs,
                            sm_scale=sm_scale, meta=meta, window=window, softcap=softcap)


def _pallas_unsupported(head_dim, block_size, dtype, kv_dtype, platform):
    plat = platforms.of(platform)
    if not (plat.triton or plat.host_runs_model):  # Triton, or Pallas' interpreter on the host
        return (f"attention backend 'pallas' runs its Triton kernels on a GPU (interpreted on a CPU, for "
                f"tests), not on {platform!r}")
    if not is_fp8(kv_dtype) and values_dtype(kv_dtype) != jnp.dtype(dtype):
        # the kernels convert fp8 tiles to q's dtype before their dots; a 16- or 32-bit pool is
        # loaded straight into them, which Triton wants in q's dtype
        return (f"kv_cache_dtype {kv_dtype!r} differs from the model dtype {jnp.dtype(dtype).name!r}, which "
                f"attention backend 'pallas' supports only for fp8 pools; use kv_cache_dtype='auto' or 'fp8'")
    return pallas_unsupported(head_dim, block_size, dtype)


def _numba_unsupported(head_dim, block_size, dtype, kv_dtype, platform):
    if kv_dtype == "fp8_e5m2":
        return ("kv_cache_dtype 'fp8_e5m2' is not read by the numba kernels (they read e4m3 as its bits); "
                "use kv_cache_dtype='fp8' (e4m3) or attention_backend='xla'")
    return numba_attention.unsupported_reason(platform)


def _runs_anything(head_dim, block_size, dtype, kv_dtype, platform):
    return None


# In order of preference for "auto".
BACKENDS: dict[str, AttentionBackend] = {b.name: b for b in (
    # The Pallas kernels with the Triton lowering (pallas_attention.py). They load [P, H] tiles and
    # bfloat16 natively. 16-token blocks, as vLLM's GPU backends use.
    AttentionBackend("pallas", _pallas, k_transposed=False, bf16_as_bits=False, default_block_size=16,
                     auto_on=("gpu",), why_unsupported=_pallas_unsupported, prepare=pallas_prepare),
    # A numba kernel called through XLA's FFI that reads pages where they lie (numba_attention.py).
    # It shares the "xla" backend's pool, and its kernel sums rows of a [H, P] page into contiguous
    # scores too. Its compiled kernels have no score soft-capping: Gemma 2 runs on "xla" instead.
    AttentionBackend("numba", numba_attention.numba_attention, k_transposed=True, bf16_as_bits=True,
                     default_block_size=128, auto_on=("cpu",), why_unsupported=_numba_unsupported,
                     rope_write=numba_attention.rope_write_kv, softcap=False, fp8_as_bits=True),
    # The jnp implementation tuned for XLA:CPU (xla_attention.py); runs anywhere, so the fallback.
    # K pages [H, P]: its score dot contracts over H, and XLA:CPU feeds that dot a [.., H, C]
    # operand, so with [P, H] pages every gathered K chunk went through a transpose copy on top of
    # the gather. V pages stay [P, H] (the PV dot contracts over P). 128-token blocks, as vLLM's CPU
    # backend uses: XLA:CPU's gathers copy a page per index, so bigger pages read faster. Both
    # measured in docs/PERFORMANCE.md, "Decisions in the code".
    AttentionBackend("xla", xla_attention, k_transposed=True, bf16_as_bits=True, default_block_size=128,
                     auto_on=None, why_unsupported=_runs_anything, prepare=xla_prepare, fp8_as_bits=True),
    # The obviously-correct version every other backend is tested against (reference_attention.py);
    # O(T * M * P) memory, so never chosen by "auto".
    AttentionBackend("reference", reference_attention, k_transposed=False, bf16_as_bits=True,
                     default_block_size=128, auto_on=(), why_unsupported=_runs_anything, fp8_as_bits=True),
)}


def get(name: str) -> AttentionBackend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"attention backend must be one of {tuple(BACKENDS)}, got {name!r}") from None


def auto_order(platform: str) -> list[AttentionBackend]:
    """The backends "auto" tries on `platform`, best first."""
    return [b for b in BACKENDS.values() if b.auto_on is None or platform in b.auto_on]


def choose(name: str, platform: str, head_dim: int, block_size: int | None, dtype: str,
           kv_dtype: str, shards: int = 1, softcap: bool = False) -> tuple[AttentionBackend, list[str]]:
    """The backend for attention_backend=`name` ("auto" or a name in BACKENDS) running a model of
    `head_dim` and `dtype` with a pool of `kv_dtype` values in blocks of `block_size` tokens (None:
    each backend's default_block_size) on `platform` (jax's name: "cpu", "gpu", ...), split over
    `shards` devices (tensor parallelism: the backend runs per shard under shard_map), soft-capping
    its scores if `softcap` (Gemma 2).

    Returns the record and, for "auto", one line per backend it preferred but skipped ("using 'xla'
    because <why not 'pallas'>") for the caller to log. A name that is neither "auto" nor in BACKENDS,
    or one that cannot run, raises ValueError saying what to change; for the latter that includes
    the backend "auto" would pick instead.
    """
    def why(b: AttentionBackend) -> str | None:
        if shards > 1 and b.why_not_sharded is not None:
            return f"attention backend {b.name!r} cannot run with tensor_parallel_size > 1: {b.why_not_sharded}"
        if softcap and not b.softcap:
            return (f"attention backend {b.name!r} has no attention logit soft-capping, which this model "
                    "(attn_logit_softcapping in its config.json: Gemma 2) needs")
        P = b.default_block_size if block_size is None else block_size
        return b.why_unsupported(head_dim, P, dtype, kv_dtype, platform)

    if name != AUTO:
        if name not in BACKENDS:
            raise ValueError(f"attention_backend must be {AUTO!r} or one of {tuple(BACKENDS)}, got {name!r}")
        backend = BACKENDS[name]
        reason = why(backend)
        if reason is not None:
            instead, _ = choose(AUTO, platform, head_dim, block_size, dtype, kv_dtype, shards, softcap)
            raise ValueError(f"attention_backend={name!r} cannot run here: {reason}; or use "
                             f"attention_backend={instead.name!r} (what 'auto' picks here)")
        return backend, []
    skipped = []
    for backend in auto_order(platform):
        reason = why(backend)
        if reason is None:
            return backend, [f"using {backend.name!r} because {r}" for r in skipped]
        skipped.append(reason)
    raise ValueError(f"attention_backend='auto': no backend can run here: {'; '.join(skipped)}")
