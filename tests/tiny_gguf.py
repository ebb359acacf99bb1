"""Tiny GGUF files for tests, written with the `gguf` package as llama.cpp's converter lays them out:
a tiny Hugging Face Llama, Mixtral (llama.cpp's "llama" with experts) or Qwen3-MoE ("qwen3moe") folder
(tests/tiny.py) with its byte-level BPE tokenizer ("gpt2" model), and metadata-only files of a
SentencePiece-style vocabulary ("llama" model) for tokenizer tests."""

from __future__ import annotations

import json
import os

import numpy as np

# HF tensor name suffix -> llama.cpp's (the inverse of jaxsched/models/llama.py's map)
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
}
# an MoE model_type -> llama.cpp's architecture (its router and experts, stacked [E, ...] per projection,
# are written from the HF names tests/tiny.py gives them)
_MOE = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}

_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def _rope_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter reorders q/k rows from HF's rotate-half layout to interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _bpe_tokenizer_metadata(tokenizer_folder: str) -> dict:
    """tokens (by id), merges and token types of a byte-level BPE tokenizer.json."""
    with open(os.path.join(tokenizer_folder, "tokenizer.json")) as f:
        spec = json.load(f)
    vocab = dict(spec["model"]["vocab"])
    special = set()
    for t in spec["added_tokens"]:
        vocab[t["content"]] = t["id"]
        if t["special"]:
            special.add(t["content"])
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "token ids must be dense"
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    types = [3 if t in special else 1 for t in tokens]  # CONTROL / NORMAL
    return {"tokens": tokens, "merges": merges, "types": types}


