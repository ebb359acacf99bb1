"""Mixture of experts (jaxsched/models/moe.py): the router against transformers' rule, both grouped
matmuls against a dense all-experts reference (empty experts, every token on one expert), the step
program holding no dense [T, E, ...] expert tensor, and greedy tokens that do not depend on how many
rows share a step. (Logits and tokens against transformers: test_parity.py's qwen3_moe and mixtral;
expert parallelism: test_tensor_parallel.py.)"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
import tiny
from compiles import no_compilation
from test_parity import SENTENCES

from jaxsched import LLM, SamplingParams
from jaxsched.models import moe

D, F, E, K = 16, 8, 6, 2


def dense_reference(x, weights, experts, gate_up, down):
    """Every expert on every token, then each token's k picked and weighted: the obvious form."""
    g, u = np.split(np.einsum("td,edf->etf", x, gate_up), 2, axis=-1)
    y = np.einsum("etf,efd->etd", g / (1 + np.exp(-g)) * u, down)  # [E, T, D]
    return np.stack([sum(weights[t, j] * y[experts[t, j], t] for j in range(experts.shape[1]))
                     for t in range(x.shape[0])])


def weights_of(rng):
    return (rng.standard_normal((E, D, 2 * F)).astype(np.float32), rng.standard_normal((E, F, D)).astype(np.float32))


@pytest.mark.parametrize("how", moe.GROUPED_MATMULS)
@pytest.mark.parametrize("T", [1, 5, 40])
def test_grouped_matmuls_equal_the_dense_reference(how, T):
    rng = np.random.default_rng(T)
    x = rng.standard_normal((T, D)).astype(np.float32)
    gate_up, down = weights_of(rng)
    # experts 4 and 5 never chosen (empty groups); duplicates across tokens
    experts = rng.integers(0, 4, (T, K)).astype(np.int32)
    experts[:, 1] = (experts[:, 0] + 1) % 4
    weights = rng.random((T, K)).astype(np.float32)
    got = jax.jit(moe.experts_mlp, static_argnames="how")(x, weights, experts, gate_up, down, how=how)
    np.testing.assert_allclose(np.asarray(got), dense_reference(x, weights, experts, gate_up, down),
                               rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("how", moe.GROUPED_MATMULS)
def test_every_token_on_one_expert_and_experts_held_elsewhere(how):
    rng = np.random.default_rng(1)
    T = 17  # more rows than one tile: several tiles of one expert
    x = rng.standard_normal((T, D)).astype(np.float32)
    gate_up, down = weights_of(rng)
    experts = np.full((T, K), 3, np.int32)
    experts[:, 1] = 0
    weights = rng.random((T, K)).astype(np.float32)
    want = dense_reference(x, weights, experts, gate_up, down)
    got = moe.experts_mlp(x, weights, experts, gate_up, down, how)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    # a device holding experts [3, 6) only: expert 0's pairs add nothing there
    local = moe.experts_mlp(x, weights, experts, gate_up[3:], down[3:], how, first=3)
    only3 = dense_reference(x, weights * (experts == 3), experts, gate_up, down)
    np.testing.assert_allclose(np.asarray(local), only3, rtol=2e-5, atol=2e-5)


def test_routing_is_transformers_rule():
    """Softmax in float32, top-k, the k weights renormalised only when asked; Mixtral's softmax over
    the top-k logits is the same. Exact ties go to the lower expert id: torch.topk, which transformers
    uses, leaves the order of equal values unspecified (on this CPU it takes [0, 1] from
    [3, 1, 1, 0]'s tie but [2, 3] from four equal values), so no rule can match it everywhere."""
    h = np.eye(4, dtype=np.float32)
    router = np.array([[3.0, 1.0, 1.0, 0.0],  # token 0: expert 0, then a tie of 1 and 2 -> 1
                       [0.0, 0.0, 0.0, 0.0],  # token 1: all tied -> 0 and 1
                       [0.0, 2.0, 5.0, 2.0],  # token 2: 2, then the tie of 1 and 3 -> 1
                       [1.0, 1.0, 1.0, 4.0]], np.float32)  # rows are tokens' logits: h = I
    w, e = moe.route(h, router, 2, normalize=False)
    assert np.asarray(e).tolist() == [[0, 1], [0, 1], [2, 1], [3, 0]]
    probs = np.exp(router) / np.exp(router).sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(w), np.take_along_axis(probs, np.asarray(e), 1), rtol=1e-6)
    wn, _ = moe.route(h, router, 2, normalize=True)
    top = np.take_along_axis(router, np.asarray(e), 1)
    mixtral = np.exp(top) / np.exp(top).sum(-1, keepdims=True)  # softmax after top-k
    np.testing.assert_allclose(np.asarray(wn), mixtral, rtol=1e-6)


@pytest.fixture(scope="module")
def moe_llm(model_dirs):
    return LLM(model_dirs["qwen3_moe"], max_model_len=128, max_num_seqs=32, max_num_batched_tokens=48,
               block_size=16)


