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
