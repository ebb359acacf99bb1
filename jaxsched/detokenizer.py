"""Incremental detokenization and stop strings, on the host.

Decoding the whole output every step is quadratic; decoding one token alone breaks multi-byte
characters and SentencePiece's leading spaces. So, like vLLM, each request decodes a short window:
text(ids[prefix:]) minus text(ids[prefix:read]) is the new text, emitted only once it no longer
ends in an incomplete character. The window starts with a few prompt tokens so the first output
token decodes with its real left context.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxsched.request import SamplingParams

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

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special)

    def add_token(self, token_id: int, last: bool = False) -> str:
        """Append one generated token; returns the new text (possibly ''), stop strings applied.

        An incomplete character is held back until the next token completes it, unless this is the
        request's last token: then it is flushed, so the final text equals decoding all its tokens.
        """
        self.ids.append(token_id)
        self.num_outputs += 1
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not last):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        start = len(self.text)
        self.text += delta
        if self.stop and self.num_outputs >= self.min_tokens:
            self._check_stop(start)
        return self.text[start:]

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
