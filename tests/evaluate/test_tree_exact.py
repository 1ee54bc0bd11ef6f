"""Tree verification is lossless, proven by exact enumeration over the tree's own sampling (children
drawn without replacement) and every random outcome of the verifier."""

from __future__ import annotations

import pytest
import torch

from specblock.evaluate.verify import TokenTree, verify_tree
from specblock.evaluate.verify.exact import TableModel, enumerate_outcomes, law_error, sequences

TOL = 1e-9


def draw_children(weights: torch.Tensor, width: int, mode: str, s) -> list[int]:
    if mode != "sampled":  # deterministic: the drafter's top-`width` tokens
        return torch.topk(weights, width).indices.tolist()
    w, chosen = weights.clone(), []
    for _ in range(width):  # without replacement, each draw from the renormalised rest
        t = s.categorical(w)
        chosen.append(t)
        w[t] = 0.0
    return chosen


def build_and_verify(target, draft, shape: list[int], mode: str, rule: str, s) -> tuple[int, ...]:
    """Grow a tree of branching `shape` (per depth) from `draft`, verify it, return the emitted tokens."""
    parents, tokens, prefixes, frontier = [-1], [0], [()], [0]
    for width in shape:
        grown = []
        for node in frontier:
            for t in draw_children(draft(prefixes[node]), width, mode, s):
                parents.append(node)
                tokens.append(t)
                prefixes.append(prefixes[node] + (t,))
                grown.append(len(parents) - 1)
        frontier = grown
    tp = torch.stack([target(y) for y in prefixes])
    dp = torch.stack([draft(y) for y in prefixes])
    out = verify_tree(TokenTree(parents, tokens), tp, dp, mode=rule, sampler=s)
    assert out.num_accepted == len(out.path)
    return tuple(tokens[n] for n in out.path) + (out.next_token,)


def tree_law(target, draft, shape, mode, rule):
    law: dict[tuple, float] = {}
    for w, emitted in enumerate_outcomes(lambda s: build_and_verify(target, draft, shape, mode, rule, s)):
        for z, wz in sequences(target, len(shape) + 1 - len(emitted), start=emitted):
            law[emitted + z] = law.get(emitted + z, 0.0) + w * wz
    return law


SHAPES = [[2], [3, 1], [2, 2], [1, 2, 1]]


@pytest.mark.parametrize("shape,vocab", [(shape, 4) for shape in SHAPES] + [([2], 5), ([2, 1], 5)])
def test_sampled_tree_without_replacement_is_lossless(shape, vocab):
    target, draft = TableModel(vocab, seed=vocab, alpha=0.7), TableModel(vocab, seed=50 + vocab, alpha=0.7)
    law = tree_law(target, draft, shape, "sampled", "sampled")
    assert law_error(law, target, len(shape) + 1) < TOL


@pytest.mark.parametrize("shape", SHAPES)
def test_deterministic_tree_target_only_rule_is_lossless(shape):
    target, draft = TableModel(5, seed=3, alpha=0.7), TableModel(5, seed=4, alpha=0.7)
    law = tree_law(target, draft, shape, "topk", "deterministic")
    assert law_error(law, target, len(shape) + 1) < TOL


@pytest.mark.parametrize("rule", ["deterministic", "greedy"])
def test_greedy_tree_follows_argmax_on_a_one_hot_target(rule):
    target, draft = TableModel(4, seed=8, greedy=True), TableModel(4, seed=9, alpha=0.7)
    law = tree_law(target, draft, [2, 2], "topk", rule)
    assert law_error(law, target, 3) < TOL


def test_negative_control_min_q_over_p_on_top_k_children_fails():
    """EAGLE issues #93/#110: accepting deterministic top-k children w.p. min(1, q/p) is not lossless."""
    target, draft = TableModel(5, seed=3, alpha=0.7), TableModel(5, seed=4, alpha=0.7)
    law = tree_law(target, draft, [2, 1], "topk", "sampled")
    assert law_error(law, target, 3) > 1e-3


def test_tree_input_errors():
    with pytest.raises(ValueError, match="parents"):
        TokenTree([0, 0], [0, 1])
    with pytest.raises(ValueError, match="parents\\[n\\] < n"):
        TokenTree([-1, 2, 1], [0, 1, 2])
    tree = TokenTree([-1, 0], [0, 1])
    with pytest.raises(ValueError, match="needs draft_probs"):
        verify_tree(tree, torch.rand(2, 4), mode="sampled")
    with pytest.raises(ValueError, match="unknown tree mode"):
        verify_tree(tree, torch.rand(2, 4), mode="beam")
    with pytest.raises(ValueError, match="rows for a tree of 2 nodes"):
        verify_tree(tree, torch.rand(3, 4))
