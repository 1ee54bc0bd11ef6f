"""`tree+lookup`: the drafter's dynamic tree with prompt lookup's n-gram draft grafted on as one more
branch. Both are deterministic drafts, so the target-only tree rule keeps the target's law; the tests
check greedy equality, the exact law of whole generations, that the grafted branch is what gets accepted
where the drafter misses, and that a lossy verifier is caught."""

from __future__ import annotations

import dataclasses

import pytest

from specblock.evaluate.config import EvalConfig, parse_method
from specblock.evaluate.decoding.budget import PROBE_EVERY, AutoBudget, ForwardCurve
import torch

from specblock.evaluate.decoding import loop as decode_mod
from specblock.evaluate.decoding.drafters import make_session
from specblock.evaluate.decoding.lookup import NgramIndex
from specblock.evaluate.decoding.loop import DecodeConfig, SpeculativeDecoder
from specblock.evaluate.decoding.trees import DraftTree, TreeConfig, graft_chain
from specblock.evaluate.run import decode_config
from specblock.evaluate.verify import tree as tree_mod

from tiny_decoding import HORIZON, PROMPT, VOCAB, drafters, exact_law, loop_law, max_error, tiny_target

REPEATS = [3, 3, 4, 3, 3, 4, 3]  # a prompt with repeated spans: lookup drafts from the start
LOOKUP_PROMPT = [5, 9, 3, 11, 12, 7, 23, 5, 9, 3]  # test_lookup.py's: its first lookup draft is often right
SMALL_TREE = TreeConfig(budget=6, steps=1, beam=2, topk=2)


@pytest.fixture(scope="module")
def greedy_setup():
    target = tiny_target(64, 1.0)
    return target, drafters(target)


def test_graft_chain_merges_shared_prefixes_and_appends_new_nodes():
    tree = DraftTree()
    a = tree.add(0, 7, -0.1)
    tree.add(a, 8, -0.5)
    graft_chain(tree, [7, 9, 4])  # shares node a, then leaves the tree
    assert tree.tokens == [-1, 7, 8, 9, 4] and tree.parents == [-1, 0, 1, 1, 3]
    assert tree.score[3:] == [-0.1, -0.1]  # new nodes take their parent's score
    assert tree.path_tokens(4) == (7, 9, 4)
    graft_chain(tree, [])  # no match: nothing changes
    assert len(tree) == 5


def test_graft_chain_with_scores_keeps_the_larger_score_of_a_shared_node():
    tree = DraftTree()
    a = tree.add(0, 7, -0.1)
    b = tree.add(a, 8, -2.0)
    assert graft_chain(tree, [7, 8, 5], [0.3, -1.0, -1.5]) == [a, b, 3]
    assert tree.score[1:] == [0.3, -1.0, -1.5]
    assert graft_chain(tree, [7], [-5.0]) == [a] and tree.score[a] == 0.3


def test_lookup_confidences_are_measured_per_match_length_and_depth_and_never_rise():
    auto = AutoBudget()
    assert auto.lookup_confidences(3, 2) == [0.5, 0.5, 0.5]  # the prior
    for kept, accepted in ((3, 3), (3, 1), (2, 0), (3, 3)):
        auto.observe_lookup(kept, accepted, 2)
    auto.observe_lookup(4, 0, 1)  # a 1-gram match: counted apart
    assert auto.lookup_drafted[2] == [4, 4, 3] and auto.lookup_accepted[2] == [3, 2, 2]
    # depth 1: (1 + 3) / (2 + 4); depth 2: (1 + 2) / 6; depth 3: (1 + 2) / 5 = 0.6, held at depth 2's 0.5
    assert auto.lookup_confidences(4, 2) == pytest.approx([4 / 6, 3 / 6, 3 / 6, 3 / 6])
    assert auto.lookup_confidences(2, 1) == pytest.approx([1 / 3, 1 / 3])
    assert auto.lookup_confidences(1, 3) == [0.5]


def test_the_index_names_the_match_length_its_draft_followed():
    index = NgramIndex(3, 1)
    index.extend([1, 2, 3, 9, 1, 2, 3])
    assert index.draft(2) == [9, 1] and index.matched == 3
    index.extend([4])
    assert index.draft(2) == [] and index.matched == 0
    index.extend([3])
    assert index.draft(1) == [4] and index.matched == 1  # "3" last followed by 4


