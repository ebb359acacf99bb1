"""IncrementalDetokenizer with a character-level fake tokenizer: stop strings and min_tokens."""

from __future__ import annotations

from jaxsched.core.request import SamplingParams
from jaxsched.engine.detokenizer import IncrementalDetokenizer


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

    from jaxsched.engine.detokenizer import decoder_of
    from jaxsched.engine.tokenizer import load_tokenizer

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


def test_byte_level_path_gives_the_windows_text(tokenizer_dir, monkeypatch):
    """The test tokenizer is byte-level BPE: every id gets its bytes, and over random ids (random
    bytes: characters split over tokens, invalid UTF-8, special tokens kept and skipped, ids past
    the vocabulary) the byte path gives the window's new text token by token, and the final text
    is the whole output's decode. A fake tokenizer, or one whose decode transformers must wrap,
    gets no table."""
    import random

    from jaxsched.engine.detokenizer import byte_table
    from jaxsched.engine.tokenizer import load_tokenizer

    monkeypatch.setenv("JAXSCHED_VERIFY_DETOK", "0")  # compared here, not by the check
    tok = load_tokenizer(tokenizer_dir)
    table = byte_table(tok)
    assert table is not None and len(table.keep) == len(tok) and byte_table(tok) is table
    special = sorted(tok.all_special_ids)
    assert special and all(table.skip[i] == b"" and table.keep[i] for i in special)
    multi = [i for i, b in enumerate(table.keep) if any(x >= 0x80 for x in b)]
    assert len(multi) >= 64  # ids whose bytes are not ASCII: the split characters below
    rng = random.Random(1)
    started, moved = {True: 0, False: 0}, 0
    for skip in (True, False):
        for _ in range(300):
            prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 8))]
            out = [rng.choice(special) if r < 0.05 else len(tok) + 3 if r < 0.07 else rng.choice(multi) if r < 0.6
                   else rng.randrange(len(tok)) for r in (rng.random() for _ in range(rng.randint(1, 16)))]
            params = SamplingParams(skip_special_tokens=skip)
            fast, slow = IncrementalDetokenizer(tok, prompt, params), IncrementalDetokenizer(tok, prompt, params)
            slow._bytes = slow._byte_ids = None
            whole = fast._bytes is not None  # the prompt ends on a whole character
            deltas = [[d.add_token(t, last=i == len(out) - 1) for i, t in enumerate(out)] for d in (fast, slow)]
            assert deltas[0] == deltas[1], (prompt, out, skip)
            if whole:
                assert fast.text == tok.decode(out, skip_special_tokens=skip)
            # a prompt ending inside a character starts on the window, and moves once it emits
            started[whole] += 1
            moved += not whole and fast._bytes is not None
    assert started[True] >= 300 and started[False] >= 100 and moved >= 100

    tok.clean_up_tokenization_spaces = True  # transformers' wrapper decides the text: no table
    assert byte_table(load_tokenizer(tokenizer_dir)) is not None and byte_table(tok) is table  # cached
    from jaxsched.engine.detokenizer import _build_table

    assert _build_table(tok) is None and byte_table(CharTokenizer()) is None


def test_the_check_catches_a_wrong_byte(tokenizer_dir, monkeypatch):
    """JAXSCHED_VERIFY_DETOK=1 (the suite's setting) raises where the byte path's text differs from
    the window's: here one id's bytes are wrong."""
    import pytest

    from jaxsched.engine.detokenizer import ByteTable, _tables
    from jaxsched.engine.tokenizer import load_tokenizer

    monkeypatch.setenv("JAXSCHED_VERIFY_DETOK", "1")
    tok = load_tokenizer(tokenizer_dir)
    good = tok.encode("the cat", add_special_tokens=False)
    keep = [b"" for _ in range(len(tok))]
    keep[good[0]] = b"dog"
    _tables[tok] = ByteTable(keep, set())
    d = IncrementalDetokenizer(tok, good, SamplingParams())
    with pytest.raises(AssertionError, match="byte-level detokenization gave 'dog'"):
        d.add_token(good[0])


def test_decode_stream_path_gives_the_windows_text(tmp_path, monkeypatch):
    """A SentencePiece-style tokenizer (not byte-level) decodes through tokenizers' DecodeStream:
    over random ids (byte-fallback tokens that split characters, special tokens skipped and kept,
    ids past the vocabulary) its new text is the window's token by token, and a request whose
    stream raises (tokenizers' invalid prefix, seen with special tokens kept) goes on on the window
    with the same text. JAXSCHED_VERIFY_DETOK=1 catches a stream that gives other text."""
    import random

    import pytest
    from tiny import build_sentencepiece_tokenizer

    from jaxsched.engine.detokenizer import _DecodeStream, byte_table
    from jaxsched.engine.tokenizer import load_tokenizer

    if _DecodeStream is None:
        pytest.fail("tokenizers without DecodeStream(ids=...): the pinned version has it")
    monkeypatch.setenv("JAXSCHED_VERIFY_DETOK", "0")  # compared here, not by the check
    build_sentencepiece_tokenizer(str(tmp_path))
    tok = load_tokenizer(str(tmp_path))
    assert byte_table(tok) is None
    byte_ids = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(0x80, 0x100)]
    special = sorted(tok.all_special_ids)
    rng = random.Random(2)
    on_stream, handed_over = 0, 0
    for skip in (True, False):
        for _ in range(300):
            prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 8))]
            out = [rng.choice(special) if r < 0.05 else len(tok) + 3 if r < 0.07 else rng.choice(byte_ids) if r < 0.5
                   else rng.randrange(len(tok)) for r in (rng.random() for _ in range(rng.randint(1, 16)))]
            params = SamplingParams(skip_special_tokens=skip)
            fast, slow = IncrementalDetokenizer(tok, prompt, params), IncrementalDetokenizer(tok, prompt, params)
            slow._stream = None
            started = fast._stream is not None
            deltas = [[d.add_token(t, last=i == len(out) - 1) for i, t in enumerate(out)] for d in (fast, slow)]
            assert deltas[0] == deltas[1], (prompt, out, skip)
            on_stream += started
            handed_over += started and fast._stream is None
    assert on_stream >= 400 and handed_over >= 10

    monkeypatch.setenv("JAXSCHED_VERIFY_DETOK", "1")
    good = tok.encode("the cat", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, good, SamplingParams())

    class Wrong:
        def step(self, tokenizer, token_id):
            return "dog"

    d._stream = Wrong()
    with pytest.raises(AssertionError, match="DecodeStream gave 'dog'"):
        d.add_token(good[0])
