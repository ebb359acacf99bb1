"""IncrementalDetokenizer with a character-level fake tokenizer: stop strings and min_tokens."""

from __future__ import annotations

from jaxsched.detokenizer import IncrementalDetokenizer
from jaxsched.request import SamplingParams


class CharTokenizer:
    """Token id i is the character chr(i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def run(text: str, **params) -> IncrementalDetokenizer:
    d = IncrementalDetokenizer(CharTokenizer(), [ord(">")], SamplingParams(**params))
    for c in text:
        d.add_token(ord(c))
        if d.stop_string is not None:
            break
    return d


def test_stop_string_ends_output_and_is_cut():
    d = run("ab.cd.ef", stop=[".c"])
    assert (d.text, d.stop_string) == ("ab", ".c")
    assert run("ab.cd.ef", stop=[".c"], include_stop_str_in_output=True).text == "ab.c"


def test_min_tokens_delays_stop_strings():
    d = run("ab.cd.ef.gh", stop=["."], min_tokens=4)
    # the "." at output 3 comes before min_tokens outputs exist; the next one (output 6) stops
    assert (d.text, d.stop_string) == ("ab.cd", ".")


def test_rust_decode_where_it_gives_the_wrappers_text(tokenizer_dir):
    """decoder_of takes the Rust tokenizer's decode for a plain fast tokenizer; the detokenizer's
    text is then the same as through transformers' decode, special tokens skipped or kept, and
    equals decoding all the output at once. A class that overrides decode, or a tokenizer that
    cleans up spaces, keeps the wrapper."""
    import random

    from jaxsched.detokenizer import decoder_of
    from jaxsched.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    assert decoder_of(tok) == tok._tokenizer.decode
    rng = random.Random(0)
    special = sorted(tok.all_special_ids)
    assert special
    for skip in (True, False):
        for _ in range(20):
            prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 8))]
            out = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tok)) for _ in range(12)]
            params = SamplingParams(skip_special_tokens=skip)
            texts = []
            for decode in (decoder_of(tok), tok.decode):
                d = IncrementalDetokenizer(tok, prompt, params)
                d._decode_ids = decode
                texts.append("".join(d.add_token(t, last=i == len(out) - 1) for i, t in enumerate(out)))
            assert texts[0] == texts[1]
            ctx = prompt[-6:]
            assert texts[0] == tok.decode(ctx + out, skip_special_tokens=skip)[len(tok.decode(ctx, skip_special_tokens=skip)):]

    class Overriding(type(tok)):
        def decode(self, *args, **kwargs):
            return "x"

    tok.__class__ = Overriding
    try:
        assert decoder_of(tok) == tok.decode
    finally:
        tok.__class__ = Overriding.__mro__[1]
    tok.clean_up_tokenization_spaces = True
    assert decoder_of(tok) == tok.decode
