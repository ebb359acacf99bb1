"""Microseconds a generated token costs the front end's detokenizer, per path, per tokenizer.

    python scripts/bench_detokenizer.py --tokenizer /tmp/smollm2-f32 --tokenizer /tmp/sp

Each --tokenizer is a folder with a Hugging Face tokenizer. A SentencePiece-style one for the
stream path (Llama 2's decoder: Metaspace, byte fallback) is built by the tests' fixture:

    python -c "import sys; sys.path.insert(0, 'tests'); import tiny; tiny.build_sentencepiece_tokenizer('/tmp/sp')"

The output: common English words with accented letters, CJK and an emoji between them, tokenized,
then fed back one token at a time (the first 6 tokens as the prompt's context). Paths:
"chosen" is what `IncrementalDetokenizer` picks for the tokenizer (the byte table, the
DecodeStream or the window), "window" the two decodes a token through the binding, "stream"
tokenizers' DecodeStream. Best of --repeat runs; each path's text is checked against decoding
the whole output at once.
"""

from __future__ import annotations

import argparse
import time

from jaxsched.bench.workloads import _WORD_TEXT
from jaxsched.core.request import SamplingParams
from jaxsched.engine.detokenizer import IncrementalDetokenizer, _DecodeStream
from jaxsched.engine.tokenizer import load_tokenizer

_EXTRA = ("café", "naïve", "你好", "世界", "🙂", "Straße", "ж")


def text_of(words: int) -> str:
    base = _WORD_TEXT.split()
    out = []
    for i in range(words):
        out.append(_EXTRA[i // 7 % len(_EXTRA)] if i % 7 == 3 else base[i % len(base)])
    return " ".join(out)


def run(tok, prompt: list[int], out: list[int], path: str) -> tuple[float, str]:
    d = IncrementalDetokenizer(tok, prompt, SamplingParams(max_tokens=len(out)))
    if path == "window":
        d._stream = d._bytes = d._byte_ids = None
    elif path == "stream":
        if _DecodeStream is None:
            raise SystemExit("this tokenizers has no DecodeStream(ids=...): pip install -U tokenizers")
        d._bytes = d._byte_ids = None
        d._stream, d._rust = _DecodeStream(ids=d.ids, skip_special_tokens=True), tok._tokenizer
    last = len(out) - 1
    t = time.perf_counter()
    for i, x in enumerate(out):
        d.add_token(x, i == last)
    return time.perf_counter() - t, d.text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", action="append", required=True, help="a tokenizer folder (repeatable)")
    ap.add_argument("--words", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=7)
    ns = ap.parse_args()
    for folder in ns.tokenizer:
        tok = load_tokenizer(folder)
        ids = tok(text_of(ns.words), add_special_tokens=False)["input_ids"]
        prompt, out = ids[:6], ids[6:]
        want = tok.decode(prompt + out, skip_special_tokens=True)[len(tok.decode(prompt, skip_special_tokens=True)):]
        probe = IncrementalDetokenizer(tok, prompt, SamplingParams())
        chosen = "bytes" if probe._bytes is not None else "stream" if probe._stream is not None else "window"
        cells = []
        for path in ("chosen", "window", "stream"):
            if path == "stream" and getattr(tok, "_tokenizer", None) is None:
                continue
            best, text = min(run(tok, prompt, out, path) for _ in range(ns.repeat))
            cells.append(f"{path}{' (' + chosen + ')' if path == 'chosen' else ''} {best / len(out) * 1e6:.2f} us"
                         f"{'' if text == want else ' TEXT DIFFERS'}")
        print(f"{folder}: {len(out)} tokens; " + "; ".join(cells))


if __name__ == "__main__":
    main()
