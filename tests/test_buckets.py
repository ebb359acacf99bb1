import pytest

from jaxsched.buckets import bucket_pairs, make_buckets, round_up, seq_buckets, token_buckets


def test_token_buckets_double_up_to_the_limit():
    assert token_buckets(2048) == (16, 32, 64, 128, 256, 512, 1024, 2048)
    assert token_buckets(100) == (16, 32, 64, 100)  # a limit that is not a power of two is kept
    assert token_buckets(8) == (8,)


def test_seq_buckets():
    assert seq_buckets(128) == (8, 16, 32, 64, 128)
    assert seq_buckets(3) == (3,)
    assert make_buckets(20, 8) == (8, 16, 20)


def test_round_up():
    b = token_buckets(100)
    assert [round_up(b, n) for n in (1, 16, 17, 64, 65, 100)] == [16, 16, 32, 64, 100, 100]
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        round_up(b, 101)


def test_bucket_pairs_cover_every_reachable_shape():
    tb, sb = token_buckets(64), seq_buckets(32)
    pairs = set(bucket_pairs(tb, sb))
    # every (tokens, seqs) with 1 <= seqs <= tokens <= limits maps to a compiled pair
    for n_tok in range(1, 65):
        for n_seq in range(1, min(n_tok, 32) + 1):
            assert (round_up(tb, n_tok), round_up(sb, n_seq)) in pairs
    assert (16, 32) not in pairs  # 32 sequences cannot fit in 16 tokens
