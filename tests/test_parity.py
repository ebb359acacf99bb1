"""Parity with Hugging Face transformers' PyTorch models, the ground truth nobody here wrote.

Logits: every step of a chunked, batched run (prefill chunks over cached prefixes and decodes) is
compared with transformers' full forward at the same positions, to 1e-4 relative.
Greedy tokens: LLM.generate over 8+ prompts of different lengths at once equals
model.generate(do_sample=False) per prompt, with continuous batching, chunked prefill with a small
token budget, and preemption with a small pool switched on in different cases.
The reference is PyTorch: those tests carry `needs_torch` (skipped where the `parity` extra is not
installed); the module itself imports without torch, as others import its prompts and helpers.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny
import transformers as tf
from conftest import MODEL_KINDS
from flax import nnx

from jaxsched import LLM, SamplingParams
from jaxsched.config import SchedulerConfig
from jaxsched.core.block_manager import BlockManager, cdiv
from jaxsched.core.buckets import seq_buckets, token_buckets
from jaxsched.core.kv_groups import kv_groups
from jaxsched.core.request import Request
from jaxsched.core.request import SamplingParams as SP
from jaxsched.core.scheduler import Scheduler
from jaxsched.models.layers import LAYER_WEIGHTS
from jaxsched.models.loader import build_model, load_model_source
from jaxsched.runner.batch import BatchDescriptor, BatchPacker
from jaxsched.runner.block_table import group_tables, step_block_tables
from pallas_kernels import backends

SENTENCES = [
    "the capital of france is",
    "hello",
    "one two three four five six seven eight nine ten . the capital of france is paris .",
    "what is a cat ?",
    "dogs and cats like to play in the sun . language models predict the next token",
    "jax runs on gpus and cpus",
    "numbers 12345 67890",
    "how are you today ? hello world , how are you today ? one two three",
    "é ü ñ 你好 世界",
]


def hf_model(folder: str):
    import torch

    return tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


@tiny.needs_torch
@pytest.mark.parametrize("kind", [*MODEL_KINDS, "llama-every-bias"])
def test_tiny_checkpoints_load_into_transformers_whole(kind, model_dirs, tokenizer_dir, tmp_path):
    """tiny.py writes the checkpoints without torch: transformers must find every tensor it expects
    under its own names and shapes, and nothing else, and hold exactly the saved values."""
    import torch
    from safetensors.numpy import load_file

    if kind == "llama-every-bias":
        folder = tiny.build_model(str(tmp_path / kind), "llama", tokenizer_dir, seed=7, bias_std=0.5,
                                  attention_bias=True, mlp_bias=True)
    else:
        folder = model_dirs[kind]
    model, info = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info  # missing, unexpected, mismatched keys, errors
    with open(os.path.join(folder, "config.json")) as f:
        assert type(model).__name__ == json.load(f)["architectures"][0]
    assert model.dtype == torch.float32
    saved = as_transformers_holds_them(load_file(os.path.join(folder, "model.safetensors")), model.config)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    assert set(saved) <= set(state) and set(state) - set(saved) <= {"lm_head.weight"}
    for name, value in saved.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)
    if model.config.tie_word_embeddings:
        np.testing.assert_array_equal(state["lm_head.weight"], saved["model.embed_tokens.weight"])


def as_transformers_holds_them(saved: dict[str, np.ndarray], cfg) -> dict[str, np.ndarray]:
    """A checkpoint's tensors under the names and shapes of transformers 5's modules: an MoE layer's
    experts, saved one tensor per expert and projection (as released checkpoints are), are held as
    stacked gate_up_proj [E, 2 F, D] and down_proj [E, D, F] beside the router mlp.gate."""
    if cfg.model_type not in tiny.MOE_NAMES:
        return saved
    router, gate, up, down = tiny.MOE_NAMES[cfg.model_type]
    out = dict(saved)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        E = range(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
        out[p + "mlp.gate.weight"] = out.pop(p + router + ".weight")
        out[p + "mlp.experts.gate_up_proj"] = np.stack([np.concatenate(
            [out.pop(p + gate.format(j=j) + ".weight"), out.pop(p + up.format(j=j) + ".weight")]) for j in E])
        out[p + "mlp.experts.down_proj"] = np.stack([out.pop(p + down.format(j=j) + ".weight") for j in E])
    return out


@tiny.needs_torch
@pytest.mark.parametrize("layer_weights", LAYER_WEIGHTS)
@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_logits_match_transformers(kind, layer_weights, model_dirs, tokenizer_dir):
    """Both weight layouts (layers.py), whichever one this platform uses by default."""
    check_logits(model_dirs[kind], layer_weights, tokenizer_dir)


@tiny.needs_torch
@pytest.mark.parametrize("layer_weights", LAYER_WEIGHTS)
@pytest.mark.parametrize("num_layers", [1, 3])
def test_logits_match_transformers_with_every_bias(num_layers, layer_weights, tokenizer_dir, tmp_path):
    """Llama with attention_bias and mlp_bias (q/k/v, o, gate/up and down biases: every optional
    weight the per-layer switch branches carry), one layer (the last branch is also the first) and
    three. transformers initialises biases to zero, so these are drawn at random to count."""
    folder = tiny.build_model(str(tmp_path / "bias"), "llama", tokenizer_dir, seed=7, bias_std=0.5,
                              attention_bias=True, mlp_bias=True, num_hidden_layers=num_layers)
    cfg, get, _ = load_model_source(folder)
    assert min(np.abs(get(f"model.layers.0.{n}.bias")).max() for n in (
        "self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")) > 0.1
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias, cfg.num_layers) == (True, True, True, num_layers)
    check_logits(folder, layer_weights, tokenizer_dir)


def check_logits(folder: str, layer_weights: str, tokenizer_dir: str) -> None:
    """Every step of a chunked, batched run of 5 prompts against transformers' full forward."""
    import torch

    cfg, get, _ = load_model_source(folder)
    model = build_model(cfg, "float32", get, layer_weights=layer_weights)
    assert model.layers.layout == layer_weights
    graphdef, state = nnx.split(model)
    tok = tf.AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = [tok.encode(s) for s in SENTENCES[:5]]
    P, budget, max_len = 8, 16, 128
    M = cdiv(max_len, P)
    groups = kv_groups(cfg)  # a sliding-window model's layer groups, as the engine runs them
    bm = BlockManager(128, P, groups=groups)
    sched = Scheduler(SchedulerConfig(4, budget, max_len, True, token_buckets(budget), seq_buckets(4)), bm)
    packer = BatchPacker(budget, 4, M, P, groups=groups)
    for i, ids in enumerate(prompts):
        sched.add_request(Request(str(i), ids, SP(max_tokens=6)))
    kv = tuple(jnp.zeros(s) for s in backends.get(model.attention_backend).pool_shapes(
        groups.size, 128, cfg.num_kv_heads, P, cfg.head_dim))

    table = jnp.zeros(packer.tables.mirror.shape, jnp.int32)

    @functools.partial(jax.jit, static_argnums=(5, 6))
    def forward(state, kv, table, fi, ff, T, S):
        batch = BatchDescriptor.from_flat(fi, ff, T, S)
        table, batch.block_tables = step_block_tables(table, batch)
        if groups.num_groups > 1:
            batch.block_tables, batch.slot_mapping = group_tables(batch.block_tables, batch, groups.num_groups, P)
        logits, kv = nnx.merge(graphdef, state)(kv, batch)
        return logits, kv, table
    seen: list[tuple[Request, int, np.ndarray]] = []  # (request, position, our logits)
    n_steps = 0
    trimmed_pages = [0]
    while sched.has_unfinished_requests():
        out = sched.schedule()
        trimmed_pages[0] += sum(bm.trimmed(rid) for rid in out.scheduled)
        batch = packer.pack(out)
        assert batch.table_overflow is None
        logits, kv, table = forward(state, kv, table, batch.flat_i32, batch.flat_f32, out.token_bucket, out.seq_bucket)
        logits = np.asarray(logits)
        for i, row in enumerate(out.scheduled.values()):
            # the scheduler counts a row's tokens as computed when it schedules them: its last is at - 1
            seen.append((row.request, row.request.num_computed_tokens - 1, logits[i]))
        sched.update(out, logits[: out.num_seqs].argmax(-1))
        bm.check_invariants()
        n_steps += 1
    assert n_steps > 8  # chunked prefills, then decodes
    if groups.sliding:  # the windows (8 tokens) passed pages that went back to the pool
        assert trimmed_pages[0] > 0
    ref = hf_model(folder)
    worst = 0.0
    for req in {id(r): r for r, _, _ in seen}.values():
        full = req.prompt_token_ids + req.output_token_ids
        with torch.no_grad():
            hf_logits = ref(torch.tensor([full])).logits[0].numpy()
        for r, pos, ours in seen:
            if r is req:
                want = hf_logits[pos]
                worst = max(worst, float(np.abs(ours - want).max() / np.abs(want).max()))
    assert worst < 1e-4, f"max relative logit error {worst:.2e}"


