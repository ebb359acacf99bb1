"""The architecture registry (jaxsched/models/registry.py) and the contract its model classes keep:
config adapters, the HF weight map of every class in both layer layouts, GGUF names, and a loader
that knows no architecture. Numerics are test_parity.py's (against transformers' PyTorch models)."""

from __future__ import annotations

import dataclasses
import inspect

import jax
import numpy as np
import pytest
import tiny
from conftest import MODEL_KINDS
from flax import nnx

from jaxsched.models import loader
from jaxsched.models.layers import LAYER_WEIGHTS
from jaxsched.models.registry import (
    ARCHITECTURES,
    architecture_of_gguf,
    model_class,
    model_config_from_hf,
)


def tiny_hf(kind: str, **overrides) -> dict:
    cfg = tiny.hf_config(kind, vocab_size=96, **overrides)
    return {**cfg.to_dict(), "architectures": [tiny.ARCHITECTURES[cfg.model_type]]}


def test_every_architecture_has_a_tiny_checkpoint_in_the_parity_tests():
    """A registry line comes with its tests: test_parity.py runs every kind of MODEL_KINDS. Gemma 3's
    image-text checkpoint is its text model under other names, checked against the Gemma3ForCausalLM
    it holds (test_a_gemma3_image_text_checkpoint_runs_its_text_model)."""
    covered = {tiny.ARCHITECTURES[tiny.hf_config(k, vocab_size=96).model_type] for k in MODEL_KINDS}
    assert covered | {"Gemma3ForConditionalGeneration"} == set(ARCHITECTURES)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_model_classes_keep_the_contract(kind):
    cfg = model_config_from_hf(tiny_hf(kind))
    cls = model_class(cfg.architecture)
    params = inspect.signature(cls.__init__).parameters
    assert list(params)[:3] == ["self", "cfg", "dtype"]
    assert {n: params[n].default for n in ("attention_backend", "layer_weights")} == \
        {"attention_backend": "xla", "layer_weights": None}
    assert params["rngs"].kind is inspect.Parameter.KEYWORD_ONLY
    model = cls(cfg, "float32", rngs=nnx.Rngs(0), attention_backend="numba", layer_weights="stacked")
    assert model.attention_backend == "numba" and model.layers.layout == "stacked"
    if ARCHITECTURES[cfg.architecture].gguf is not None:
        assert callable(cls.gguf_name) and callable(cls.from_gguf)


@pytest.mark.parametrize("layer_weights", LAYER_WEIGHTS)
@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_hf_weights_fill_exactly_the_models_state(kind, layer_weights):
    """Every array of the model comes from the checkpoint, with the model's own shapes (the
    abstract model refuses a pure dict with missing or extra entries), and is not the random init."""
    hf = tiny_hf(kind, attention_bias=True) if kind in ("llama", "gemma") else tiny_hf(kind)
    cfg = model_config_from_hf(hf)
    weights = tiny.random_weights(tiny.hf_config(kind, vocab_size=96, **(
        {"attention_bias": True} if kind in ("llama", "gemma") else {})), seed=1, bias_std=0.5)
    read: set[str] = set()

    def get(name: str) -> np.ndarray:
        read.add(name)
        return weights[name]

    loaded = nnx.state(loader.build_model(cfg, "float32", get, layer_weights=layer_weights))
    fresh = nnx.state(loader.build_model(cfg, "float32", None, layer_weights=layer_weights))
    shapes = jax.tree.map(lambda x: x.shape, (loaded, fresh))
    assert shapes[0] == shapes[1]
    assert read == set(weights) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    first_layer = (loaded["layers"]["stacked"] if layer_weights == "stacked" else loaded["layers"]["per_layer"][0])
    assert float(np.abs(np.asarray(loaded["embed"][...]) - np.asarray(fresh["embed"][...])).max()) > 0
    assert all(np.isfinite(np.asarray(v[...])).all() for v in first_layer.values())