def test_auto_tree_lookup_keeps_a_reliable_chain_and_drops_an_unreliable_one(greedy_setup):
    """With budget=auto the chain competes for the budget by its measured acceptance: on a prompt the
    target loops on, the chain is kept whole; once lookup has been measured to fail, its tokens lose to
    the drafter's nodes and are cut. The tiny target's forward costs the same at every width, which would
    make every node free: the curve is set to a CPU's slope (5 ms per token fed)."""
    target, ds = greedy_setup
    tree = TreeConfig(budget="auto", max_budget=6, steps=1, beam=2, topk=2)
    cfg = DecodeConfig("tree+lookup", draft_length=4, temperature=0.0, max_new_tokens=24, tree=tree)
    dec = SpeculativeDecoder(target, ds["eagle3"], cfg)
    dec.auto.curve = ForwardCurve([1, 64], [10.0, 10.0 + 63 * 5.0])  # measured only when None
    dec.generate(REPEATS)
    kept = sum(map(sum, dec.auto.lookup_drafted.values()))
    assert sum(sum(hits[:1]) for hits in dec.auto.lookup_accepted.values()) >= 3 and kept >= 8
    dec.auto.lookup_drafted = {n: [10_000] * 4 for n in range(4)}  # measured: lookup tokens never accepted
    dec.auto.lookup_accepted = {n: [0] * 4 for n in range(4)}
    out = dec.generate(REPEATS)
    after = sum(map(sum, dec.auto.lookup_drafted.values())) - 160_000
    assert after <= len(out.iterations)  # at most one token per iteration


@pytest.mark.parametrize("drafter", ["specblock", "eagle3"])
def test_catching_up_in_one_call_equals_appending_iteration_by_iteration(greedy_setup, drafter):
    """On demand, the drafter appends the positions of several iterations in one call (`_catch_up`): its
    next root drafts what appending them one iteration at a time would have drafted."""
    target, ds = greedy_setup
    ids = torch.tensor([PROMPT + [7, 2, 11, 4, 9, 30]])
    features = target(ids, with_logits=False).features[0]
    after = ids[0, 1:]
    chunks = [(0, 4), (4, 6), (6, 9)]  # the prefill, then two iterations' verified positions
    one = make_session(ds[drafter], target.vocab_size, 0.0, 1.0)
    for a, b in chunks:
        step = one.advance(features[a:b], after[a:b], a)
    both = make_session(ds[drafter], target.vocab_size, 0.0, 1.0)
    both.advance(features[:4], after[:4], 0)
    caught = both.advance(features[4:9], after[4:9], 4)
    torch.testing.assert_close(caught.logits([()]), step.logits([()]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caught.logits([(5,)]), step.logits([(5,)]), rtol=1e-5, atol=1e-5)


def test_auto_tree_lookup_leaves_the_drafter_out_where_the_chain_alone_pays(greedy_setup):
    """The gate: measured that the drafter adds nothing beside a chain while it costs 50 ms, iterations
    with a lookup chain run no drafter call (but every PROBE_EVERY-th, which keeps measuring), and the
    output stays greedy."""
    target, ds = greedy_setup
    tree = TreeConfig(budget="auto", max_budget=6, steps=1, beam=2, topk=2)
    cfg = DecodeConfig("tree+lookup", draft_length=4, temperature=0.0, max_new_tokens=24, tree=tree)
    dec = SpeculativeDecoder(target, ds["eagle3"], cfg)
    dec.auto.curve = ForwardCurve([1, 64], [10.0, 10.0 + 63 * 5.0])
    dec.auto.gate_iterations, dec.auto.gate_gain, dec.auto.gate_nodes, dec.auto.gate_ms = 10, 0.0, 40.0, 500.0
    seen, inner = [], dec.graft.lookup.draft
    monkey = lambda context, **kw: seen.append(inner(context, **kw)) or seen[-1]  # noqa: E731
    dec.graft.lookup.draft = monkey
    ar = DecodeConfig(mode="autoregressive", temperature=0.0, max_new_tokens=24)
    out = dec.generate(REPEATS)
    assert out.tokens == SpeculativeDecoder(target, None, ar).generate(REPEATS).tokens
    calls = [it.drafter_calls for it in out.iterations]
    streak = 0  # drafter-less iterations in a row: the PROBE_EVERY-th asks the drafter again
    for c, chain in zip(calls, seen):
        if chain:
            assert c == 0 or streak == PROBE_EVERY - 1
        streak = streak + 1 if c == 0 else 0
    assert sum(c == 0 for c, chain in zip(calls, seen) if chain) >= 3


def accepted_from_lookup(dec: SpeculativeDecoder, monkeypatch) -> list[int]:
    """Wraps the decoder's iteration: per iteration, the accepted nodes that only the lookup branch had."""
    seen, inner = [], dec._iteration

    def spy(*args):
        step = inner(*args)
        seen.append(step.stats.accepted - min(step.stats.accepted, dec._drafter_accepted))
        return step

    monkeypatch.setattr(dec, "_iteration", spy)
    return seen


@pytest.mark.parametrize("drafter", ["specblock", "eagle3"])
@pytest.mark.parametrize("budget", [6, "auto"])
def test_tree_lookup_greedy_equals_target_greedy(greedy_setup, drafter, budget, monkeypatch):
    """Greedy equality in float32 with fixed and auto budgets, and the lookup branch does get accepted
    (an untrained drafter rarely guesses the looping target; the n-gram match does)."""
    target, ds = greedy_setup
    ar = DecodeConfig(mode="autoregressive", temperature=0.0, max_new_tokens=24)
    tree = TreeConfig(budget=budget, max_budget=6, steps=1, beam=2, topk=2)
    cfg = DecodeConfig("tree+lookup", draft_length=4, temperature=0.0, max_new_tokens=24, tree=tree)
    dec = SpeculativeDecoder(target, ds[drafter], cfg)
    from_lookup = accepted_from_lookup(dec, monkeypatch)
    for prompt in (PROMPT, [7, 2], REPEATS):
        ref = SpeculativeDecoder(target, None, ar).generate(prompt)
        out = dec.generate(prompt)
        assert out.tokens == ref.tokens
        assert out.target_calls == out.prefill_calls + len(out.iterations)
        if budget != "auto":  # a fixed budget drafts every iteration; auto may leave the drafter out
            assert all(it.drafter_calls >= 1 for it in out.iterations)
    assert sum(from_lookup) >= 5
    if budget == "auto":  # the forward curve reaches the drafter's nodes, the lookup branch and the root
        assert dec.auto.curve.sizes[-1] == 6 + 4 + 1


def test_tree_lookup_calibrates_the_budget_on_the_drafters_nodes_only(greedy_setup):
    """The auto budget's c counts accepted drafter nodes, not those of the lookup branch: on a prompt the
    lookup branch drafts well, its calibration sees fewer accepted nodes than the loop emitted."""
    target, ds = greedy_setup
    tree = TreeConfig(budget="auto", max_budget=6, steps=1, beam=2, topk=2)
    cfg = DecodeConfig("tree+lookup", draft_length=4, temperature=0.0, max_new_tokens=24, tree=tree)
    dec = SpeculativeDecoder(target, ds["eagle3"], cfg)
    out = dec.generate(REPEATS)
    assert dec.auto.accepted < sum(it.accepted for it in out.iterations)


@pytest.mark.parametrize("drafter", ["specblock", "eagle3"])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 0.5), (0.7, 0.5)])
def test_exact_law_of_tree_lookup_decoding(drafter, temperature, top_p):
    """The law of three generated tokens through the real loop (trees of the drafter's top-k and the
    n-gram branch, target-only rule, every coin enumerated) equals the target's."""
    target = tiny_target(VOCAB, 12.0, seed=2)
    ds = drafters(target, seed=3)
    cfg = DecodeConfig(
        "tree+lookup", draft_length=2, temperature=temperature, top_p=top_p, max_new_tokens=HORIZON,
        tree=SMALL_TREE,
    )  # fmt: skip
    ref, accepted = exact_law(target, temperature, top_p, LOOKUP_PROMPT), []
    law = loop_law(target, ds[drafter], cfg, prompt=LOOKUP_PROMPT, accepted=accepted)
    assert max_error(law, ref) < 1e-6
    assert sum(accepted) > 0.1


