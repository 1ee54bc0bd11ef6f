"""One evaluation-side spec per drafter, registered once under the drafter's name: what decoding needs
beyond the drafter's module (train/drafters.py registers the training side under the same name; an
exported drafter's config carries it as `cfg.name`).

    register_drafting(DraftingSpec(name, tree, default_tree, arms))

- `tree`: grows the drafter's dynamic draft tree at a `Root` (drafting.py);
- `default_tree`: its tree shape in the evaluation app (`trees.<name>`, evaluate/config.py);
- `arms`: the parameter subsets serving-time adaptation may train besides `lora` (evaluate/adapt/).
The inference session is the same for every drafter (drafting.py): every module answers `extend` and
`draft` with a `DraftStep`.

Trees: `specblock_tree` grows the SpecBlock dynamic tree (greedy chain + per-slot alternatives whose
width the Rank Head sets, leaves re-started as new blocks from their slot's hidden state, pruned to a
token budget by cumulative log-probability); `eagle_tree` grows an EAGLE-2-style dynamic tree (top-k
children of the best `beam` nodes per step; it reads draft laws only, so any drafter may use it).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
from torch import Tensor, nn

from specblock.train.modeling.common import DraftCache

from .drafting import DrafterSession, DraftState, Prefix, Root, stack_caches
from .trees import DraftTree, MoreRounds, TreeBuilder, TreeConfig

# drafter -> the parameters an adaptation arm trains
ArmParameters = Callable[[nn.Module], list[nn.Parameter]]


@dataclass(frozen=True)
class DraftingSpec:
    """A drafter type as decoding sees it (module docstring)."""

    name: str
    tree: TreeBuilder
    default_tree: TreeConfig
    arms: dict[str, ArmParameters] = field(default_factory=dict)


DRAFTING_SPECS: dict[str, DraftingSpec] = {}


def register_drafting(spec: DraftingSpec) -> DraftingSpec:
    if spec.name in DRAFTING_SPECS:
        raise ValueError(f"drafter {spec.name!r} is registered twice for decoding")
    DRAFTING_SPECS[spec.name] = spec
    return spec


def drafting_spec(name: str) -> DraftingSpec:
    if name not in DRAFTING_SPECS:
        raise KeyError(f"no decoding spec for drafter {name!r}; registered: {sorted(DRAFTING_SPECS)}")
    return DRAFTING_SPECS[name]


def default_trees() -> dict[str, TreeConfig]:
    """Every registered drafter's tree shape, by name (the evaluation app's `trees` default)."""
    return {name: copy.deepcopy(spec.default_tree) for name, spec in DRAFTING_SPECS.items()}


def make_session(drafter: nn.Module, vocab_size: int, temperature: float, top_p: float) -> DrafterSession:
    """The inference session of a drafter module, with its spec's tree builder."""
    return DrafterSession(drafter, vocab_size, temperature, top_p, drafting_spec(drafter.cfg.name).tree)


def _draft_logprobs(logits: Tensor) -> Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


# ---------------------------------------------------------------- SpecBlock


class Block(NamedTuple):
    """A block drafted into the tree: the node it hangs from, its state, its token offset after the root."""

    parent: int
    state: DraftState
    offset: int


class Leaf(NamedTuple):
    """A tree node a new block may start from: its score and node, the block (index) and slot it lies in."""

    score: float
    node: int
    block: int
    slot: int


def specblock_tree(root: Root, cfg: TreeConfig, more: MoreRounds | None = None) -> DraftTree:
    """The SpecBlock dynamic tree (docs/specblock.md 1.3-1.4): each block lays a greedy chain with per-slot
    alternatives (top-k by the Rank Head's class); the best `beam` pending leaves (alternatives, greedy
    nodes of branching slots, the chain's end) start new blocks from their slot's hidden state, for
    `steps` rounds; the tree is then pruned to `budget` nodes by cumulative draft log-prob."""
    K, d2t = root.width, root.session.d2t
    table = torch.tensor(cfg.topk_per_class)
    tree = DraftTree()
    blocks = [Block(0, root.state(()), 0)]
    for step in range(cfg.steps):
        pending: list[Leaf] = []
        for b, block in enumerate(blocks):
            widths = table[block.state.rank_logits.argmax(-1).cpu()].tolist()
            logp = _draft_logprobs(block.state.logits)  # [K,Vd]
            node = block.parent
            for k in range(K):
                width = min(widths[k], cfg.topk)
                if width == 0:
                    break
                top = logp[k].topk(width)
                ids = d2t[top.indices].tolist()
                children = [
                    tree.add(node, t, tree.score[node] + float(s), step) for t, s in zip(ids, top.values)
                ]
                pending += [Leaf(tree.score[c], c, b, k) for c in children[1:]]
                if width > 1 or k == K - 1:  # a branching slot's greedy node, and the chain's end
                    pending.append(Leaf(tree.score[children[0]], children[0], b, k))
                node = children[0]
        if step == cfg.steps - 1 or not pending:
            break
        pending = sorted(pending, key=lambda leaf: (-leaf.score, leaf.node))[: cfg.beam]
        if more is not None:  # the auto budget: only the leaves whose blocks could be kept (budget.py)
            pending = pending[: more(tree.score[1:], [leaf.score for leaf in pending])]
            if not pending:
                break
        blocks = _next_blocks(root, tree, blocks, pending)
    return tree.pruned(cfg.drafted).tree


