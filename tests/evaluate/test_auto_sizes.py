"""The auto draft length and auto tree budget in the real loop: greedy equality, the exact law of whole
generations with the length chosen per iteration, rounds that cannot pay left undrafted (the cost model
alone: test_budget.py)."""

from __future__ import annotations


import pytest

from specblock.evaluate.decoding import loop as decode_mod
from specblock.evaluate.decoding.loop import DecodeConfig, SpeculativeDecoder
from specblock.evaluate.decoding.trees import TreeConfig

from tiny_decoding import (
    HORIZON,
    PROMPT,
    exact_law,
    loop_law,
    max_error,
)


def frozen_auto(monkeypatch, ms_per_token: float):
    """The auto length's choice made deterministic (exact enumeration replays the loop many times): a
    fixed forward curve, no online updates of c, the fixed cost or the drafting cost."""
    from specblock.evaluate.decoding import budget

    curve = budget.ForwardCurve([1, 64], [10.0, 10.0 + 63 * ms_per_token])
    monkeypatch.setattr(budget, "measure_forward_curve", lambda probe, grid: curve)
    monkeypatch.setattr(decode_mod, "measure_forward_curve", lambda probe, grid: curve)
    monkeypatch.setattr(budget.AutoBudget, "observe", lambda self, *a: None)
    monkeypatch.setattr(budget.AutoBudget, "observe_drafting", lambda self, *a: None)


def test_exact_law_of_auto_draft_length(exact_setup, monkeypatch):
    """draft_length=auto at temperature > 0: drafting stops on the tokens before, never cutting a drafted
    token on its own value, so the law of generations is the target's. (Cutting after seeing, as at
    temperature 0, is biased in general: V = 2, p = (.5, .5), q = (.9, .1), keep x only if x = 1 gives
    (.85, .15). On this target's top-p laws the cut rarely depends on the value: an error of 5e-8 only,
    so it is not used as a negative control here.)"""
    target, ds = exact_setup
    frozen_auto(monkeypatch, ms_per_token=4.0)  # a forward that grows: chains of 1-3 tokens
    ref = exact_law(target, 1.0, 0.5)
    cfg = DecodeConfig("chain", "token", 1, 3, 1.0, 0.5, max_new_tokens=HORIZON, auto_length=True)
    lengths = []
    choose = decode_mod.AutoBudget.draft_more
    monkeypatch.setattr(
        decode_mod.AutoBudget, "draft_more", lambda self, c: lengths.append(len(c)) or choose(self, c)
    )
    assert max_error(loop_law(target, ds["eagle3"], cfg), ref) < 1e-6
    assert 1 in lengths and 2 in lengths  # the rule stopped early and went on, depending on the draft


@pytest.mark.parametrize("drafter", ["specblock", "eagle3"])
@pytest.mark.parametrize("ms_per_token, length", [(0.0, 6), (50.0, 1)])
def test_auto_draft_length_keeps_greedy_equality(greedy_setup, drafter, ms_per_token, length, monkeypatch):
    """Free width drafts whole chains of max length, expensive width one token; both exact."""
    target, ds = greedy_setup
    frozen_auto(monkeypatch, ms_per_token)
    ar = DecodeConfig(mode="autoregressive", temperature=0.0, max_new_tokens=20)
    cfg = DecodeConfig("chain", "token", 1, 6, 0.0, max_new_tokens=20, auto_length=True)
    dec = SpeculativeDecoder(target, ds[drafter], cfg)
    for prompt in (PROMPT, [7, 2]):
        assert dec.generate(prompt).tokens == SpeculativeDecoder(target, None, ar).generate(prompt).tokens
    assert dec.auto.chosen and set(dec.auto.chosen) == {length}


