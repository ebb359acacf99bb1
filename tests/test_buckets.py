import pytest

from jaxsched.core.buckets import (
    bucket_pairs,
    make_buckets,
    round_up,
    seq_buckets,
    seq_buckets_for,
    token_buckets,
)


def test_token_buckets_double_up_to_the_limit():
    assert token_buckets(2048) == (16, 32, 64, 128, 256, 512, 1024, 2048)
    assert token_buckets(100) == (16, 32, 64, 100)  # a limit that is not a power of two is kept
    assert token_buckets(8) == (8,)
    # decode-sized T buckets (up to max_num_seqs) get steps a quarter of the doubling apart (at
    # least 16) from 32 on
    assert token_buckets(2048, 128) == (16, 32, 48, 64, 80, 96, 112, 128, 256, 512, 1024, 2048)
    assert token_buckets(8192, 256)[:13] == (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
    # fine steps stop at max_num_seqs, which is a bucket itself
    assert token_buckets(300, 100) == (16, 32, 48, 64, 80, 96, 100, 128, 256, 300)
    assert token_buckets(100, 40) == (16, 32, 40, 64, 100)


def test_seq_buckets():
    assert seq_buckets(128) == (8, 16, 32, 48, 64, 80, 96, 112, 128)
    assert seq_buckets(100) == (8, 16, 32, 48, 64, 80, 96, 100)
    assert seq_buckets(16) == (8, 16)
    assert seq_buckets(3) == (3,)
    assert make_buckets(20, 8) == (8, 16, 20)


def test_round_up():
    b = token_buckets(100)
    assert [round_up(b, n) for n in (1, 16, 17, 64, 65, 100)] == [16, 16, 32, 64, 100, 100]
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        round_up(b, 101)


@pytest.mark.parametrize("max_tokens,max_seqs", [(64, 32), (512, 128), (300, 100), (100, 40), (400, 200),
                                                 (1024, 256), (16, 16), (20, 3)])
def test_bucket_pairs_cover_every_reachable_shape(max_tokens, max_seqs):
    tb, sb = token_buckets(max_tokens, max_seqs), seq_buckets(max_seqs)
    pairs = bucket_pairs(tb, sb)
    assert len(pairs) == len(set(pairs))
    # every (tokens, seqs) with 1 <= seqs <= tokens <= limits maps, by the scheduler's rule, to a
    # compiled pair
    for n_tok in range(1, max_tokens + 1):
        T = round_up(tb, n_tok)
        for n_seq in range(1, min(n_tok, max_seqs) + 1):
            assert (T, round_up(seq_buckets_for(sb, T), n_seq)) in pairs
    assert (16, 32) not in pairs  # 32 sequences cannot fit in 16 tokens


def test_seq_buckets_per_token_bucket():
    sb = seq_buckets(128)
    assert seq_buckets_for(sb, 96) == (8, 16, 32, 64, 80, 96, 112, 128)
    assert seq_buckets_for(sb, 256) == (8, 16, 32, 64, 128)
    assert round_up(seq_buckets_for(sb, 96), 81) == 96
    assert round_up(seq_buckets_for(sb, 96), 80) == 80
    assert round_up(seq_buckets_for(sb, 256), 80) == 128
    # decode-sized T: the fine S buckets only above T / 2 (a padded sequence costs an lm_head row)
    assert seq_buckets_for(sb, 128) == (8, 16, 32, 64, 80, 96, 112, 128)
    assert seq_buckets_for(sb, 64) == (8, 16, 32, 48, 64, 80, 96, 112, 128)
    assert round_up(seq_buckets_for(sb, 128), 40) == 64
    # 61 programs for the benchmark's limits, against 34 with doubling buckets only
    assert len(bucket_pairs(token_buckets(2048, 128), sb)) == 61
    assert len(bucket_pairs(token_buckets(2048, 256), seq_buckets(256))) == 92
