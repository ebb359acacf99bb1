"""Tokenizer loading: a Hugging Face folder, or the tokenizer and chat template inside a GGUF file
(converted by transformers once, then cached as a fast tokenizer folder)."""

from __future__ import annotations

import hashlib
import logging
import os

from jaxsched.models.demo import cache_dir

logger = logging.getLogger(__name__)


def load_tokenizer(path: str):
    """`path` is a HF folder with tokenizer files or a .gguf file."""
    from transformers import AutoTokenizer

    if os.path.isfile(path) and path.endswith(".gguf"):
        st = os.stat(path)
        key = hashlib.sha1(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
        cached = cache_dir() / "tokenizers" / key
        if (cached / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(str(cached))
        logger.info("converting the GGUF tokenizer of %s (cached in %s)", path, cached)
        tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                            gguf_file=os.path.basename(path))
        try:
            tok.save_pretrained(str(cached))
        except OSError as e:  # a read-only cache only costs the conversion next time
            logger.warning("could not cache the tokenizer in %s: %s", cached, e)
        return tok
    if os.path.isdir(path):
        try:
            return AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"could not load a tokenizer from {path!r}: {e}; pass tokenizer=<folder>") from e
    raise ValueError(f"tokenizer {path!r} is neither a folder nor a .gguf file")