def test_the_step_program_holds_no_dense_expert_tensor(moe_llm):
    """No [T, E, ...] or [E, T k, ...] array: the experts run on grouped rows (8 experts, 2 a token,
    T = 48, unlike every weight's sizes: a dense pass would hold [8, 48, ...] or [8, 96, ...] somewhere;
    with grouped_matmul "ragged_dot" on this CPU it holds [8, 96, 32])."""
    runner = moe_llm.llm_engine.core.runner
    assert moe_llm.llm_engine.model_config.num_experts == 8
    assert (48, 32) in runner.bucket_pairs()
    text = runner._executables[(48, 32)].as_text()
    # tokens (48) or (token, expert) pairs (96) beside all 8 experts: what jax's ragged_dot is on a CPU
    dense = re.findall(r"\[(?:8,48|48,8|8,96|96,8),\d+\]", text)
    assert not dense, dense[:5]
    assert "[8,64,64]" in text  # the experts' stacked gate/up weights: the pattern reads shapes
    assert "while" in text  # the tiles' loop (the CPU's grouped matmul)


def test_greedy_tokens_do_not_depend_on_the_rows_in_a_step_of_32(moe_llm):
    tok = moe_llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(SENTENCES[i % len(SENTENCES)])[: 3 + i % 9]} for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with no_compilation():
        together = [o.outputs[0].token_ids for o in moe_llm.generate(prompts, params, use_tqdm=False)]
        alone = [moe_llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:6]]
    assert together[:6] == alone
    assert len({t for ids in together for t in ids}) > 8  # not a degenerate model


@pytest.mark.slow  # ~3 min: warm-up compiles some 40 bucket pairs up to 256 rows
def test_greedy_tokens_do_not_depend_on_the_rows_in_a_step(model_dirs):
    """256 requests decoding in one step (every expert busy, tiles of many rows) give each request the
    tokens it gets alone (a step of one row, one tile per expert)."""
    llm = LLM(model_dirs["qwen3_moe"], max_model_len=64, max_num_seqs=256, max_num_batched_tokens=256,
              block_size=16, step_cost_model=False)
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(SENTENCES[i % len(SENTENCES)])[: 1 + i % 9] + [3 + i % 200]}
               for i in range(256)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with no_compilation():
        together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[::37]]
    assert llm.llm_engine.stats().num_preemptions == 0
    assert together[::37] == alone
    assert len({t for ids in together for t in ids}) > 8  # not a degenerate model


def test_a_config_mixing_dense_and_moe_layers_is_refused():
    from jaxsched.models.registry import model_config_from_hf

    hf = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 4, "num_attention_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
          "moe_intermediate_size": 4, "mlp_only_layers": [1]}
    with pytest.raises(ValueError, match=r"dense MLP layers \(\[1\]"):
        model_config_from_hf(hf)
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(5\) must be in \[1, 4\]"):
        model_config_from_hf({**hf, "mlp_only_layers": [], "num_experts_per_tok": 5})
    assert model_config_from_hf({**hf, "mlp_only_layers": []}).num_experts == 4


def test_experts_must_divide_over_the_devices():
    from jaxsched.models.registry import model_config_from_hf
    from jaxsched.parallel.mesh import head_layout

    cfg = model_config_from_hf({"architectures": ["MixtralForCausalLM"], "vocab_size": 10, "hidden_size": 8,
                                "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                                "num_local_experts": 3, "num_experts_per_tok": 2})
    with pytest.raises(ValueError, match=r"num_experts \(3\) must be a multiple of tensor_parallel_size \(2\)"):
        head_layout(cfg, 2)


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_a_gguf_file_holds_the_same_model(kind, model_dirs, tmp_path):
    """llama.cpp's layout (tests/tiny_gguf.py): Qwen2-MoE as "qwen2moe" (its shared expert's gate a
    [D] vector), Qwen3-MoE as "qwen3moe", Mixtral as "llama" with experts, each layer's experts
    stacked per projection: every tensor the model reads equals the folder's, the routing's
    renormalisation is the architecture's (llama.cpp writes no key for it), and the greedy tokens
    match."""
    import tiny_gguf

    from jaxsched.models.loader import load_model_source

    path = tiny_gguf.write_llama_gguf(str(tmp_path / f"{kind}.gguf"), model_dirs[kind])
    folder_cfg, folder_get, _ = load_model_source(model_dirs[kind])
    cfg, get, source = load_model_source(path)
    assert source == "gguf" and cfg.architecture == folder_cfg.architecture
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (
        folder_cfg.num_experts, folder_cfg.num_experts_per_tok, folder_cfg.moe_intermediate_size,
        folder_cfg.norm_topk_prob)
    assert cfg.shared_expert_intermediate_size == folder_cfg.shared_expert_intermediate_size
    names = [f"model.layers.1.{n.format(j=j)}.weight" for n in tiny.MOE_NAMES[kind][1:]
             for j in range(cfg.num_experts)] + [f"model.layers.0.{tiny.MOE_NAMES[kind][0]}.weight",
                                                 "model.layers.0.self_attn.q_proj.weight"]
    if cfg.shared_expert_intermediate_size:
        names += [f"model.layers.0.mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")]
        names += ["model.layers.0.mlp.shared_expert_gate.weight"]
    for name in names:
        np.testing.assert_array_equal(get(name), folder_get(name), err_msg=name)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kw = {"max_model_len": 64, "max_num_seqs": 4, "max_num_batched_tokens": 32, "block_size": 16}
    prompt = [{"prompt_token_ids": [5, 17, 42, 9, 33]}]
    assert LLM(path, **kw).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == \
        LLM(model_dirs[kind], **kw).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