def test_config_adapters_read_each_familys_differences():
    llama = model_config_from_hf(tiny_hf("llama", attention_bias=True))
    assert (llama.qkv_bias, llama.o_bias, llama.qk_norm) == (True, True, False)
    qwen2 = model_config_from_hf(tiny_hf("qwen2", sliding_window=64, use_sliding_window=False))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.sliding_window) == (True, False, None)
    qwen3 = model_config_from_hf(tiny_hf("qwen3"))
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 32)
    gemma = model_config_from_hf(tiny_hf("gemma"))
    assert (gemma.architecture, gemma.tie_word_embeddings, gemma.head_dim) == ("GemmaForCausalLM", True, 32)


def test_gemma_config_defaults_and_refusals():
    """GemmaConfig's defaults where config.json leaves keys out; what this engine cannot run is
    refused with a reason."""
    hf = tiny_hf("gemma")
    for key in ("tie_word_embeddings", "head_dim", "hidden_act", "max_position_embeddings"):
        hf.pop(key, None)
    cfg = model_config_from_hf(hf)
    assert (cfg.tie_word_embeddings, cfg.head_dim, cfg.max_position_embeddings) == (True, 256, 8192)
    assert model_config_from_hf({**hf, "hidden_act": "gelu"}).architecture == "GemmaForCausalLM"
    with pytest.raises(ValueError, match="hidden_act 'silu' is not supported"):
        model_config_from_hf({**hf, "hidden_act": "silu"})
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        model_config_from_hf({**hf, "use_bidirectional_attention": True})


def test_gguf_architecture_names():
    assert [architecture_of_gguf(n) for n in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")] == \
        ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM",
         "Gemma3ForCausalLM"]
    with pytest.raises(ValueError, match="unknown GGUF architecture 'gemma'; supported: llama, mistral"):
        architecture_of_gguf("gemma")
    with pytest.raises(ValueError, match="unknown GGUF architecture None"):
        architecture_of_gguf(None)


def test_loader_names_no_architecture():
    """Adding an architecture is its model file and a registry line: the loader stays generic."""
    source = inspect.getsource(loader)
    for word in ("ForCausalLM", "Llama", "Qwen", "Mistral", "Gemma", "q_proj", "model.layers"):
        assert word not in source, word


