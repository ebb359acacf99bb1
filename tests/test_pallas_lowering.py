"""Lower the "pallas" backend for the `cuda` platform on this CPU-only machine.

Every (T, S) bucket that the runner compiles for a small engine config is lowered to StableHLO for
cuda, so an unsupported primitive or a bad shape in the kernels fails here rather than on the GPU.
Our kernels pass Triton compiler params, so each lowers to a `__gpu$xla.gpu.triton` custom call
that carries the kernel as Triton IR (TTIR); PTX is only produced by XLA on the GPU. So the TTIR is
also parsed back and checked for what Triton's later passes would reject: every tensor dimension a
power of two, every dot at least 16 x 16 x 16.

Versions (both run by `make test-all`; jax 0.10.2's leg alone by `make test`): with jax 0.10.2 the
Triton lowering, finding no GPU, targets compute capability 9.0 by itself. With jax 0.11.2 it takes
the target GPU from the abstract mesh's device, and with neither a GPU nor an abstract device it
raises "No supported GPU devices found"; so every lowering and export here runs under
`abstract_gpu()` (an H200, compute capability 9.0), which jax 0.10.2 accepts and ignores. On both
versions the custom call carries TTIR and nothing here needs the CUDA plugin.
"""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from jaxsched.core.buckets import bucket_pairs, seq_buckets, token_buckets
from pallas_kernels import paged_attention

TRITON_CALL = "__gpu$xla.gpu.triton"
# a small engine: max_num_batched_tokens 64, max_num_seqs 16, max_model_len 256
BUCKETS = bucket_pairs(token_buckets(64), seq_buckets(16))
MAX_MODEL_LEN = 256
# (name, N, K, H, P, dtype): the tiny test model, a Llama-3.2-1B-like GQA 4 in bf16, and a
# Qwen2-7B-like G = 7 (not a power of two) with the largest page size
MODELS = [
    ("tiny", 4, 4, 16, 8, jnp.float32),
    ("llama-1b", 32, 8, 64, 16, jnp.bfloat16),
    ("qwen2-7b", 28, 4, 128, 128, jnp.bfloat16),
]


@contextlib.contextmanager
def abstract_gpu():
    """An abstract mesh over one abstract H200, the target GPU of lowerings on a machine without one.
    Its axis is Auto, as the engine's meshes are (parallel.make_mesh): jax 0.11 makes an abstract
    mesh's axes Explicit by default, under which it cannot infer ragged_dot's sharding."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def lower_for_cuda(fn, *args):
    """jit(fn) lowered for cuda from abstract arguments, on a machine without a GPU."""
    with abstract_gpu():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def triton_kernels(lowered) -> dict[str, str]:
    """The TTIR of every Triton custom call in a lowered program, as text, by kernel name."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering as triton_lowering  # private: the TTIR dialect context

    blobs: dict[str, bytes] = {}

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    o = child.operation
                    if o.name == "stablehlo.custom_call" and ir.StringAttr(
                            o.attributes["call_target_name"]).value == TRITON_CALL:
                        cfg = ir.DictAttr(o.attributes["mhlo.backend_config"])
                        blobs[ir.StringAttr(cfg["name"]).value] = ir.StringAttr(cfg["ir"]).value_bytes
                    walk(o)

    walk(lowered.compiler_ir("stablehlo").operation)
    texts = {}
    with triton_lowering._new_ir_context():
        for name, blob in blobs.items():
            module = ir.Module.parse(blob)
            assert module.operation.verify(), f"{name}: the Triton IR does not verify"
            texts[name] = str(module)
    return texts


_TENSOR = re.compile(r"tensor<((?:\d+x)+)")
_DOT = re.compile(r"tt\.dot [^:]*: tensor<(\d+)x(\d+)x[^>]*> \* tensor<(\d+)x(\d+)x")


def ttir_problems(ttir: str) -> list[str]:
    """What Triton would reject later: non-power-of-2 tensor dimensions, dots below 16 x 16 x 16."""
    problems = []
    for m in _TENSOR.finditer(ttir):
        dims = [int(d) for d in m.group(1).split("x") if d]
        if any(d & (d - 1) for d in dims):
            problems.append(f"tensor dims {dims} are not all powers of two")
    dots = _DOT.findall(ttir)
    for mm, k, _, n in dots:
        if min(int(mm), int(k), int(n)) < 16:
            problems.append(f"dot M={mm} K={k} N={n}: Triton needs each >= 16")
    return sorted(set(problems))


