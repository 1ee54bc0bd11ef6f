"""The n-gram matcher of prompt-lookup drafting: the rule on hand-made contexts, and the incremental
index against the direct search on random ones."""

from __future__ import annotations

import random

import pytest

from specblock.evaluate.decoding.lookup import LookupConfig, LookupSession, NgramIndex, ngram_draft


def both(context: list[int], max_n: int = 3, min_n: int = 1, length: int = 4) -> list[int]:
    """The draft by direct search, checked equal to the incremental index's."""
    index = NgramIndex(max_n, min_n)
    index.extend(context)
    ref = ngram_draft(context, max_n, min_n, length)
    assert index.draft(length) == ref
    return ref


def test_longest_suffix_ngram_wins():
    # suffix 3-gram (1, 2, 3) occurs at 0 (followed by 7); the 1-gram (3) alone occurs later (followed by 9)
    assert both([1, 2, 3, 7, 8, 3, 9, 5, 1, 2, 3]) == [7, 8, 3, 9]
    assert both([1, 2, 3, 7, 8, 3, 9, 5, 1, 2, 3], max_n=1) == [9, 5, 1, 2]


def test_most_recent_earlier_occurrence_wins():
    assert both([4, 5, 1, 4, 5, 2, 4, 5], max_n=2) == [2, 4, 5]
    assert both([4, 5, 1, 4, 5, 2, 6, 4, 5], max_n=2, length=2) == [2, 6]


def test_no_match_gives_no_draft():
    assert both([1, 2, 3, 4, 5]) == []
    assert both([7]) == []
    assert both([1, 2, 1, 3], min_n=2) == []  # only a 1-gram (1) repeats... and the suffix is (3)
    assert both([1, 2, 3, 1, 2], max_n=3, min_n=3) == []  # (1, 2) repeats but n = 3 is required


def test_match_at_the_end_of_the_context_gives_a_short_draft():
    # the earlier occurrence overlaps or abuts the suffix: the draft stops at the context's end
    assert both([5, 6, 5, 6], max_n=2) == [5, 6]
    assert both([9, 9, 9], max_n=3) == [9]  # (9, 9) at 0..1 is followed by the last 9 only
    assert both([1, 2, 3, 4, 1, 2, 3, 4], length=8) == [1, 2, 3, 4]  # (2, 3, 4) at 1..3, 4 tokens left


def test_incremental_index_matches_direct_search_on_random_contexts():
    rng = random.Random(0)
    for trial in range(200):
        max_n = rng.randint(1, 4)
        min_n = rng.randint(1, max_n)
        ctx = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
        index, cut = NgramIndex(max_n, min_n), rng.randint(0, len(ctx))
        index.extend(ctx[:cut])  # grown in two steps, as the decoding loop grows it
        index.extend(ctx[cut:])
        assert index.draft(3) == ngram_draft(ctx, max_n, min_n, 3), (trial, ctx, max_n, min_n)


def test_session_indexes_only_the_new_tail_and_counts_no_drafter_calls():
    s = LookupSession(LookupConfig(max_ngram=2), length=3)
    assert s.draft([1, 2, 3, 1]) == [2, 3, 1]
    assert s.draft([1, 2, 3, 1, 2]) == [3, 1, 2]
    assert len(s.index) == 5 and s.cost.calls == 0 and s.cost.seconds > 0
    s.reset()
    assert len(s.index) == 0 and s.draft([4, 4]) == [4]
    with pytest.raises(ValueError, match="min_ngram"):
        LookupConfig(max_ngram=1, min_ngram=2)
