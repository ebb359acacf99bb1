"""Tokenizer loading: a Hugging Face folder, or the tokenizer and chat template inside a GGUF file
(rebuilt from its metadata by gguf_tokenizer.py, without torch, then cached as a fast tokenizer
folder so the next start skips the rebuild)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from typing import Any

from jaxsched.envs import cache_dir

logger = logging.getLogger(__name__)

# Bump when gguf_tokenizer.py changes what it builds, so that older cached folders are not reused.
_GGUF_TOKENIZER_VERSION = 2


def load_tokenizer(path: str):
    """`path` is a HF folder with tokenizer files or a .gguf file."""
    from transformers import AutoTokenizer

    if os.path.isfile(path) and path.endswith(".gguf"):
        st = os.stat(path)
        key = hashlib.sha1(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}:{_GGUF_TOKENIZER_VERSION}"
                           .encode()).hexdigest()[:16]
        cached = cache_dir() / "tokenizers" / key
        if (cached / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(str(cached))
        logger.info("building the tokenizer of %s from its GGUF metadata (cached in %s)", path, cached)
        tok = gguf_file_tokenizer(path)
        _save_atomically(tok, cached)
        return tok
    if os.path.isdir(path):
        try:
            return AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"could not load a tokenizer from {path!r}: {e}; pass tokenizer=<folder>") from e
    raise ValueError(f"tokenizer {path!r} is neither a folder nor a .gguf file")


def _save_atomically(tok, folder) -> None:
    """Save into a fresh folder, then rename it into place: a server starting meanwhile never loads
    a half-written one (tokenizer.json there, the chat template not yet)."""
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    try:
        tok.save_pretrained(str(tmp))
        os.rename(tmp, folder)
    except OSError as e:  # read-only, or another process got there first: only costs a rebuild
        if not (folder / "tokenizer.json").is_file():
            logger.warning("could not cache the tokenizer in %s: %s", folder, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def gguf_file_tokenizer(path: str):
    """The tokenizer a .gguf file describes (not cached)."""
    from jaxsched.engine.gguf_tokenizer import build_gguf_tokenizer, gguf_tokenizer_metadata
    from jaxsched.models.loader import gguf_reader

    return build_gguf_tokenizer(gguf_tokenizer_metadata(gguf_reader(path)))


class PromptTooLongError(ValueError):
    """A prompt that cannot fit max_model_len, found before it was tokenized in full."""


def max_token_chars(tokenizer) -> int:
    """The longest spelling of any vocabulary entry. A token never stands for more characters of
    text than its spelling has (byte-level BPE spells one byte per character, SentencePiece's "▁"
    is one space, a byte token <0xE4> less than a character), so a text longer than
    max_model_len * max_token_chars cannot fit, and needs no tokenizing to be refused."""
    return max(map(len, tokenizer.get_vocab()), default=1)


def chat_prompt_ids(tokenizer, conversation: list[dict[str, Any]], add_generation_prompt: bool = True,
                    chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None,
                    max_chars: int | None = None, tools: list[dict[str, Any]] | None = None,
                    continue_final_message: bool = False, add_special_tokens: bool = False) -> list[int]:
    """Token ids of a chat, rendered by transformers' sandboxed Jinja environment and tokenized as
    apply_chat_template(tokenize=True) does (the template writes the special tokens itself, unless
    add_special_tokens asks for the tokenizer's too). With max_chars, a rendered prompt longer than
    that raises PromptTooLongError untokenized. `tools` (OpenAI tool objects) go to the template."""
    text = tokenizer.apply_chat_template(conversation, chat_template=chat_template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, tools=tools or None,
                                         continue_final_message=continue_final_message, **(template_kwargs or {}))
    if not isinstance(text, str):
        raise ValueError("the chat template did not render to text")  # noqa: TRY004 - a template problem
    if max_chars is not None and len(text) > max_chars:
        raise PromptTooLongError(f"the chat renders to {len(text)} characters, more than any prompt that fits "
                                 f"max_model_len ({max_chars} characters at most)")
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