@pytest.mark.parametrize("drafter, depth", [("specblock", 3), ("eagle3", 1)])
def test_auto_tree_stops_drafting_rounds_that_cannot_pay(greedy_setup, drafter, depth, monkeypatch):
    """With drafter rounds known to cost a second each, budget=auto drafts the first round only (the
    root's own: EAGLE-3's first step, SpecBlock's first block of 3 slots) and stays exact."""
    target, ds = greedy_setup
    frozen_auto(monkeypatch, ms_per_token=0.0)
    tree = TreeConfig(budget="auto", max_budget=12, steps=3, beam=4, topk=4)
    dec = SpeculativeDecoder(
        target, ds[drafter], DecodeConfig("tree", temperature=0.0, max_new_tokens=20, tree=tree)
    )
    dec.auto.rounds, dec.auto.round_total_ms = 1, 1000.0
    ar = DecodeConfig(mode="autoregressive", temperature=0.0, max_new_tokens=20)
    for prompt in (PROMPT, [7, 2]):
        out = dec.generate(prompt)
        assert out.tokens == SpeculativeDecoder(target, None, ar).generate(prompt).tokens
        assert all(it.draft_len <= depth for it in out.iterations)
        # the catch-up on the verified positions only (the drafter on demand: graft.py), or no call where the
        # gate takes a plain step
        assert all(it.drafter_calls <= 1 for it in out.iterations)
        if prompt == PROMPT:  # nothing measured yet: the first iteration drafts (later the gate may shut)
            assert out.iterations[0].drafter_calls == 1


def test_specblock_round_starts_blocks_from_the_leaves_the_budget_keeps(greedy_setup, monkeypatch):
    """budget=auto: the second block round starts blocks only from the leaves `more_rounds` counts (the
    likeliest first), one drafter row each, and the decoding stays exact."""
    from specblock.evaluate.decoding import budget, drafters

    target, ds = greedy_setup
    frozen_auto(monkeypatch, ms_per_token=0.0)
    monkeypatch.setattr(budget.AutoBudget, "more_rounds", lambda self, scores, frontier: 2)
    rows = []
    next_blocks = drafters._next_blocks
    monkeypatch.setattr(
        drafters,
        "_next_blocks",
        lambda r, t, b, leaves: rows.append(len(leaves)) or next_blocks(r, t, b, leaves),
    )
    tree = TreeConfig(budget="auto", max_budget=12, steps=2, beam=4, topk=4)
    dec = SpeculativeDecoder(
        target, ds["specblock"], DecodeConfig("tree", temperature=0.0, max_new_tokens=16, tree=tree)
    )
    ar = DecodeConfig(mode="autoregressive", temperature=0.0, max_new_tokens=16)
    assert dec.generate(PROMPT).tokens == SpeculativeDecoder(target, None, ar).generate(PROMPT).tokens
    assert rows and set(rows) == {2}


def test_auto_draft_length_is_refused_for_trees():
    with pytest.raises(ValueError, match="draft_length=auto"):
        DecodeConfig("tree", "token", 1, 4, auto_length=True)
    for mode, verifier, k in (("iid", "spectr", 2), ("chain", "greedy_block", 1), ("iid", "spectr_gbv", 2)):
        DecodeConfig(mode, verifier, k, 4, auto_length=True)  # chosen before drafting (budget.py)


def lengths_by_position(monkeypatch, pattern: dict[int, int], clamp: bool = True) -> list[tuple]:
    """draft_length=auto chosen up front made a function of the tokens generated so far (exact enumeration
    replays one decoder many times, so the choice must not depend on earlier replays): pattern[len(out)],
    raised to the loop's `shortest` unless clamp is off. Returns the (generated, shortest, L) it chose."""
    from specblock.evaluate.decoding.budget import AutoBudget

    seen, where = [], [0]
    iteration = SpeculativeDecoder._iteration

    def counting(self, prompt, out, *args):
        where[0] = len(out)
        return iteration(self, prompt, out, *args)

    def choose(self, width, longest, shortest=1):
        n = pattern.get(where[0], longest)
        n = max(n, shortest) if clamp else n
        seen.append((where[0], shortest, n))
        return n

    monkeypatch.setattr(SpeculativeDecoder, "_iteration", counting)
    monkeypatch.setattr(AutoBudget, "choose_up_front", choose)
    return seen


