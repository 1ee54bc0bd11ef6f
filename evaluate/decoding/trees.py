"""Draft trees: the token tree one iteration verifies, and the shape of a drafter's dynamic tree.

A drafter's tree builder (its spec's, drafters.py) grows a `DraftTree` at a `Root` (drafting.py) as the
`TreeConfig` says; every builder chooses children deterministically (top-k), so the loop verifies the
tree with the target-only rule (verify/tree.py, "deterministic"). Chains and i.i.d. drafts become
trees too (`drafts_tree`: shared prefixes merged), so one target forward serves every mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from specblock.train.rank_labels import RELEASE_TOPK_PER_CLASS

if TYPE_CHECKING:
    from specblock.evaluate.decoding.drafting import Root

Prefix = tuple[int, ...]
AUTO = "auto"  # TreeConfig.budget: chosen per iteration (evaluate/decoding/budget.py)
# (scores of the tree's nodes so far, scores of the nodes the next round would expand) -> how many of those
# nodes (the likeliest first) the round should expand; 0: draft no further round
MoreRounds = Callable[[list[float], list[float]], int]


@dataclass
class TreeConfig:
    """budget: draft tokens kept (the root not counted), or "auto": chosen per iteration by the cost model
    of evaluate/decoding/budget.py among the `max_budget` best nodes; steps: block (SpecBlock) or step
    (EAGLE) rounds; beam: leaves expanded per round; topk: EAGLE children per node and SpecBlock slot-0
    cap; topk_per_class: SpecBlock branching per predicted rank class (0 = stop the block there); default
    the authors' release preset (2, 4, 6, 4) (docs/specblock.md 1.3), which never gives up a slot;
    untrained_rounds: whether `steps` may exceed the blocks a SpecBlock drafter was trained with."""

    budget: Any = 32  # int >= 1 or "auto"
    max_budget: int = 64
    steps: int = 2
    beam: int = 10
    topk: int = 10
    topk_per_class: list[int] = field(default_factory=lambda: list(RELEASE_TOPK_PER_CLASS))
    # SpecBlock: also draft block rounds past the blocks the drafter was trained with (its config.json
    # `trained_blocks`); off, `steps` is capped there (evaluate/config.py)
    untrained_rounds: bool = False

    def __post_init__(self):
        if self.budget != AUTO and not (isinstance(self.budget, int) and self.budget >= 1):
            raise ValueError(f"tree budget must be an int >= 1 or {AUTO!r}, got {self.budget!r}")
        if self.max_budget < 1:
            raise ValueError(f"tree max_budget must be >= 1, got {self.max_budget}")

    @property
    def drafted(self) -> int:
        """The nodes a tree is pruned to when it is drafted (the auto choice prunes further)."""
        return self.max_budget if self.budget == AUTO else self.budget


class Pruned(NamedTuple):
    """`DraftTree.pruned`: the kept tree, and old[i] = the index node i had before."""

    tree: DraftTree
    old: list[int]


@dataclass
class DraftTree:
    """parents[n] < n (node 0 = the root, the last verified token, parent -1); tokens are target ids."""

    parents: list[int] = field(default_factory=lambda: [-1])
    tokens: list[int] = field(default_factory=lambda: [-1])
    depth: list[int] = field(default_factory=lambda: [0])
    score: list[float] = field(default_factory=lambda: [0.0])  # cumulative draft log-prob
    # the drafter round that drafted each node (0: the first, whose logits come with the root; a lookup
    # chain's nodes too): the auto budget measures what each further round adds (budget.py)
    rounds: list[int] = field(default_factory=lambda: [0])

    def __len__(self) -> int:
        return len(self.parents)

    def add(self, parent: int, token: int, score: float, round: int = 0) -> int:
        """A child of `parent` drafted in drafter round `round`; a sibling with the same token is reused
        (keeping the better score and the earlier round)."""
        for n in range(1, len(self.parents)):
            if self.parents[n] == parent and self.tokens[n] == token:
                self.score[n] = max(self.score[n], score)
                self.rounds[n] = min(self.rounds[n], round)
                return n
        self.parents.append(parent)
        self.tokens.append(token)
        self.depth.append(self.depth[parent] + 1)
        self.score.append(score)
        self.rounds.append(round)
        return len(self.parents) - 1

    def pruned(self, budget: int) -> Pruned:
        """The `budget` best non-root nodes by score (ties: older first), with their ancestors (a child never
        outscores its parent, so this is ancestor-closed), renumbered; also the old index of each node."""
        order = sorted(range(1, len(self)), key=lambda n: (-self.score[n], n))[:budget]
        keep = set(order)
        for n in order:  # ancestor closure, defensive against equal scores
            p = self.parents[n]
            while p > 0 and p not in keep:
                keep.add(p)
                p = self.parents[p]
        old = [0, *sorted(keep)]
        new_of = {o: i for i, o in enumerate(old)}
        out = DraftTree([-1], [-1], [0], [0.0], [0])
        for o in old[1:]:
            out.parents.append(new_of[self.parents[o]])
            out.tokens.append(self.tokens[o])
            out.depth.append(self.depth[o])
            out.score.append(self.score[o])
            out.rounds.append(self.rounds[o])
        return Pruned(out, old)

    def path_tokens(self, n: int) -> Prefix:
        out = []
        while n > 0:
            out.append(self.tokens[n])
            n = self.parents[n]
        return tuple(reversed(out))


# (root, shape, optional "draft another round?") -> the drafter's dynamic tree at that root
TreeBuilder = Callable[["Root", TreeConfig, "MoreRounds | None"], DraftTree]


def drafts_tree(tokens: list[list[int]]) -> tuple[DraftTree, list[list[int]]]:
    """The trie of K drafts (shared prefixes merged) and node[k][i] = the node of draft k's first i tokens."""
    tree, nodes = DraftTree(), []
    for draft in tokens:
        path, n = [0], 0
        for t in draft:
            n = tree.add(n, t, 0.0)
            path.append(n)
        nodes.append(path)
    return tree, nodes


def graft_chain(tree: DraftTree, tokens: list[int], scores: list[float] | None = None) -> list[int]:
    """Add the chain `tokens` under the root of `tree` in place, merged with the nodes it shares (a node
    the tree has keeps its index; new nodes come after every existing one). scores[i]: the score of the
    chain's i-th node (a shared node keeps the larger of its two); None: new nodes take their parent's,
    shared ones keep theirs. Returns the chain's node per depth. The target-only rule (verify/tree.py) is
    exact for any tree chosen before the target samples, so a branch from a second drafter (prompt
    lookup) keeps the output law."""
    node, nodes = 0, []
    for i, t in enumerate(tokens):
        kid = next((n for n in range(1, len(tree)) if tree.parents[n] == node and tree.tokens[n] == t), None)
        score = tree.score[node] if scores is None else scores[i]
        if kid is None:
            kid = tree.add(node, t, score)
        elif scores is not None:
            tree.score[kid] = max(tree.score[kid], score)
        node = kid
        nodes.append(node)
    return nodes
