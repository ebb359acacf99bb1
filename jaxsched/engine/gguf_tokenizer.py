"""A GGUF file's tokenizer, rebuilt with the `tokenizers` library from the file's own metadata.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, the merges, each token's type,
the special token ids and the chat template as metadata. transformers can convert that too, but
its GGUF reader imports torch, which the serving path must not need (torch is a test-only
dependency here), so this module reads the metadata with the `gguf` package and builds the same
pipeline transformers builds for the two tokenizer models our architectures use:

  "gpt2"   byte-level BPE (Llama 3, Qwen2/3, SmolLM): tokens spelled in GPT-2's byte alphabet, the
           file's merges, a ByteLevel pre-tokenizer (after a split regex where the file's
           `tokenizer.ggml.pre` names one), a ByteLevel decoder;
  "llama"  SentencePiece BPE (Llama 2, Mistral, Gemma): Metaspace pre-tokenizer (no "▁" prepended
           where add_space_prefix is false, as in Gemma's files), byte fallback, merges from the
           file or derived from the token scores.

Tokens typed CONTROL become special added tokens (kept whole, skipped when decoding with
skip_special_tokens), USER_DEFINED ones plain added tokens. tests/test_gguf_tokenizer.py checks
the ids against transformers' own converter on the demo model and on tiny files of both models.
"""

from __future__ import annotations

from typing import Any

# llama.cpp's token types (gguf.TokenType)
_CONTROL, _USER_DEFINED = 3, 4

# `tokenizer.ggml.pre` -> the split regex the vocabulary's merges were learned with. A name not
# here gets the ByteLevel pre-tokenizer's own GPT-2 regex (SmolLM's "smollm" is one of those).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the printable character that spells it in a vocabulary
    (printable Latin-1 bytes stand for themselves; the others are shifted past 255)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, shifted = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + shifted)
            shifted += 1
    return out


def gguf_tokenizer_metadata(reader: Any) -> dict[str, Any]:
    """The tokenizer.* metadata of a gguf.GGUFReader as plain Python values."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            out[key.removeprefix("tokenizer.").removeprefix("ggml.")] = field.contents()
    return out


def build_gguf_tokenizer(meta: dict[str, Any]):
    """A transformers fast tokenizer (PreTrainedTokenizerFast) for gguf_tokenizer_metadata(...)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("model")
    tokens: list[str] = list(meta.get("tokens") or [])
    if not tokens:
        raise ValueError("the GGUF file has no tokenizer.ggml.tokens: pass tokenizer=<a Hugging Face tokenizer folder>")
    types: list[int] = list(meta.get("token_type") or [1] * len(tokens))
    if kind == "gpt2":
        alphabet = byte_alphabet()
        spelled = set(alphabet.values())
        # Most files spell tokens in the byte alphabet already; respell the ones that do not.
        vocab = {t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode()): i for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in meta.get("merges") or ()]
        tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                            end_of_word_suffix="", fuse_unk=False))
        split = _SPLITS.get(meta.get("pre"))
        if split is None:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        # A CONTROL token outside the byte alphabet is a converter's mislabel, not a real token.
        real = lambda t: set(t) <= spelled
        add_bos = bool(meta.get("add_bos_token", False))
    elif kind == "llama":
        vocab = {t: i for i, t in enumerate(tokens)}
        if meta.get("merges"):
            merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
        else:
            merges = merges_from_scores(tokens, list(meta.get("scores") or [0.0] * len(tokens)))
        tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
        prefix = bool(meta.get("add_space_prefix", True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                     split=False)
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1))
        tok.decoder = decoders.Sequence(steps)
        real = lambda t: True
        add_bos = bool(meta.get("add_bos_token", True))  # llama.cpp's default for SentencePiece vocabularies
    else:
        raise ValueError(f"the GGUF tokenizer model {kind!r} is not supported (only 'gpt2' and 'llama'): pass "
                         "tokenizer=<a Hugging Face tokenizer folder>")
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(tokens, types) if ty == _CONTROL and real(t)])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED and real(t)])

    def special(key: str) -> str | None:
        i = meta.get(f"{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    # transformers adds BOS / EOS through a post-processor it builds from these flags
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=special("bos"), eos_token=special("eos"),
                                   unk_token=special("unknown"), pad_token=special("padding"),
                                   add_bos_token=add_bos and special("bos") is not None,
                                   add_eos_token=bool(meta.get("add_eos_token", False)) and special("eos") is not None)
    if meta.get("chat_template"):
        fast.chat_template = meta["chat_template"]
    return fast


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a token into two tokens,
    best-scored result first (ties: longer left piece, then longer right piece, then vocabulary
    order), which is the order SentencePiece would merge them in."""
    index = set(tokens)
    found: list[tuple[float, int, int, str, str]] = []
    for t, score in zip(tokens, scores):
        for k in range(1, len(t)):
            left, right = t[:k], t[k:]
            if left in index and right in index:
                found.append((-score, -len(left), -len(right), left, right))
    found.sort(key=lambda m: m[:3])  # stable: vocabulary order within a tie
    return [(m[3], m[4]) for m in found]
