"""Incremental detokenization and stop strings, on the host.

Decoding the whole output every step is quadratic; decoding one token alone breaks multi-byte
characters and SentencePiece's leading spaces. So, like vLLM, each request decodes a short window:
text(ids[prefix:]) minus text(ids[prefix:read]) is the new text, emitted only once it no longer
ends in an incomplete character. The window starts with a few prompt tokens so the first output
token decodes with its real left context.

Byte-level BPE tokenizers (GPT-2's scheme: Llama 3, Qwen, SmolLM, the test tokenizer) need no
window: their decode is the UTF-8 of the tokens' bytes laid end to end, so a token's new text is
the bytes held since the last complete character plus its own. `byte_table` maps every id to its
bytes once per tokenizer (checked against the tokenizer's own decode, id by id); a request then
spends a list lookup and a bytes decode per token where the window costs two calls into the Rust
tokenizer (each a few microseconds through the binding): at a few hundred rows a step that is
most of the host's output phase (docs/PERFORMANCE.md, "Decisions in the code").
Other tokenizers whose decode is their Rust decoder's (SentencePiece's Metaspace and byte
fallback: Llama 2, Mistral, Gemma) run the same window inside tokenizers' `DecodeStream`, as vLLM's
fast detokenizer does: one call into Rust a token instead of two decodes through the binding
(`scripts/bench_detokenizer.py` times both). The byte table stays ahead of it on byte-level
tokenizers and keeps them. A
request whose stream fails (tokenizers raises where the text before a token changes: seen with
special tokens kept) goes on on the window.
JAXSCHED_VERIFY_DETOK=1 computes the window's text beside either and raises where they differ
(the test suite turns it on).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from jaxsched import envs
from jaxsched.core.request import SamplingParams

VERIFY_ENV = envs.VERIFY_DETOK

_CONTEXT_TOKENS = 6

# transformers' own decode methods: a tokenizer class that keeps both adds nothing to its Rust
# tokenizer's decode but argument conversion, unless it cleans up spaces
_GENERIC_DECODE = "PreTrainedTokenizerBase.decode"
_GENERIC_BACKEND_DECODES = ("TokenizersBackend._decode", "PreTrainedTokenizerFast._decode")


def decoder_of(tokenizer) -> Callable[..., str]:
    """`tokenizer.decode`, or its Rust tokenizer's decode where that gives the same text.

    transformers' wrapper costs a few microseconds a call (converting the ids, looking up options)
    for a microsecond of decoding, and a generated token decodes twice: for a step of a few hundred
    rows that is a share of the host's step on a GPU. Any class that overrides either method, or a
    tokenizer that cleans up spaces, keeps the wrapper."""
    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    generic = (getattr(getattr(cls, "decode", None), "__qualname__", None) == _GENERIC_DECODE
               and getattr(getattr(cls, "_decode", None), "__qualname__", None) in _GENERIC_BACKEND_DECODES)
    if (generic and type(backend).__module__.split(".")[0] == "tokenizers"
            and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False):
        return backend.decode
    return tokenizer.decode


def _decode_stream_class():
    """tokenizers' DecodeStream where it takes a context to start from (`ids=`), else None."""
    try:
        from tokenizers.decoders import DecodeStream

        DecodeStream(ids=[], skip_special_tokens=True)
    except (ImportError, TypeError):
        return None
    return DecodeStream


_DecodeStream = _decode_stream_class()


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the byte each character of a ByteLevel vocabulary
    stands for. Printable Latin-1 bytes stand for themselves; the other 68 bytes are written as
    the characters from U+0100 up, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = sorted(set(range(256)) - set(printable))
    return {**{chr(b): b for b in printable}, **{chr(0x100 + i): b for i, b in enumerate(others)}}


_BYTE_OF_CHAR = _byte_of_char()


class ByteTable:
    """Every id's bytes under a ByteLevel decoder: `keep` with special tokens, `skip` with them
    empty (skip_special_tokens). Ids past the table decode to nothing, as in the tokenizer."""

    def __init__(self, keep: list[bytes], special: set[int]) -> None:
        self.keep = keep
        self.skip = [b"" if i in special else b for i, b in enumerate(keep)]


