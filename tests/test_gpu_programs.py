"""Every step program of the GPU defaults, lowered for CUDA on this CPU (tests/test_pallas_lowering.py's
abstract H200): the model's (T, S) programs with layer weights stacked (the GPU default) and unrolled,
and every sampler program of sampler_branches="host". What XLA:GPU would pay for is checked in the
StableHLO:
- no conditional anywhere: XLA:GPU runs a cond by copying its predicate to the host and waiting;
- the only loop of a model program is the layer scan where the weights are stacked, none unrolled;
- the Triton calls: the decode and the prefill kernel once in the scan's body, or once per layer.
A change that adds a cond, a loop or a kernel call fails here, before any GPU hour is spent.
`python -m pytest tests/test_gpu_programs.py -s` prints each program's op count and lowering time
(docs/PERFORMANCE.md, "GPU (H200)")."""

from __future__ import annotations

import functools
import re
import time
import types

import jax
import pytest
from test_pallas_lowering import TRITON_CALL, abstract_gpu

from jaxsched import LLM, platforms

ENGINE = {"max_model_len": 64, "max_num_seqs": 8, "max_num_batched_tokens": 32, "block_size": 16,
          "attention_backend": "pallas", "sampler_branches": "host", "warm_up_runs": False}
# an op's name, in the pretty form (`%1 = stablehlo.add ...`) or the generic one (`%1 = "stablehlo.case"(...)`)
_OP = re.compile(r'(?:= |^\s*)"?(stablehlo\.[a-z_]+)', re.MULTILINE)


def sds(tree):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def lowered_text(fn, *args) -> tuple[str, float]:
    t0 = time.perf_counter()
    with abstract_gpu():
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return text, time.perf_counter() - t0


_FUNC = re.compile(r"func\.func (?:private|public) @([\w.$-]+)")
_CALL = re.compile(r"call @([\w.$-]+)")


def functions(text: str) -> dict[str, str]:
    """Each function of a lowered module, by name: its text (up to the next function)."""
    marks = [(m.start(), m.group(1)) for m in _FUNC.finditer(text)] + [(len(text), "")]
    return {name: text[start:marks[i + 1][0]] for i, (start, name) in enumerate(marks[:-1])}


def loop_body(text: str) -> str:
    """The body region of the first stablehlo.while of `text` (the layer scan's); braces inside
    string attributes (a kernel's serialized IR) do not count."""
    j = text.index("do {", text.index("stablehlo.while"))
    depth, quoted, escaped = 0, False, False
    for k in range(j + 3, len(text)):
        c = text[k]
        if quoted:
            quoted = escaped or c != '"'
            escaped = not escaped and c == "\\"
            continue
        quoted = c == '"'
        depth += {"{": 1, "}": -1}.get(c, 0)
        if depth == 0:
            return text[j:k]
    raise AssertionError("unbalanced while body")


def reachable(fragment: str, funcs: dict[str, str]) -> set[str]:
    """The functions called from `fragment`, and from those, transitively."""
    seen: set[str] = set()
    todo = set(_CALL.findall(fragment))
    while todo:
        name = todo.pop()
        if name not in seen and name in funcs:
            seen.add(name)
            todo |= set(_CALL.findall(funcs[name]))
    return seen


# what attention derives from the step's metadata alone (the prefill tile map, the token-to-row map):
# computed once a step (AttentionBackend.prepare), never inside the layer loop
STEP_ONLY = ("searchsorted", "cumsum")