def test_a_qwen_window_is_taken_for_every_layer_or_none():
    """transformers' rule: use_sliding_window, and then the layers from max_window_layers on."""
    hf = tiny_hf("qwen2", sliding_window=64, use_sliding_window=True)
    assert model_config_from_hf({**hf, "max_window_layers": 0}).sliding_window == 64
    assert model_config_from_hf({**hf, "max_window_layers": hf["num_hidden_layers"]}).sliding_window is None
    with pytest.raises(ValueError, match="a sliding window in layers 1 to 1 only"):
        model_config_from_hf({**hf, "max_window_layers": 1})


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_a_gemma_gguf_file_holds_the_same_model(kind, tokenizer_dir, tmp_path):
    """llama.cpp's Gemma 2 and 3 layout (tests/tiny_gguf.py, named by the gguf package's own map):
    norms stored as 1 + w come back as w, the windows, layer kinds, soft-caps, rope bases and the
    attention scale read from the metadata give the folder's config, and the greedy tokens match.
    The folder's attention scale is 1 / sqrt(head_dim), the only one llama.cpp has below 27B."""
    import tiny_gguf

    from jaxsched import LLM, SamplingParams
    from jaxsched.models.loader import load_model_source

    folder = tiny.build_model(str(tmp_path / kind), kind, tokenizer_dir, seed=4, query_pre_attn_scalar=32)
    path = tiny_gguf.write_gemma_gguf(str(tmp_path / f"{kind}.gguf"), folder)
    folder_cfg, folder_get, _ = load_model_source(folder)
    cfg, get, source = load_model_source(path)
    assert source == "gguf"
    # GGUF metadata has no dtype, holds eps in float32, and bos/eos come from the vocabulary; the rest
    # is the folder's
    assert cfg.rms_norm_eps == pytest.approx(folder_cfg.rms_norm_eps, rel=1e-6)
    assert dataclasses.replace(cfg, dtype=folder_cfg.dtype, bos_token_id=folder_cfg.bos_token_id,
                               eos_token_ids=folder_cfg.eos_token_ids, rms_norm_eps=folder_cfg.rms_norm_eps) == folder_cfg
    for name in ["model.embed_tokens.weight", "model.norm.weight", *(
            f"model.layers.{i}.{n}.weight" for i in range(cfg.num_layers) for n in (
                "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm", "self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj",
                *(("self_attn.q_norm", "self_attn.k_norm") if kind == "gemma3" else ())))]:
        np.testing.assert_allclose(get(name), folder_get(name), rtol=0, atol=1e-6, err_msg=name)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = {"max_model_len": 64, "max_num_seqs": 4, "max_num_batched_tokens": 32, "block_size": 16}
    prompt = [{"prompt_token_ids": [5, 17, 42, 9, 33, 8, 61, 12, 90, 4, 7]}]  # past the 8-token window
    assert LLM(path, **kw).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == \
        LLM(folder, **kw).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def test_gemma_gguf_metadata_takes_llama_cpps_fixed_values():
    """What llama.cpp fixes rather than writes: Gemma 3's five sliding layers in six and local rope
    base 10,000 (from the config adapter's defaults), and the attention scale of head_dim, or of
    hidden / heads in the 27B models (told apart by their layer count, as llama.cpp does)."""
    from jaxsched.models.gemma import gemma_gguf_meta

    def read(layers: int, hidden: int, heads: int, arch: str = "gemma3"):
        hf = {"architectures": ["Gemma3ForCausalLM" if arch == "gemma3" else "Gemma2ForCausalLM"],
              "num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
              "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 4 * hidden, "vocab_size": 1000,
              "rope_theta": 1e6}
        meta = {"attention.sliding_window": 512, "attn_logit_softcapping": 50.0}
        return model_config_from_hf({**hf, **gemma_gguf_meta(arch, meta.get, hf)})

    small = read(26, 1152, 4)  # Gemma 3 1B
    assert small.sliding_window == 512 and small.rope_local_theta == 10000.0 and small.rope_theta == 1e6
    assert [i for i in range(26) if small.layer_window(i) is None] == [5, 11, 17, 23]
    assert small.query_pre_attn_scalar == 256 and small.attn_softcap == 50.0
    assert read(62, 5376, 32).query_pre_attn_scalar == 168  # Gemma 3 27B
    assert read(46, 4608, 32, "gemma2").query_pre_attn_scalar == 144  # Gemma 2 27B
    gemma2 = read(42, 3584, 16, "gemma2")  # Gemma 2 9B
    assert gemma2.query_pre_attn_scalar == 256 and gemma2.sliding_layers == tuple(range(0, 42, 2))