_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def byte_table(tokenizer) -> ByteTable | None:
    """The tokenizer's ByteTable, built once (a pass over the vocabulary) and cached; None where its
    decode is not plain byte-level (another decoder, transformers' wrapper kept by decoder_of, or an
    id whose bytes do not give the tokenizer's own text)."""
    try:
        return _tables[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable: no cache, no table
        return None
    table = _build_table(tokenizer)
    _tables[tokenizer] = table
    return table


def _build_table(tokenizer) -> ByteTable | None:
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or decoder_of(tokenizer) != backend.decode:
        return None
    try:
        from tokenizers import decoders
    except ImportError:
        return None
    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    added = backend.get_added_tokens_decoder()
    n = max(backend.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)
    keep: list[bytes] = []
    for i in range(n):
        token = backend.id_to_token(i)
        if token is None:
            keep.append(b"")
            continue
        try:  # a token with a character outside the alphabet is its own UTF-8 (as tokenizers decodes)
            keep.append(bytes(_BYTE_OF_CHAR[c] for c in token))
        except KeyError:
            keep.append(token.encode())
    special = {i for i, t in added.items() if t.special}
    for i, b in enumerate(keep):
        if b.decode("utf-8", "replace") != backend.decode([i], skip_special_tokens=False):
            return None
    return ByteTable(keep, special)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self._decode_ids = decoder_of(tokenizer)
        self.skip_special = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        # As in vLLM, stop strings are not looked for before min_tokens outputs exist.
        self.min_tokens = params.min_tokens
        self.num_outputs = 0
        # A stop string ending in new text may start up to this many characters before it.
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop_string: str | None = None  # set when a stop string ended the output
        # the byte-level path (None: the window), where the tokenizer has one. A prompt that ends
        # inside a character starts on the window, whose left context completes that character,
        # and moves to bytes once the window has emitted text (its ids then end on a whole one)
        self._bytes: list[bytes] | None = None
        self._byte_ids: list[bytes] | None = None
        self._pending = b""  # bytes of tokens after the last whole character emitted
        table = byte_table(tokenizer)
        if table is not None:
            self._byte_ids = ids = table.skip if self.skip_special else table.keep
            context = b"".join(ids[i] if 0 <= i < len(ids) else b"" for i in self.ids)
            if not context.decode("utf-8", "replace").endswith("\ufffd"):
                self._bytes = ids
        # the stream path: a tokenizer that is not byte-level but decodes in its Rust decoder alone.
        # Its context must end on a whole character, as for the bytes (the window handles the rest)
        self._stream = None
        backend = getattr(tokenizer, "_tokenizer", None)
        if (table is None and _DecodeStream is not None and backend is not None and self._decode_ids == backend.decode
                and not self._decode(self.ids).endswith("\ufffd")):
            self._stream = _DecodeStream(ids=self.ids, skip_special_tokens=self.skip_special)
            self._rust = backend
        self._verify = (table is not None or self._stream is not None) and envs.verify_detok()

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special)

    def add_token(self, token_id: int, last: bool = False) -> str:
        """Append one generated token; returns the new text (possibly ''), stop strings applied.

        An incomplete character is held back until the next token completes it, unless this is the
        request's last token: then it is flushed, so the final text equals decoding all its tokens.
        """
        self.ids.append(token_id)
        self.num_outputs += 1
        if self._stream is not None:
            delta = self._stream_delta(token_id, last)
        elif self._bytes is None:
            delta = self._window_delta(last)
            if delta and self._byte_ids is not None:  # the window ends on a whole character now
                self._bytes = self._byte_ids
        else:
            ids = self._bytes
            held = self._pending + (ids[token_id] if 0 <= token_id < len(ids) else b"")
            delta = held.decode("utf-8", "replace") if held else ""
            if delta.endswith("\ufffd") and not last:
                self._pending, delta = held, ""
            else:
                self._pending = b""
            if self._verify and delta != (window := self._window_delta(last)):
                raise AssertionError(f"byte-level detokenization gave {delta!r} where the window gives {window!r} "
                                     f"(token {token_id}, ids {self.ids})")
        if not delta:
            return ""
        start = len(self.text)
        self.text += delta
        if self.stop and self.num_outputs >= self.min_tokens:
            self._check_stop(start)
        return self.text[start:]

    def _stream_delta(self, token_id: int, last: bool) -> str:
        """The new text from the DecodeStream; the window's offsets follow it, so that a last token
        that leaves a character incomplete flushes it, and a failed stream hands over."""
        verify = self._window_delta(last) if self._verify else None  # moves the window's offsets itself
        try:
            piece = self._stream.step(self._rust, token_id)
        except Exception:  # noqa: BLE001 - tokenizers' InvalidPrefix, an id it cannot take: the window goes on
            self._stream = None
            return verify if verify is not None else self._window_delta(last)
        if verify is not None:
            delta = piece if piece is not None else verify if last else ""
            if delta != verify:
                raise AssertionError(f"DecodeStream gave {delta!r} where the window gives {verify!r} "
                                     f"(token {token_id}, ids {self.ids})")
            return delta
        if piece is not None:
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return piece
        return self._window_delta(True) if last else ""

    def _window_delta(self, last: bool) -> str:
        """The new text of the window over self.ids (which end with the new token); moves the window
        past it once it ends on a whole character."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not last):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]

    def _check_stop(self, new_from: int) -> None:
        # a stop string may begin before the new text and end inside it
        search_from = max(0, new_from - self.holdback)
        best = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
            self.stop_string = s
