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
