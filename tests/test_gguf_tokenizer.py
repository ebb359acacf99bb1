"""The tokenizer a GGUF file describes, built without torch (jaxsched/engine/gguf_tokenizer.py): the same
ids, text and chat prompts as transformers' own GGUF converter (which needs torch), on tiny files of
both tokenizer models and on the demo model; and the tiny Llama loaded from GGUF generates what the
same weights give from their Hugging Face folder."""

from __future__ import annotations

import os

import pytest
import tiny
import tiny_gguf
from conftest import USER_CACHE

from jaxsched.engine.gguf_tokenizer import merges_from_scores
from jaxsched.engine.tokenizer import gguf_file_tokenizer, load_tokenizer

TEXTS = [
    "the capital of france is paris .",
    "  leading spaces,\ttabs\n\nand newlines\r\n",
    "é ü ñ 你好 世界 🙂 12345 67890 ! ? ; :",
    "it's don't I'll we've",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** 2  # comment",
    "",
]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a cat ?"}]


@pytest.fixture(scope="module")
def tiny_llama_gguf(model_dirs, tmp_path_factory) -> str:
    return tiny_gguf.write_llama_gguf(str(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"), model_dirs["llama"])


def transformers_gguf_tokenizer(path: str):
    pytest.importorskip("torch", reason="transformers' GGUF reader imports torch (not installed: the parity extra)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def assert_same_tokenizer(ours, ref, texts=TEXTS) -> None:
    assert len(ours) == len(ref)
    assert (ours.bos_token, ours.eos_token, ours.unk_token, ours.pad_token) == (
        ref.bos_token, ref.eos_token, ref.unk_token, ref.pad_token)
    assert sorted(ours.all_special_ids) == sorted(ref.all_special_ids)
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text
    if ref.chat_template:
        assert ours.chat_template == ref.chat_template
        for gen in (True, False):
            assert (ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen)
                    == ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen))


@pytest.mark.parametrize("pre", ["smollm", "llama-bpe", "qwen2"])
def test_byte_level_bpe_matches_transformers(tokenizer_dir, tmp_path, pre):
    meta = tiny_gguf._bpe_tokenizer_metadata(tokenizer_dir)
    path = tiny_gguf.write_tokenizer_gguf(str(tmp_path / "bpe.gguf"), meta["tokens"], model="gpt2", pre=pre,
                                          types=meta["types"], merges=meta["merges"], bos=1, eos=2, unk=0,
                                          chat_template=tiny.CHAT_TEMPLATE)
    ours = gguf_file_tokenizer(path)
    assert_same_tokenizer(ours, transformers_gguf_tokenizer(path))
    # and the tokenizer the GGUF came from: same ids for ordinary text
    from transformers import AutoTokenizer

    src = AutoTokenizer.from_pretrained(tokenizer_dir)
    if pre == "smollm":  # the GPT-2 split the tiny tokenizer was trained with
        for text in TEXTS:
            assert ours.encode(text) == src.encode(text), text


@pytest.mark.parametrize("add_bos", [None, False])
@pytest.mark.parametrize("with_merges", [False, True])
def test_sentencepiece_bpe_matches_transformers(tmp_path, add_bos, with_merges):
    tokens, scores, types = tiny_gguf.sentencepiece_vocab(tiny._WORDS)
    merges = [" ".join(m) for m in merges_from_scores(tokens, scores)] if with_merges else None
    path = tiny_gguf.write_tokenizer_gguf(str(tmp_path / "spm.gguf"), tokens, model="llama", types=types,
                                          scores=scores, merges=merges, bos=1, eos=2, unk=0, add_bos=add_bos)
    ours = gguf_file_tokenizer(path)
    assert_same_tokenizer(ours, transformers_gguf_tokenizer(path))
    ids = ours.encode("hello ☃")
    assert (ids[0] == 1) == (add_bos is None)  # llama.cpp adds BOS to a SentencePiece vocab unless told not to
    assert any(tokens[i].startswith("<0x") for i in ids)  # ☃ is not in the vocab: byte fallback


def test_gemmas_sentencepiece_vocabulary_adds_no_space_prefix(tmp_path):
    """Gemma's GGUF files hold a SentencePiece vocabulary with add_space_prefix false: text is not
    given a leading "▁", as in Gemma's own tokenizer.json (transformers' GemmaConverter: spaces to
    "▁", nothing prepended) and in llama.cpp. transformers' GGUF reader prepends one regardless, so
    it is the reference for the same text with the space written out; decoding gives the text back."""
    tokens, scores, types = tiny_gguf.sentencepiece_vocab(tiny._WORDS)
    path = tiny_gguf.write_tokenizer_gguf(str(tmp_path / "gemma.gguf"), tokens, model="llama", types=types,
                                          scores=scores, bos=1, eos=2, unk=0, add_space_prefix=False)
    ours = gguf_file_tokenizer(path)
    ref = transformers_gguf_tokenizer(path)
    for text in TEXTS:
        assert ours.encode(text if not text or text.startswith(" ") else " " + text) == ref.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=True) == text
    assert ours.encode("hello")[1:] != ref.encode("hello")[1:]  # "hello", not "▁hello"


def test_unsupported_tokenizer_model_says_what_to_do(tmp_path):
    path = tiny_gguf.write_tokenizer_gguf(str(tmp_path / "t5.gguf"), ["<pad>", "a"], model="t5")
    with pytest.raises(ValueError, match="'t5' is not supported.*tokenizer="):
        gguf_file_tokenizer(path)


def test_gguf_tokenizer_is_cached_and_reloads_identically(tiny_llama_gguf):
    first = load_tokenizer(tiny_llama_gguf)
    again = load_tokenizer(tiny_llama_gguf)  # from the cache folder this time
    assert_same_tokenizer(again, first)


def test_tiny_llama_gguf_loads_the_weights_and_config_of_its_hf_folder(tiny_llama_gguf, model_dirs):
    """Every tensor the model reads comes out of the GGUF as from the HF folder (q/k rows un-permuted
    from llama.cpp's rope layout), and the configs agree. Generation from a GGUF, end to end, is
    test_runtime_deps.py's."""
    import numpy as np

    from jaxsched.models.loader import load_model_source

    cfg_g, get_g, kind_g = load_model_source(tiny_llama_gguf)
    cfg_h, get_h, kind_h = load_model_source(model_dirs["llama"])
    assert (kind_g, kind_h) == ("gguf", "hf")
    same = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
            "num_kv_heads", "head_dim", "tie_word_embeddings")
    assert {k: getattr(cfg_g, k) for k in same} == {k: getattr(cfg_h, k) for k in same}
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    names += [f"model.layers.{i}.{n}" for i in range(cfg_h.num_layers) for n in tiny_gguf._LAYER
              if n.endswith("weight") and not n.startswith(("self_attn.q_norm", "self_attn.k_norm"))]  # Llama's
    for name in names:
        np.testing.assert_array_equal(get_g(name), get_h(name), err_msg=name)
    ours, src = load_tokenizer(tiny_llama_gguf), load_tokenizer(model_dirs["llama"])
    for text in TEXTS:
        assert ours.encode(text) == src.encode(text), text


@pytest.mark.slow
def test_demo_model_tokenizer_matches_transformers():
    from jaxsched.models.demo import demo_model_path

    path = str(demo_model_path(cache=USER_CACHE))
    texts = [*TEXTS, "What is the capital of France?", "<repo_name>x<file_sep>y"]
    assert_same_tokenizer(gguf_file_tokenizer(path), transformers_gguf_tokenizer(path), texts)