# (kind, engine args, layer weights): each family once, the hard settings spread across them; the
# platform's layer weights layout (None) unless one is named.
GENERATE_CASES = [
    ("llama", {"max_num_batched_tokens": 128}, None),  # ample budget and pool: continuous batching
    ("llama3", {"max_num_batched_tokens": 16}, None),  # chunked prefill with a small token budget
    ("mistral", {"max_num_batched_tokens": 64, "num_gpu_blocks_override": 9}, None),  # preemption, small pool
    ("qwen2", {"max_num_batched_tokens": 16, "num_gpu_blocks_override": 11}, None),  # chunked + preemption
    ("qwen3", {"max_num_batched_tokens": 24, "num_gpu_blocks_override": 10}, None),  # chunked + preemption
    # the architecture outside the Llama family, in both layouts (the engine has no option for it)
    ("gemma", {"max_num_batched_tokens": 16, "num_gpu_blocks_override": 11}, "per_layer"),  # chunked + preemption
    ("gemma", {"max_num_batched_tokens": 128}, "stacked"),
    # mixtures of experts: chunked prefill and preemption, and continuous batching in the GPU's layout
    ("qwen3_moe", {"max_num_batched_tokens": 16, "num_gpu_blocks_override": 11}, None),
    ("mixtral", {"max_num_batched_tokens": 128}, "stacked"),
    ("qwen2_moe", {"max_num_batched_tokens": 32}, "unrolled"),  # the shared expert beside them
    # sliding and global layers whose windows (8 tokens) free pages: chunked prefill, preemption
    ("gemma2", {"max_num_batched_tokens": 16, "num_gpu_blocks_override": 20}, None),
    ("gemma3", {"max_num_batched_tokens": 16, "num_gpu_blocks_override": 24}, "stacked"),
    ("gemma3", {"max_num_batched_tokens": 64, "num_gpu_blocks_override": 26, "preemption_mode": "swap",
                "swap_space": 0.001}, "per_layer"),
]


