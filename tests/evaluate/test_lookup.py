"""Prompt lookup: the n-gram matcher's rule on hand-made contexts, the incremental index against the
direct search on random ones, and lookup decoding through the real loop (greedy equality, the exact law
of whole generations, a lossy verifier caught)."""

from __future__ import annotations

import random

import pytest

from specblock.evaluate.decoding.loop import DecodeConfig, SpeculativeDecoder
from specblock.evaluate.decoding.lookup import LookupConfig, LookupSession, NgramIndex, ngram_draft
from specblock.evaluate.verify import VerifyOutput
from specblock.evaluate.verify import base as verify_base

from tiny_decoding import HORIZON, PROMPT, REPEATS, VOCAB, exact_law, loop_law, max_error, tiny_target


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


# ---------------------------------------------------------------- prompt lookup (no drafter)

LOOKUP_PROMPTS = [PROMPT, [7, 2], REPEATS, [1, 2, 5, 1, 2, 5, 1]]
# (5, 9, 3), then the 24-token target's greedy continuation of it, then (5, 9, 3) again: the first
# iteration drafts that continuation, which the target often (not always) samples
LOOKUP_PROMPT = [5, 9, 3, 11, 12, 7, 23, 5, 9, 3]


def test_lookup_greedy_equals_target_greedy(greedy_setup):
    target, _ = greedy_setup
    ar = DecodeConfig(mode="autoregressive", temperature=0.0, max_new_tokens=24)
    accepted = 0
    for prompt in LOOKUP_PROMPTS:
        ref = SpeculativeDecoder(target, None, ar).generate(prompt)
        cfg = DecodeConfig("lookup", draft_length=4, temperature=0.0, max_new_tokens=24)
        out = SpeculativeDecoder(target, None, cfg).generate(prompt)
        assert out.tokens == ref.tokens
        assert out.target_calls == out.prefill_calls + len(out.iterations)
        assert all(it.drafter_calls == 0 for it in out.iterations) and out.prefill_drafter_calls == 0
        accepted += sum(it.accepted for it in out.iterations)
    assert accepted >= 10  # the random target loops, and lookup drafts its loops


@pytest.mark.parametrize("temperature,top_p", [(1.0, 0.5), (0.7, 0.5)])
def test_exact_law_of_lookup_decoding(temperature, top_p):
    """Lookup through the real loop (token verifier with a point-mass draft, plain target steps where
    nothing matches): the law of three generated tokens equals the target's, with drafts accepted in a
    good part of the outcomes; a verifier that accepts every draft token is caught (negative control)."""
    target, prompt = tiny_target(VOCAB, 12.0, seed=2), LOOKUP_PROMPT
    cfg = DecodeConfig("lookup", draft_length=2, temperature=temperature, top_p=top_p, max_new_tokens=HORIZON)
    ref, accepted = exact_law(target, temperature, top_p, prompt), []
    law = loop_law(target, None, cfg, prompt=prompt, accepted=accepted)
    assert max_error(law, ref) < 1e-6  # float32 forwards of different shapes
    assert sum(accepted) > 0.1  # P(some draft token accepted): 0.22 at T = 1, 0.16 at T = 0.7


def test_exact_law_of_lookup_catches_a_lossy_verifier(monkeypatch):
    target, prompt = tiny_target(VOCAB, 12.0, seed=2), LOOKUP_PROMPT

    def accept_all(target_probs, draft_probs, draft_tokens, generator=None, *, sampler=None):
        L = draft_tokens.shape[1]
        return VerifyOutput(L, 0, sampler.categorical(target_probs[0, L]))

    monkeypatch.setitem(verify_base.VERIFIERS, "token", accept_all)
    cfg = DecodeConfig("lookup", draft_length=2, temperature=1.0, top_p=0.5, max_new_tokens=HORIZON)
    assert max_error(loop_law(target, None, cfg, prompt=prompt), exact_law(target, 1.0, 0.5, prompt)) > 1e-3


# ---------------------------------------------------------------- the continuation's costs