def attention_args(T, S, N, K, H, P, dtype, L=2):
    M = -(-MAX_MODEL_LEN // P)
    NB = S * M + 1
    sd = jax.ShapeDtypeStruct
    i32 = jnp.int32
    return (sd((T, N, H), dtype), sd((L, NB, K, P, H), dtype), sd((L, NB, K, P, H), dtype), sd((), i32),
            sd((S, M), i32), sd((S,), i32), sd((S + 1,), i32), sd((1,), i32))


def pallas_for_gpu(*a):
    # interpret is decided by the platform we trace on (CPU here), so force the real kernel
    from pallas_kernels.pallas_attention import pallas_attention

    return pallas_attention(*a, sm_scale=0.125, interpret=False)


@pytest.mark.parametrize("model", MODELS, ids=[m[0] for m in MODELS])
def test_every_bucket_lowers_for_cuda(model):
    _, N, K, H, P, dtype = model
    assert len(BUCKETS) >= 4
    for T, S in BUCKETS:
        lowered = lower_for_cuda(pallas_for_gpu, *attention_args(T, S, N, K, H, P, dtype))
        assert lowered.as_text().count(TRITON_CALL) == 2, f"T={T} S={S}: expected the decode and prefill kernels"
        kernels = triton_kernels(lowered)
        assert sorted(kernels) == ["ragged_paged_attention_decode", "ragged_paged_attention_prefill"]
        for name, ttir in kernels.items():
            assert len(_DOT.findall(ttir)) == 2 and "scf.for" in ttir, f"{name}: lost its QK and PV dots or KV loop"
            assert ttir_problems(ttir) == [], f"T={T} S={S} {name}: {ttir_problems(ttir)}"


def test_gemma_shaped_kernels_lower_for_cuda():
    """Gemma 2's soft-capped scores (a tanh in both kernels) and a per-layer window passed as a
    traced scalar, at Gemma's head_dim 256 in bfloat16, lower to the two Triton kernels."""
    from pallas_kernels.pallas_attention import pallas_attention

    def gemma(q, k, v, layer, *rest):
        window = jnp.where(layer % 2 == 0, 4096, 1 << 30)  # every other layer sliding, as in Gemma 2
        return pallas_attention(q, k, v, layer, *rest, sm_scale=256**-0.5, interpret=False, window=window,
                                softcap=50.0)

    for T, S in BUCKETS[:2] + BUCKETS[-1:]:
        kernels = triton_kernels(lower_for_cuda(gemma, *attention_args(T, S, 8, 4, 256, 16, jnp.bfloat16)))
        assert sorted(kernels) == ["ragged_paged_attention_decode", "ragged_paged_attention_prefill"]
        for name, ttir in kernels.items():
            assert "__nv_tanhf" in ttir, f"{name}: no soft-cap (libdevice tanh)"
            assert ttir_problems(ttir) == [], f"T={T} S={S} {name}: {ttir_problems(ttir)}"


def test_fp8_pages_lower_for_cuda():
    """An fp8 pool (kv_cache_dtype="fp8": e4m3 pages) under a bfloat16 model: each kernel converts
    its tiles to bfloat16 before the dots, which stay bfloat16 x bfloat16 with float32 accumulation."""
    for T, S in BUCKETS[:2] + BUCKETS[-1:]:
        q, k, v, *rest = attention_args(T, S, 32, 8, 64, 16, jnp.bfloat16)
        k, v = (jax.ShapeDtypeStruct(x.shape, jnp.float8_e4m3fn) for x in (k, v))
        kernels = triton_kernels(lower_for_cuda(pallas_for_gpu, q, k, v, *rest))
        assert sorted(kernels) == ["ragged_paged_attention_decode", "ragged_paged_attention_prefill"]
        for name, ttir in kernels.items():
            assert "f8E4M3FN" in ttir, f"{name}: the fp8 tiles are not loaded as fp8"
            assert "tt.fp_to_fp" in ttir or "arith.extf" in ttir, f"{name}: no fp8 -> bfloat16 conversion"
            assert ttir_problems(ttir) == [], f"T={T} S={S} {name}: {ttir_problems(ttir)}"


def test_the_wrapper_dispatches_the_kernel_when_lowering_for_cuda():
    """backend="pallas" through the public wrapper, exported with the Triton custom call allowed."""
    from jax import export

    args = attention_args(32, 8, 8, 2, 32, 16, jnp.bfloat16)
    f = jax.jit(lambda *a: paged_attention(*a, sm_scale=0.2, backend="pallas"))
    # On this CPU machine "pallas" means interpret mode: no Triton call, pure XLA.
    assert TRITON_CALL not in f.trace(*args).lower().as_text()
    with abstract_gpu():
        exp = export.export(jax.jit(pallas_for_gpu), platforms=["cuda"],
                            disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)
    assert exp.platforms == ("cuda",) and exp.mlir_module().count(TRITON_CALL) == 2


def test_the_checks_can_fail():
    """A non-power-of-2 load is refused by the lowering; a too-small dot is caught by ttir_problems."""
    def bad_load(x_ref, o_ref):
        o_ref[...] = jnp.zeros((16, 16), jnp.float32) + x_ref[pl.ds(0, 3), :].sum()

    def small_dot(x_ref, o_ref):
        x = x_ref[pl.ds(0, 8), :]
        o_ref[pl.ds(0, 8), pl.ds(0, 8)] = jax.lax.dot_general(x, x, (((1,), (1,)), ((), ())),
                                                              preferred_element_type=jnp.float32)

    def call(kernel):
        from jax.experimental.pallas import triton as plgpu

        return lambda x: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 16), jnp.float32),
                                        compiler_params=plgpu.CompilerParams())(x)

    x = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    with pytest.raises(Exception, match="power of 2"):
        lower_for_cuda(call(bad_load), x)
    problems = ttir_problems("\n".join(triton_kernels(lower_for_cuda(call(small_dot), x)).values()))
    assert problems and "dot M=8" in problems[-1]
    assert ttir_problems("%1 = tt.load %0 : tensor<3x16x!tt.ptr<f32>>") == [
        "tensor dims [3, 16] are not all powers of two"]