def _next_blocks(root: Root, tree: DraftTree, blocks: list[Block], leaves: list[Leaf]) -> list[Block]:
    """One batched drafter call: a new block from every leaf, started from its slot's hidden state with
    the leaf's token, seeing its block's slots up to the leaf's only."""
    device = root.session.device
    hidden = torch.stack([blocks[leaf.block].state.hidden[leaf.slot] for leaf in leaves])  # [n,H]
    token = torch.tensor([tree.tokens[leaf.node] for leaf in leaves], device=device)
    offsets = torch.tensor([blocks[leaf.block].offset + leaf.slot + 1 for leaf in leaves], device=device)
    past = _leaf_caches([(blocks[leaf.block].state.cache, leaf.slot, root.width) for leaf in leaves])
    step = root.session.draft(hidden, token, past, position=root.position + offsets, offset=0)
    states = DraftState.rows(step)
    return [Block(leaf.node, state, int(offsets[i])) for i, (leaf, state) in enumerate(zip(leaves, states))]


def _leaf_caches(sources: list[tuple[DraftCache, int, int]]) -> DraftCache:
    """Batch the caches (batch 1) of leaves started from slot m of a block whose K entries are the last K
    entries its cache shows: every row keeps the block's slots <= m visible and hides the later ones.
    Leaves of one block share its stored entries (a shared cache, no copy of the context per leaf)."""
    caches = []
    for cache, m, K in sources:
        vis = cache.visible.clone() if cache.visible is not None else cache.all_visible(1)
        block = vis[0].nonzero().flatten()[-K:]  # the block's own entries (appended after all it sees)
        vis[0, block[m + 1 :]] = False
        caches.append(DraftCache(cache.keys, cache.values, vis))
    return stack_caches(caches)


def rank_head_parameters(drafter: nn.Module) -> list[nn.Parameter]:
    return list(drafter.rank_head.parameters())


def last_block_layer_parameters(drafter: nn.Module) -> list[nn.Parameter]:
    return [*drafter.layers[-1].parameters(), *drafter.norm.parameters()]


# ---------------------------------------------------------------- EAGLE-3


class Child(NamedTuple):
    """A node of the newest layer of an EAGLE tree: its score, node and the prefix it ends."""

    score: float
    node: int
    prefix: Prefix


def eagle_tree(root: Root, cfg: TreeConfig, more: MoreRounds | None = None) -> DraftTree:
    """EAGLE-2's dynamic tree: the root's top-k children, then `steps - 1` rounds that expand the `beam`
    best nodes of the newest layer by cumulative log-prob with their top-k children each (one batched
    drafter step per round); pruned to `budget` nodes."""
    tree, frontier = DraftTree(), [()]
    node_of: dict[Prefix, int] = {(): 0}
    for step in range(cfg.steps):
        if step and more is not None and not more(tree.score[1:], [tree.score[node_of[y]] for y in frontier]):
            break
        logits = root.logits(frontier)  # one batched call for the frontier (the root's is precomputed)
        layer = []
        for y, lg in zip(frontier, logits):
            top = _draft_logprobs(lg).topk(cfg.topk)
            for t, s in zip(root.session.d2t[top.indices].tolist(), top.values):
                n = tree.add(node_of[y], t, tree.score[node_of[y]] + float(s), step)
                node_of[y + (t,)] = n
                layer.append(Child(tree.score[n], n, y + (t,)))
        frontier = [c.prefix for c in sorted(layer, key=lambda c: (-c.score, c.node))[: cfg.beam]]
    return tree.pruned(cfg.drafted).tree


def midlayer_parameters(drafter: nn.Module) -> list[nn.Parameter]:
    return [*drafter.midlayer.parameters(), *drafter.norm.parameters()]


# docs/specblock.md 1.4: SpecBlock serves 2 block rounds, beam 10, budget 90; EAGLE-3 7 steps, top-10,
# budget 60. Budgets are scaled down for a CPU target (tree tokens cost target time here).
register_drafting(
    DraftingSpec(
        "specblock",
        specblock_tree,
        TreeConfig(budget=32, steps=2, beam=10, topk=10),
        {"rank_head": rank_head_parameters, "last_layer": last_block_layer_parameters},
    )
)
register_drafting(
    DraftingSpec(
        "eagle3",
        eagle_tree,
        TreeConfig(budget=32, steps=5, beam=8, topk=8),
        {"last_layer": midlayer_parameters},
    )
)
