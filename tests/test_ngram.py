"""The n-gram (prompt lookup) drafter on hand-made sequences."""
import pytest

from backends.native.drafters import NgramDrafter


def test_longest_ngram_first_and_most_recent_match():
    d = NgramDrafter(k=3, min_ngram=1, max_ngram=3)
    #        0  1  2  3  4  5  6  7  8  9
    seq = [5, 6, 7, 1, 2, 5, 6, 7, 3, 4, 9, 5, 6, 7]
    # suffix (5,6,7) occurs at 0 and 5; most recent is 5 -> continuation 3,4,9
    assert d.lookup(seq) == [3, 4, 9]
    assert NgramDrafter(k=3, max_ngram=3, prefer_recent=False).lookup(seq) == [1, 2, 5]


def test_falls_back_to_shorter_ngrams():
    d = NgramDrafter(k=2, min_ngram=1, max_ngram=3)
    seq = [8, 1, 2, 9, 4, 3, 9]  # (4,3,9),(3,9) unseen; 9 seen at 3 -> 4,3
    assert d.lookup(seq) == [4, 3]
    assert NgramDrafter(k=2, min_ngram=2, max_ngram=3).lookup(seq) == []


def test_continuation_is_cut_at_k_and_at_end_of_sequence():
    d = NgramDrafter(k=5, min_ngram=1, max_ngram=2)
    seq = [1, 2, 3, 1, 2]
    assert d.lookup(seq) == [3, 1, 2]  # match (1,2) at 0: continuation to the end, 3 tokens


def test_min_hits():
    seq = [1, 2, 7, 1, 2, 8, 1, 2]
    assert NgramDrafter(k=1, min_ngram=2, max_ngram=2, min_hits=2).lookup(seq) == [8]
    assert NgramDrafter(k=1, min_ngram=2, max_ngram=2, min_hits=3).lookup(seq) == []


def test_no_match_and_short_sequences():
    d = NgramDrafter(k=3)
    assert d.lookup([1, 2, 3, 4]) == []
    assert d.lookup([1]) == []


def test_bad_knobs_are_clear_errors():
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(k=3, min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError, match="min_hits"):
        NgramDrafter(k=3, min_hits=0)


def test_the_match_length_is_that_of_the_suffix_that_matched():
    from bench.ngram import ngram_lookup

    seq = [5, 6, 7, 1, 2, 5, 6, 7, 3, 4, 9, 5, 6, 7]
    assert ngram_lookup(seq, 3, 1, 3, with_match_len=True) == ([3, 4, 9], 3)
    assert ngram_lookup([8, 1, 2, 9, 4, 3, 9], 2, 1, 3, with_match_len=True) == ([4, 3], 1)
    assert ngram_lookup([1, 2, 3, 4], 3, with_match_len=True) == ([], 0)
    assert ngram_lookup(seq, 3, 1, 3) == [3, 4, 9]  # without the flag: the tokens, as before


def test_replaying_the_lookup_in_one_pass_equals_it_at_every_prefix():
    """replay_lookup (one dictionary pass) against ngram_lookup on every prefix, over random
    sequences of small vocabularies (many repeats, ties, several hits) and every knob."""
    import numpy as np

    from bench.ngram import ngram_lookup, replay_lookup

    rng = np.random.default_rng(0)
    checked = matched = 0
    for trial in range(60):
        seq = rng.integers(0, int(rng.integers(2, 9)), int(rng.integers(2, 90))).tolist()
        lo = int(rng.integers(1, 4))
        knobs = dict(min_ngram=lo, max_ngram=lo + int(rng.integers(0, 5)), prefer_recent=bool(trial % 2),
                     min_hits=int(rng.integers(1, 4)))
        k, first = int(rng.integers(1, 9)), int(rng.integers(1, len(seq) + 1))
        start, n_tok, n_match = replay_lookup(seq, first, k, **knobs)
        for L in range(first, len(seq) + 1):
            j = L - first
            toks, n = ngram_lookup(seq[:L], k, with_match_len=True, **knobs)
            assert (seq[start[j] : start[j] + n_tok[j]], int(n_match[j])) == (toks, n), (trial, L)
            checked += 1
            matched += n > 0
    assert checked > 1000 and 0.2 < matched / checked < 1  # both outcomes well covered
    with pytest.raises(ValueError, match="min_ngram=3, max_ngram=2"):
        replay_lookup([1, 2, 3], 1, 2, min_ngram=3, max_ngram=2)