# where llama.cpp's K-quant blocks (of 256 values) hold their float16 scales
_K_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(rows: int, cols: int, kind: str, rng) -> np.ndarray:
    """Random blocks of a GGML type ([rows, cols / block * bytes] uint8), a K-quant's scales small
    (2e-4) so the weights they hold are of the size of a model's: the gguf package dequantizes
    K-quants but does not quantize to them."""
    import gguf

    values, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    blocks = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    for at in _K_SCALES.get(kind, ()):
        blocks[..., at : at + 2] = np.frombuffer(np.float16(2e-4).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def write_llama_gguf(path: str, model_folder: str, pre: str = "smollm", quant: dict[str, str] | None = None) -> str:
    """The tiny Llama (or Mixtral, Qwen3-MoE) of `model_folder` (config.json, *.safetensors,
    tokenizer) as a float32 GGUF; `quant` (llama.cpp tensor name -> GGML type name) stores those
    tensors quantized instead: Q8_0, Q5_0, Q4_1 quantized from the weights by the gguf package,
    the K-quants (and kinds the package cannot dequantize) as random blocks (random_blocks)."""
    import gguf
    import tiny
    from safetensors.numpy import load_file

    with open(os.path.join(model_folder, "config.json")) as f:
        cfg = json.load(f)
    tensors: dict[str, np.ndarray] = {}
    for name in sorted(os.listdir(model_folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(model_folder, name)))
    with open(os.path.join(model_folder, "tokenizer_config.json")) as f:
        tok_cfg = json.load(f)
    chat_template = tok_cfg.get("chat_template")
    if chat_template is None and os.path.isfile(os.path.join(model_folder, "chat_template.jinja")):
        with open(os.path.join(model_folder, "chat_template.jinja")) as f:
            chat_template = f.read()
    meta = _bpe_tokenizer_metadata(model_folder)
    ids = {t: i for i, t in enumerate(meta["tokens"])}

    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    arch = _MOE.get(cfg["model_type"], "llama")
    w = gguf.GGUFWriter(path, arch=arch)
    w.add_name("tiny")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    if cfg["model_type"] in _MOE:
        experts = cfg.get("num_experts") or cfg["num_local_experts"]
        w.add_expert_count(experts)
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        router, gate, up, down = tiny.MOE_NAMES[cfg["model_type"]]
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            per_expert = [gate, up, down]
            w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", tensors.pop(p + router + ".weight"))
            for gname, name in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), per_expert):
                w.add_tensor(f"blk.{i}.{gname}.weight",
                             np.stack([tensors.pop(p + name.format(j=j) + ".weight") for j in range(experts)]))
            if cfg.get("shared_expert_intermediate_size"):  # llama.cpp holds the shared gate as [D]
                w.add_tensor(f"blk.{i}.ffn_gate_inp_shexp.weight", tensors.pop(p + "mlp.shared_expert_gate.weight")[0])
                for gname, name in (("ffn_gate_shexp", "gate_proj"), ("ffn_up_shexp", "up_proj"),
                                    ("ffn_down_shexp", "down_proj")):
                    w.add_tensor(f"blk.{i}.{gname}.weight", tensors.pop(p + f"mlp.shared_expert.{name}.weight"))
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e4)))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(meta["tokens"])
    w.add_token_types(meta["types"])
    w.add_token_merges(meta["merges"])
    w.add_bos_token_id(ids[tok_cfg["bos_token"]])
    w.add_eos_token_id(ids[tok_cfg["eos_token"]])
    w.add_unk_token_id(ids[tok_cfg["unk_token"]])
    w.add_pad_token_id(ids[tok_cfg["pad_token"]])
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr, np.float32)
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            if rest == "self_attn.q_proj.weight" and arch == "llama":
                arr = _rope_permute(arr, heads)
            elif rest == "self_attn.k_proj.weight" and arch == "llama":
                arr = _rope_permute(arr, kv_heads)
            gname = f"blk.{i}.{_LAYER[rest]}"
        else:
            gname = _TOP[name]
        kind = (quant or {}).get(gname)
        if kind is None:
            w.add_tensor(gname, arr)
            continue
        qtype = gguf.GGMLQuantizationType[kind]
        try:
            data = gguf.quantize(arr, qtype)
        except NotImplementedError:
            data = random_blocks(*arr.shape, kind, np.random.default_rng(len(gname)))
        w.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_gemma_gguf(path: str, model_folder: str) -> str:
    """The tiny Gemma 2 or Gemma 3 of `model_folder` as a float32 GGUF laid out by llama.cpp's rules,
    named by the `gguf` package's own map (gguf.get_tensor_name_map, not ours): norm weights stored
    as 1 + w, embeddings tied, the windows, soft-caps and rope bases as metadata; the tiny byte-level
    BPE tokenizer as a "gpt2" vocabulary (Gemma's SentencePiece one is test_gguf_tokenizer.py's)."""
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(model_folder, "config.json")) as f:
        cfg = json.load(f)
    arch = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3_text": gguf.MODEL_ARCH.GEMMA3}[cfg["model_type"]]
    with open(os.path.join(model_folder, "tokenizer_config.json")) as f:
        tok_cfg = json.load(f)
    meta = _bpe_tokenizer_metadata(model_folder)
    ids = {t: i for i, t in enumerate(meta["tokens"])}
    L = cfg["num_hidden_layers"]
    names = gguf.get_tensor_name_map(arch, L)
    w = gguf.GGUFWriter(path, arch=gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(L)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_sliding_window(cfg["sliding_window"])
    # llama.cpp fixes the sliding pattern per architecture; the tiny Gemma 3's (sliding, sliding,
    # global) is not its five-in-six, so it is written as one flag a layer
    if arch == gguf.MODEL_ARCH.GEMMA3:
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
        rope = cfg["rope_parameters"]
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        if rope["full_attention"].get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["full_attention"]["factor"])
    else:
        w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(meta["tokens"])
    w.add_token_types(meta["types"])
    w.add_token_merges(meta["merges"])
    w.add_bos_token_id(ids[tok_cfg["bos_token"]])
    w.add_eos_token_id(ids[tok_cfg["eos_token"]])
    w.add_add_bos_token(False)
    for file in sorted(os.listdir(model_folder)):
        if not file.endswith(".safetensors"):
            continue
        for name, arr in load_file(os.path.join(model_folder, file)).items():
            arr = np.ascontiguousarray(arr, np.float32)
            if name.endswith("norm.weight"):
                arr = arr + 1.0
            w.add_tensor(names.get_name(name.removesuffix(".weight")) + ".weight", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tokenizer_gguf(path: str, tokens: list[str], *, model: str, types: list[int] | None = None,
                         merges: list[str] | None = None, scores: list[float] | None = None, pre: str | None = None,
                         bos: int | None = None, eos: int | None = None, unk: int | None = None,
                         add_bos: bool | None = None, add_space_prefix: bool | None = None,
                         chat_template: str | None = None) -> str:
    """A GGUF holding only tokenizer metadata (and one small tensor, as every file has some)."""
    import gguf

    w = gguf.GGUFWriter(path, arch="llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types or [1] * len(tokens))
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    for add, value in ((w.add_bos_token_id, bos), (w.add_eos_token_id, eos), (w.add_unk_token_id, unk),
                       (w.add_add_bos_token, add_bos), (w.add_add_space_prefix, add_space_prefix),
                       (w.add_chat_template, chat_template)):
        if value is not None:
            add(value)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def sentencepiece_vocab(words: str, size: int = 200) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style BPE vocabulary (tokens, scores, types) trained on `words`: <unk>, <s>,
    </s>, the 256 byte tokens <0x00>..<0xFF>, then "▁"-prefixed pieces best-first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator([words] * 20, trainers.BpeTrainer(vocab_size=size, show_progress=False))
    pieces = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [p for p in pieces if p not in tokens]
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    types = [2, 3, 3, *([6] * 256), *([1] * (len(tokens) - 259))]  # UNKNOWN, CONTROL, BYTE, NORMAL
    return tokens, scores, types