def test_exact_law_of_tree_lookup_catches_a_lossy_verifier(monkeypatch):
    """Negative control: a tree rule that always accepts the first child of each node is caught."""
    target = tiny_target(VOCAB, 12.0, seed=2)
    ds = drafters(target, seed=3)
    real = tree_mod.verify_tree

    def first_child(tree, laws, mode, sampler):
        res = real(tree, laws, mode=mode, sampler=sampler)
        kids = [n for n in range(1, len(tree.parents)) if tree.parents[n] == 0]
        if kids and not res.path:  # a rejected root: accept its first child anyway
            return dataclasses.replace(res, path=[kids[0]])
        return res

    monkeypatch.setattr(decode_mod, "verify_tree", first_child)
    cfg = DecodeConfig("tree+lookup", draft_length=2, temperature=1.0, top_p=0.5, max_new_tokens=HORIZON,
                       tree=SMALL_TREE)  # fmt: skip
    law = loop_law(target, ds["eagle3"], cfg, prompt=LOOKUP_PROMPT)
    assert max_error(law, exact_law(target, 1.0, 0.5, LOOKUP_PROMPT)) > 1e-3


def test_tree_lookup_is_a_method_of_the_evaluation_stage():
    assert parse_method("tree+lookup") == ("tree+lookup", "token")
    cfg = EvalConfig(methods=["autoregressive", "tree+lookup"], draft_length="auto", drafters={"eagle3": "x"})
    dc = decode_config(cfg, "tree+lookup", "eagle3")
    assert dc.mode == "tree+lookup" and dc.method == "tree+lookup" and dc.draft_length == 8
    with pytest.raises(ValueError, match="needs a drafter"):
        SpeculativeDecoder(tiny_target(VOCAB, 1.0), None, dc)