def ops(text: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in _OP.findall(text):
        counts[name] = counts.get(name, 0) + 1
    return counts


@pytest.fixture(scope="module", params=["stacked", "unrolled"])
def runner(request, llama_dir):
    llm = LLM(llama_dir, layer_weights=request.param, **ENGINE)
    core = llm.llm_engine.client.local_cores[0]
    yield request.param, core.runner, llm.llm_engine.model_config.num_layers


def as_on_a_gpu(monkeypatch) -> None:
    """The kernels as on a GPU: the Pallas calls decide interpret mode from the platform they are
    traced on (this CPU), so they are told it is a GPU."""
    from pallas_kernels import pallas_attention

    monkeypatch.setattr(pallas_attention, "platforms", types.SimpleNamespace(of=lambda name: platforms.GPU))


@pytest.fixture
def triton_kernels(monkeypatch):
    as_on_a_gpu(monkeypatch)


def test_model_programs_have_no_cond_one_loop_when_stacked_and_their_kernel_calls(runner, triton_kernels):
    weights, r, L = runner
    assert r.config.layer_weights == weights and r.config.attention_backend == "pallas"
    for T, S in r.bucket_pairs():
        n_i32 = r.compile.__func__.__globals__["flat_sizes"](T, S)[0]
        args = (sds(r._state_leaves), sds(r.kv), sds(r.block_table),
                jax.ShapeDtypeStruct((r.scheduler_config.max_num_seqs,), "int32"),
                jax.ShapeDtypeStruct((n_i32,), "int32"))
        text, seconds = lowered_text(functools.partial(r._forward, T=T, S=S), *args)
        counts = ops(text)
        print(f"model {weights} T={T} S={S}: {sum(counts.values())} StableHLO ops, lowered in {seconds:.2f} s")
        assert "stablehlo.case" not in counts and "stablehlo.if" not in counts, f"T={T} S={S}: a conditional"
        assert counts.get("stablehlo.while", 0) == (1 if weights == "stacked" else 0), counts.get("stablehlo.while")
        assert text.count(TRITON_CALL) == (2 if weights == "stacked" else 2 * L), text.count(TRITON_CALL)
        funcs = functions(text)
        if weights == "stacked":  # nothing of the step's metadata is recomputed in each turn of the scan
            inside = reachable(loop_body(funcs["main"]), funcs)
            assert not [f for f in inside if f.startswith(STEP_ONLY)], sorted(inside)
        else:  # once for all L layers
            assert sum(len(re.findall(rf"call @{name}\b", text)) for name in ("searchsorted", "cumsum")) == 2


@pytest.mark.parametrize("runner", ["stacked"], indirect=True)  # the sampler is the same for both forms
def test_every_host_sampler_variant_has_no_cond(runner):
    _, r, _ = runner
    from jaxsched.runner.batch import SAMPLER_I32, flat_sizes

    variants = r.sampler_variants
    assert len(variants) > 1 and all(v is not None for v in variants)  # "host": cond-free programs
    for S in sorted({S for _, S in r.bucket_pairs()}):
        _, n_f32 = flat_sizes(0, S)
        tables = tuple(jax.ShapeDtypeStruct(shape, dt) for shape, dt in r._table_shapes(S))
        args = (jax.ShapeDtypeStruct((S, r.model_config.vocab_size), "float32"),
                jax.ShapeDtypeStruct((len(SAMPLER_I32) * S,), "int32"), jax.ShapeDtypeStruct((n_f32,), "float32"),
                tables)
        for features in variants:
            text, seconds = lowered_text(functools.partial(r._sample, S=S, features=features), *args)
            counts = ops(text)
            print(f"sampler S={S} {sorted(features)}: {sum(counts.values())} StableHLO ops, lowered in {seconds:.2f} s")
            assert "stablehlo.case" not in counts and "stablehlo.if" not in counts, f"S={S} {sorted(features)}"


def test_the_checks_can_fail():
    """A cond in a program is counted, so the assertions above can see one."""
    text, _ = lowered_text(lambda x: jax.lax.cond(x.sum() > 0, lambda: x + 1, lambda: x - 1), jax.ShapeDtypeStruct((4,), "float32"))
    assert ops(text).get("stablehlo.case", 0) + ops(text).get("stablehlo.if", 0) == 1


def test_an_moe_program_has_no_cond_and_no_loop_but_the_layer_scan(model_dirs, monkeypatch):
    """A mixture of experts as a GPU runs it (grouped_matmul "ragged_dot", stacked layers): the
    experts' grouped matmuls are ragged dots, with no loop over experts or tiles and no conditional."""
    import dataclasses

    from jaxsched.platforms import platform as records

    monkeypatch.setattr(records, "CPU", dataclasses.replace(records.CPU, grouped_matmul="ragged_dot"))
    llm = LLM(model_dirs["qwen3_moe"], layer_weights="stacked", **ENGINE)
    r = llm.llm_engine.client.local_cores[0].runner
    as_on_a_gpu(monkeypatch)  # after the engine compiled its programs for this CPU
    T, S = r.bucket_pairs()[-1]
    n_i32 = r.compile.__func__.__globals__["flat_sizes"](T, S)[0]
    args = (sds(r._state_leaves), sds(r.kv), sds(r.block_table),
            jax.ShapeDtypeStruct((r.scheduler_config.max_num_seqs,), "int32"), jax.ShapeDtypeStruct((n_i32,), "int32"))
    text, seconds = lowered_text(functools.partial(r._forward, T=T, S=S), *args)
    counts = ops(text)
    print(f"moe stacked T={T} S={S}: {sum(counts.values())} StableHLO ops, lowered in {seconds:.2f} s")
    assert "stablehlo.case" not in counts and "stablehlo.if" not in counts
    assert counts.get("stablehlo.while", 0) == 1  # the layer scan
    assert text.count("ragged_dot") >= 2, "the experts' gate/up and down as grouped matmuls"


def test_a_gemma3_program_lowers_for_cuda_with_its_layer_groups(model_dirs, monkeypatch):
    """Gemma 3 as a GPU runs it: sliding and global layers in KV groups (core/kv_groups.py; the tiny
    one's 3 layers are 3 groups of one), each group's tables and metadata derived once a step, the
    layer scan picking its group's by index; the two Triton kernels, no conditional, one loop."""
    llm = LLM(model_dirs["gemma3"], layer_weights="stacked", **{**ENGINE, "num_gpu_blocks_override": 40})
    r = llm.llm_engine.client.local_cores[0].runner
    assert r.kv_groups.num_groups == 3 and r.kv[1].shape[0] == 1  # pages of one layer
    as_on_a_gpu(monkeypatch)  # after the engine compiled its programs for this CPU
    T, S = r.bucket_pairs()[-1]
    n_i32 = r.compile.__func__.__globals__["flat_sizes"](T, S)[0]
    args = (sds(r._state_leaves), sds(r.kv), sds(r.block_table),
            jax.ShapeDtypeStruct((r.scheduler_config.max_num_seqs,), "int32"), jax.ShapeDtypeStruct((n_i32,), "int32"))
    text, seconds = lowered_text(functools.partial(r._forward, T=T, S=S), *args)
    counts = ops(text)
    print(f"gemma3 stacked T={T} S={S}: {sum(counts.values())} StableHLO ops, lowered in {seconds:.2f} s")
    assert "stablehlo.case" not in counts and "stablehlo.if" not in counts
    assert counts.get("stablehlo.while", 0) == 1 and text.count(TRITON_CALL) == 2
    funcs = functions(text)
    inside = reachable(loop_body(funcs["main"]), funcs)
    assert not [f for f in inside if f.startswith(STEP_ONLY)], sorted(inside)