def test_quantized_gguf_tensors_load_as_the_gguf_package_dequantizes_them(tokenizer_dir, tmp_path):
    """K-quants (Q4_K, Q5_K, Q6_K) and the older kinds (Q8_0, Q5_0, Q4_1) in one tiny Llama GGUF:
    each tensor the model reads is the gguf package's dequantization of the file's blocks (q/k rows
    un-permuted), and the model generates from them; a kind the package cannot dequantize is
    refused naming it and the tensor."""
    import gguf
    import tiny_gguf

    from jaxsched import LLM, SamplingParams
    from jaxsched.models.loader import load_model_source

    folder = tiny.build_model(str(tmp_path / "llama"), "llama", tokenizer_dir, seed=2, hidden_size=256,
                              intermediate_size=256, num_hidden_layers=1)
    quant = {"blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q5_K", "blk.0.attn_v.weight": "Q6_K",
             "blk.0.attn_output.weight": "Q8_0", "blk.0.ffn_gate.weight": "Q5_0", "blk.0.ffn_up.weight": "Q4_1",
             "blk.0.ffn_down.weight": "Q6_K"}
    path = tiny_gguf.write_llama_gguf(str(tmp_path / "q.gguf"), folder, quant=quant)
    hf_names = {f"blk.0.{v}": f"model.layers.0.{k}" for k, v in tiny_gguf._LAYER.items()}
    cfg, get, _ = load_model_source(path)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for gname, kind in quant.items():
        t = tensors[gname]
        assert t.tensor_type.name == kind
        got = get(hf_names[gname])
        if gname.endswith(("attn_q.weight", "attn_k.weight")):  # back to the file's row order
            got = tiny_gguf._rope_permute(got, cfg.num_heads)
        np.testing.assert_array_equal(got, gguf.dequantize(t.data, t.tensor_type), err_msg=gname)
        assert 0 < np.abs(got).max() < 10
    out = LLM(path, max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16, block_size=16).generate(
        [{"prompt_token_ids": [5, 17, 42]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1),
        use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and all(np.isfinite(lp[t].logprob) for lp, t in zip(out.logprobs, out.token_ids))
    bad = tiny_gguf.write_llama_gguf(str(tmp_path / "bad.gguf"), folder, quant={"blk.0.attn_q.weight": "Q8_1"})
    with pytest.raises(ValueError, match=r"'blk.0.attn_q.weight' of the GGUF file is quantized as Q8_1"):
        load_model_source(bad)[1]("model.layers.0.self_attn.q_proj.weight")


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])
def test_a_gemma3_image_text_checkpoint_runs_its_text_model(prefix, model_dirs, tmp_path):
    """Gemma 3 4B to 27B come as Gemma3ForConditionalGeneration: config.json's text_config and the
    text model's tensors under `prefix` beside a vision tower that is not read. The engine runs the
    text model: its config and greedy tokens are those of the same weights as a Gemma3ForCausalLM.
    A released config's text_config names only what differs from Gemma3TextConfig's defaults: the
    4B model's reads as that model."""
    import json
    import os
    import shutil

    from safetensors.numpy import load_file, save_file

    from jaxsched import LLM, SamplingParams
    from jaxsched.models.loader import load_model_source

    src = model_dirs["gemma3"]
    with open(os.path.join(src, "config.json")) as f:
        text = json.load(f)
    text.pop("architectures")
    folder = tmp_path / "gemma3-it"
    shutil.copytree(src, folder, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    with open(folder / "config.json", "w") as f:
        json.dump({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
                   "vision_config": {"hidden_size": 16}, "eos_token_id": [2, 5]}, f)
    tensors = {prefix + k.removeprefix("model."): v for k, v in load_file(os.path.join(src, "model.safetensors")).items()}
    tensors["vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.zeros((4, 3, 2, 2), np.float32)
    save_file(tensors, str(folder / "model.safetensors"))
    cfg, _, _ = load_model_source(str(folder))
    want, _, _ = load_model_source(src)
    assert cfg.architecture == "Gemma3ForConditionalGeneration" and cfg.eos_token_ids == (2, 5)
    assert dataclasses.replace(cfg, architecture=want.architecture, eos_token_ids=want.eos_token_ids) == want
    four_b = model_config_from_hf({  # google/gemma-3-4b-it's config.json, less its vision_config
        "architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106], "text_config": {
            "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}})
    assert (four_b.num_heads, four_b.num_kv_heads, four_b.head_dim, four_b.vocab_size) == (8, 4, 256, 262208)
    assert (four_b.rope_theta, dict(four_b.rope_scaling), four_b.rope_local_theta) == (
        1e6, {"factor": 8.0, "rope_type": "linear"}, 10000.0)
    assert four_b.sliding_window == 1024 and [i for i in range(34) if four_b.layer_window(i) is None] == [
        5, 11, 17, 23, 29] and four_b.eos_token_ids == (1, 106) and four_b.query_pre_attn_scalar == 256
    kw = {"max_model_len": 64, "max_num_seqs": 2, "max_num_batched_tokens": 16, "block_size": 8}
    prompt = [{"prompt_token_ids": [5, 17, 42, 9, 33, 8, 61, 12, 90, 4, 7]}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert LLM(str(folder), **kw).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == \
        LLM(src, **kw).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