@pytest.mark.parametrize(
    "mode,verifier,k,pattern",
    [
        ("iid", "rrs", 1, {1: 2, 2: 1}),
        ("iid", "spectr_gbv", 1, {1: 2, 2: 1}),  # K = 1: with K = 2 one case took 110-215 s to enumerate
        ("chain", "greedy_block", 1, {1: 2, 2: 1}),  # a block verifier's chain at T > 0: chosen up front
    ],
)
def test_exact_law_of_auto_iid_draft_length(exact_setup, mode, verifier, k, pattern, monkeypatch):
    """draft_length=auto for i.i.d. drafts and block verifiers: L chosen before drafting from the past, so
    each iteration is a fixed-length verification and the law of generations is the target's, with L
    changing between iterations, also while a continuation of a longer block is in force (its horizon is
    the block's own L). The loop's first iteration starts after one token (the prefill's)."""
    target, ds = exact_setup
    ref = exact_law(target, 1.0, 0.5)
    seen = lengths_by_position(monkeypatch, pattern)
    cfg = DecodeConfig(mode, verifier, k, 2, 1.0, 0.5, max_new_tokens=HORIZON, auto_length=True)
    assert max_error(loop_law(target, ds["eagle3"], cfg), ref) < 1e-6
    assert {n for *_, n in seen} == {1, 2}


def test_auto_tree_takes_plain_steps_where_the_drafter_does_not_pay(greedy_setup, monkeypatch):
    """The gate (AutoBudget.lookup_alone with no chain): measured that the drafter's nodes are never accepted
    while a call costs 500 ms, a tree with budget=auto takes plain target steps (no drafter call, no
    draft node) but every PROBE_EVERY-th iteration, which asks the drafter again; where the drafter pays, it
    drafts every iteration. Greedy equality either way."""
    from specblock.evaluate.decoding import budget

    target, ds = greedy_setup
    frozen_auto(monkeypatch, ms_per_token=1.0)
    monkeypatch.setattr(budget.AutoBudget, "observe_solo", lambda self, *a: None)  # the measured costs stay
    tree = TreeConfig(budget="auto", max_budget=6, steps=1, beam=2, topk=2)
    ar = DecodeConfig(mode="autoregressive", temperature=0.0, max_new_tokens=24)
    ref = SpeculativeDecoder(target, None, ar).generate(PROMPT).tokens
    for gain, ms, pays in [(0.0, 500.0, False), (30.0, 1.0, True)]:
        dec = SpeculativeDecoder(
            target, ds["eagle3"], DecodeConfig("tree", temperature=0.0, max_new_tokens=24, tree=tree)
        )
        auto = dec.auto
        auto.solo_iterations, auto.solo_weight = budget.SOLO_MIN, 10.0
        auto.solo_gain, auto.solo_nodes, auto.solo_ms = gain, 20.0, 10 * ms
        out = dec.generate(PROMPT)
        assert out.tokens == ref
        calls = [it.drafter_calls for it in out.iterations]
        if pays:
            assert all(c == 1 for c in calls) and auto.skipped == 0
        else:
            assert calls[: budget.PROBE_EVERY] == [0] * (budget.PROBE_EVERY - 1) + [1]
            assert sum(calls) == len(calls) // budget.PROBE_EVERY and auto.skipped == len(calls) - sum(calls)
            plain = [it for it, c in zip(out.iterations, calls) if c == 0]
            assert all(it.draft_len == 0 and it.emitted == 1 for it in plain)


def test_exact_law_of_an_auto_tree_with_plain_steps(exact_setup, monkeypatch):
    """At temperature > 0 a plain step (the empty draft tree) between drafted iterations keeps the law of
    whole generations: the gate chooses before anything is sampled. Here it skips the drafter after every
    context of even length (a rule of the past tokens only, as exact enumeration replays the loop)."""
    from specblock.evaluate.decoding import budget, drafts

    target, ds = exact_setup
    frozen_auto(monkeypatch, ms_per_token=1.0)
    steps, draft = [], drafts.Drafts.draft

    def spy(self, root, gen, context, shortest=1):  # the gate below reads the context's length
        self.auto.context = len(context)
        return draft(self, root, gen, context, shortest)

    def gate(self, n, ngram=0):
        steps.append(None if self.context % 2 else 0)
        return steps[-1]

    monkeypatch.setattr(drafts.Drafts, "draft", spy)
    monkeypatch.setattr(budget.AutoBudget, "lookup_alone", gate)
    tree = TreeConfig(budget="auto", max_budget=4, steps=1, beam=2, topk=2)
    cfg = DecodeConfig("tree", temperature=1.0, top_p=0.5, max_new_tokens=HORIZON, tree=tree)
    ref = exact_law(target, 1.0, 0.5)
    assert max_error(loop_law(target, ds["specblock"], cfg), ref) < 1e-6
    assert 0 in steps and None in steps
