"""Verification of a drafted token tree (docs/verifiers.md section 6b-6d).

A tree holds N nodes; node 0 is the root (the last verified position, no token of its own) and every
other node n has parents[n] < n and a token. Children are tried in node order. Per node:
target_probs[n] = q(. | context, path to n) and, for sampled trees, draft_probs[n] = the law p(. | ...)
that n's children were drawn from.

Modes:
- "sampled": children drawn WITHOUT replacement from draft_probs (MCSD, EAGLE-1, RSD). Child j is
  accepted w.p. min(1, r_j(c_j) / p_j(c_j)), p_j = p with c_1..c_{j-1} removed and renormalised (the
  law it was really drawn from, EAGLE issue #74); on reject r_{j+1} = (r_j - p_j)_+ normalised.
- "deterministic": children chosen by the drafter without sampling (top-k, static or dynamic trees such
  as SpecBlock's rank-head tree). The target-only rule: accept child c w.p. r(c), else r(c) <- 0 and
  renormalise; equal in law to drawing Y ~ q and descending iff Y is a child. Using min(1, q/p) with the
  draft's top-k probability is NOT lossless (EAGLE issues #93, #110).
- "greedy": temperature 0, follow the child equal to argmax q at every node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .chain import clipped_ratio
from .multidraft import greedy_token
from .randomness import ACC_DTYPE, Sampler, make_sampler, residual

TREE_MODES = ("sampled", "deterministic", "greedy")


@dataclass(frozen=True)
class TokenTree:
    parents: list[int]  # [N], parents[0] = -1, parents[n] < n
    tokens: list[int]  # [N], tokens[0] is ignored (the root)

    def __post_init__(self):
        if len(self.parents) != len(self.tokens) or not self.parents or self.parents[0] != -1:
            raise ValueError("a tree needs parents[0] = -1 and one token per node")
        if any(not 0 <= par < n for n, par in enumerate(self.parents) if n > 0):
            raise ValueError(f"every node n > 0 needs 0 <= parents[n] < n, got {self.parents}")

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.parents]
        for n, par in enumerate(self.parents[1:], start=1):
            kids[par].append(n)
        return kids


@dataclass(frozen=True)
class TreeVerifyOutput:
    path: list[int]  # accepted nodes, root excluded, in order from the root
    next_token: int  # correction, or bonus when the path ends at a leaf

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def _sampled_rule(q, p, tokens, s: Sampler):
    r, pw = q, p
    for j, x in enumerate(tokens):
        if s.bernoulli(float(clipped_ratio(r[x], pw[x]))):
            return j, None
        r = residual((r - pw).clamp_min(0), r)
        pw = pw.clone()
        pw[x] = 0.0  # the next child was drawn without this one
        pw = residual(pw, r)
    return None, r


def _deterministic_rule(q, p, tokens, s: Sampler):
    r = q
    for j, x in enumerate(tokens):
        if s.bernoulli(float(r[x])):
            return j, None
        r = r.clone()
        r[x] = 0.0
        r = residual(r, q)
    return None, r


def _greedy_rule(q, p, tokens, s: Sampler):
    best = greedy_token(q)
    return (tokens.index(best), None) if best in tokens else (None, best)


_RULES = {"sampled": _sampled_rule, "deterministic": _deterministic_rule, "greedy": _greedy_rule}


def verify_tree(
    tree: TokenTree,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    mode: str = "deterministic",
    generator: torch.Generator | None = None,
    sampler: Sampler | None = None,
) -> TreeVerifyOutput:
    """Walk the tree from the root. target_probs: [N, V]; draft_probs: [N, V], needed for "sampled"."""
    if mode not in _RULES:
        raise ValueError(f"unknown tree mode {mode!r}; choose one of {TREE_MODES}")
    if mode == "sampled" and draft_probs is None:
        raise ValueError("mode 'sampled' needs draft_probs: the law each node's children were drawn from")
    if target_probs.shape[0] != len(tree.parents):
        raise ValueError(
            f"target_probs has {target_probs.shape[0]} rows for a tree of {len(tree.parents)} nodes"
        )
    s, rule, kids = make_sampler(generator, sampler), _RULES[mode], tree.children()
    node, path = 0, []
    while True:
        q = target_probs[node].to(ACC_DTYPE)
        if not kids[node]:  # a leaf: bonus token
            return TreeVerifyOutput(path, s.categorical(q))
        p = draft_probs[node].to(ACC_DTYPE) if draft_probs is not None else q
        choice, correction = rule(q, p, [tree.tokens[c] for c in kids[node]], s)
        if choice is None:
            token = correction if isinstance(correction, int) else s.categorical(correction)
            return TreeVerifyOutput(path, token)
        node = kids[node][choice]
        path.append(node)


def greedy_path(tree: TokenTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """Temperature-0 verification of any draft tree (a `TokenTree`, or anything with its `parents` and
    `tokens`, e.g. the decoding loop's `DraftTree`): from the root, follow the child whose token is the
    target's argmax at its parent; the first argmax with no such child is the next token. logits [N, V]
    (the target at every node). Every lossless verifier does this at temperature 0 (the target law is a
    point mass), so it reads N argmaxes instead of forming [N, V] float64 laws.
    Returns (accepted nodes, root excluded, in order; next token)."""
    top = logits.argmax(-1).tolist()  # first index on ties, as next_token_law's one-hot
    child = {(p, t): n for n, (p, t) in enumerate(zip(tree.parents, tree.tokens)) if n > 0}
    path, node = [], 0
    while (node, top[node]) in child:
        node = child[(node, top[node])]
        path.append(node)
    return path, top[node]