@tiny.needs_torch
@pytest.mark.parametrize("kind,engine_args,layer_weights", GENERATE_CASES,
                         ids=[c[0] + (f"-{c[2]}" if c[2] else "") for c in GENERATE_CASES])
def test_greedy_generation_matches_transformers(kind, engine_args, layer_weights, model_dirs, monkeypatch):
    folder = model_dirs[kind]
    if layer_weights is not None:  # what the platform record picks for "auto" on a CPU, or the other layouts
        engine_args = {**engine_args, "layer_weights": layer_weights}
    llm = LLM(folder, max_model_len=96, max_num_seqs=8, block_size=8, **engine_args)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(s) for s in SENTENCES]
    lens = [3 + 2 * i for i in range(len(prompts))]  # different output lengths, so requests leave at different steps
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ref = hf_model(folder)
    for p, n, o in zip(prompts, lens, outs):
        assert o.outputs[0].token_ids == hf_greedy(ref, p, n), f"prompt {tok.decode(p)!r}"
        assert o.outputs[0].finish_reason == "length"
    eng = llm.llm_engine
    if "num_gpu_blocks_override" in engine_args:
        assert eng.core.scheduler.num_preemptions > 0, "the small pool should have forced preemption"
    assert eng.core.block_manager.num_free_blocks == eng.core.block_manager.num_usable_blocks
    if layer_weights is not None:
        assert eng.config.layer_weights == layer_weights


def test_unknown_layer_weights_layout_is_refused(model_dirs):
    cfg, get, _ = load_model_source(model_dirs["llama"])
    with pytest.raises(ValueError, match="layer_weights must be one of"):
        build_model(cfg, "float32", get, layer_weights="scanned")


@tiny.needs_torch
@pytest.mark.parametrize("layer_weights", ["stacked", "per_layer"])
def test_a_sliding_window_matches_transformers(layer_weights, tokenizer_dir, tmp_path):
    """Mistral with a 12-token window (prompts of up to 60 tokens, chunked): every step's logits (the
    'xla' backend), and an engine's greedy tokens (the CPU's default backend, numba)."""
    folder = tiny.build_model(str(tmp_path / "mistral-window"), "mistral", tokenizer_dir, seed=3, sliding_window=12)
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["sliding_window"] == 12
    check_logits(folder, layer_weights, tokenizer_dir)
    llm = LLM(folder, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=16, block_size=8,
              layer_weights=layer_weights)
    assert llm.llm_engine.config.attention_backend == "numba"
    assert llm.llm_engine.config.checkpoint_model.sliding_window == 12
    tok = llm.get_tokenizer()
    prompts = [tok.encode(s) for s in SENTENCES[2:6]]
    assert max(map(len, prompts)) > 24  # the window is passed well within the prompts
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    ref = hf_model(folder)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(ref, p, 8) for p in prompts]
    # a window no shorter than the context is dropped: the model runs without its masks
    wide = LLM(folder, max_model_len=12, max_num_seqs=4, max_num_batched_tokens=16, block_size=8)
    assert wide.llm_engine.config.checkpoint_model.sliding_window is None
