"""Drafting at inference: a drafter's cache across iterations, its draft law along any prefix, and trees.

One `DrafterSession` per generation keeps the drafter's committed cache (SpecBlock: block 1's K slots at
every verified context position; EAGLE-3: step 0 at every verified position). After each verification
the loop calls `advance(features, tokens, position)` with the newly verified positions: ONE drafter
forward appends them and yields the draft at the last one, the `Root` of the next iteration.

A `Root` answers "the draft law after prefix y" (y: draft tokens after the root, target ids) for any y,
lazily and memoised, batching every missing prefix of one depth into one drafter call:
- SpecBlock: depth i < K reads slot i of the root block (a block's slots do not see each other's
  sampled tokens, so the law at depth i < K is the same for every y); depth i >= K reads block i // K,
  restarted from slot K-1 of the block before with the token y[bK-1] (cross-block inheritance).
- EAGLE-3: depth i is one more step along y (an autoregressive drafter).
Chains, i.i.d. drafts and the continuation laws of cross-iteration verifiers all read laws this way;
drafts that share a prefix share its work.

Trees: `specblock_tree` grows the SpecBlock dynamic tree (greedy chain + per-slot alternatives whose
width the Rank Head sets, leaves re-started as new blocks from their slot's hidden state, pruned to a
token budget by cumulative log-probability); `eagle_tree` grows an EAGLE-2-style dynamic tree (top-k
children of the best `beam` nodes per step). Both choose children deterministically (top-k), so they
are verified with the target-only rule (tree.py, "deterministic").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from specblock.evaluate.decoding.temperature import next_token_law
from specblock.train.losses import RELEASE_TOPK_PER_CLASS
from specblock.train.modeling.common import DraftCache
from specblock.train.modeling.eagle3 import Eagle3Drafter
from specblock.train.modeling.specblock import SpecBlockDrafter

Prefix = tuple[int, ...]
AUTO = "auto"  # TreeConfig.budget: chosen per iteration (evaluate/budget.py)
# (scores of the tree's nodes so far, scores of the nodes the next round would expand) -> draft that round?
MoreRounds = Callable[[list[float], list[float]], bool]


@dataclass
class DraftCost:
    """Drafter forwards and their wall seconds, accumulated until the loop reads and resets them."""

    calls: int = 0
    seconds: float = 0.0

    def take(self) -> tuple[int, float]:
        out = (self.calls, self.seconds)
        self.calls, self.seconds = 0, 0.0
        return out


@dataclass
class DraftTree:
    """parents[n] < n (node 0 = the root, the last verified token, parent -1); tokens are target ids."""

    parents: list[int] = field(default_factory=lambda: [-1])
    tokens: list[int] = field(default_factory=lambda: [-1])
    depth: list[int] = field(default_factory=lambda: [0])
    score: list[float] = field(default_factory=lambda: [0.0])  # cumulative draft log-prob

    def __len__(self) -> int:
        return len(self.parents)

    def add(self, parent: int, token: int, score: float) -> int:
        """A child of `parent`; a sibling with the same token is reused (keeping the better score)."""
        for n in range(1, len(self.parents)):
            if self.parents[n] == parent and self.tokens[n] == token:
                self.score[n] = max(self.score[n], score)
                return n
        self.parents.append(parent)
        self.tokens.append(token)
        self.depth.append(self.depth[parent] + 1)
        self.score.append(score)
        return len(self.parents) - 1

    def pruned(self, budget: int) -> tuple[DraftTree, list[int]]:
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
        out = DraftTree([-1], [-1], [0], [0.0])
        for o in old[1:]:
            out.parents.append(new_of[self.parents[o]])
            out.tokens.append(self.tokens[o])
            out.depth.append(self.depth[o])
            out.score.append(self.score[o])
        return out, old

    def path_tokens(self, n: int) -> Prefix:
        out = []
        while n > 0:
            out.append(self.tokens[n])
            n = self.parents[n]
        return tuple(reversed(out))


def scatter_law(law: Tensor, d2t: Tensor, vocab_size: int) -> Tensor:
    """[..., Vd] law over the draft vocabulary -> [..., V] over the target's (0 outside d2t)."""
    out = law.new_zeros(*law.shape[:-1], vocab_size)
    return out.index_copy_(-1, d2t, law) if law.dim() == 1 else out.scatter_(-1, d2t.expand_as(law), law)


class Root:
    """The drafter's state at one root (see the module docstring); `law(y)` and `logits(ys)` are memoised."""

    def __init__(self, session: DrafterSession, position: int, cache: DraftCache, first: dict[Prefix, tuple]):
        self.session, self.position, self.cache = session, position, cache
        self._state: dict[Prefix, tuple] = dict(first)  # key prefix -> (logits [..,Vd], hidden, cache, extra)
        self._law: dict[Prefix, Tensor] = {}

    def logits(self, prefixes: list[Prefix]) -> Tensor:
        """[n, Vd] draft logits after each prefix, computing missing depths in batched drafter calls."""
        self._ensure(prefixes)
        return torch.stack([self.session.logits_after(self, y) for y in prefixes])

    def law(self, prefix: Prefix) -> Tensor:
        """[V] draft law (temperature / top-p applied) after `prefix`, over the target vocabulary, float32
        (the verifiers accumulate their scalars in float64); memoised per `session.law_key`."""
        key = self.session.law_key(prefix)
        if key not in self._law:
            logits = self.logits([prefix])[0]
            law = next_token_law(logits, self.session.temperature, self.session.top_p)
            self._law[key] = scatter_law(law, self.session.d2t, self.session.vocab_size)
        return self._law[key]

    def prefetch(self, prefixes: list[Prefix]) -> None:
        """Compute the states the laws after `prefixes` need, one batched drafter call per missing depth."""
        self._ensure(prefixes)

    def _ensure(self, prefixes: list[Prefix]) -> None:
        need = sorted({k for y in prefixes for k in self.session.keys_for(y)}, key=len)
        missing = [k for k in need if k not in self._state]
        for depth in sorted({len(k) for k in missing}):
            batch = [k for k in missing if len(k) == depth]
            self._state.update(self.session.compute(self, batch))


class DrafterSession:
    """A drafter's committed cache over one generation (module docstring). temperature / top_p shape the
    draft law exactly as they shape the target's."""

    def __init__(self, drafter: torch.nn.Module, vocab_size: int, temperature: float, top_p: float = 1.0):
        self.drafter, self.vocab_size = drafter, vocab_size
        self.temperature, self.top_p = temperature, top_p
        self.d2t = drafter.d2t
        self.device = drafter.d2t.device
        self.dtype = next(drafter.parameters()).dtype
        self.cost = DraftCost()
        self.cache: DraftCache | None = None

    def reset(self) -> None:
        self.cache = None
        self.cost = DraftCost()

    def _timed(self, fn, *args, **kwargs):
        start = time.perf_counter()
        with torch.no_grad():
            out = fn(*args, **kwargs)
        self.cost.calls += 1
        self.cost.seconds += time.perf_counter() - start
        return out

    def advance(self, features: Tensor, tokens: Tensor, position: int) -> Root:
        """features [M, F*H] of verified context positions position..position+M-1; tokens [M] the token
        after each of them (target ids). Appends them to the committed cache; returns the last one's Root."""
        raise NotImplementedError

    # hooks for Root
    def keys_for(self, prefix: Prefix) -> list[Prefix]:
        """The state keys (prefixes) that computing the law after `prefix` needs, shallow to deep."""
        raise NotImplementedError

    def law_key(self, prefix: Prefix) -> tuple:
        """Prefixes with equal keys have the same draft law (memoised once per key)."""
        return prefix

    def compute(self, root: Root, keys: list[Prefix]) -> dict[Prefix, tuple]:
        """One batched drafter call computing the states of `keys` (all of one depth)."""
        raise NotImplementedError

    def logits_after(self, root: Root, prefix: Prefix) -> Tensor:
        raise NotImplementedError

    def tree(self, root: Root, cfg: TreeConfig, more: MoreRounds | None = None) -> DraftTree:
        """This drafter's dynamic draft tree at `root`; `more(scores, frontier)`, when given, is asked
        before every further drafter round (budget.py's auto depth)."""
        raise NotImplementedError


class SpecBlockSession(DrafterSession):
    """States are blocks, keyed by the prefix they start after: () is the root block, y[:bK] block b."""

    def __init__(self, drafter: SpecBlockDrafter, vocab_size: int, temperature: float, top_p: float = 1.0):
        super().__init__(drafter, vocab_size, temperature, top_p)
        self.K = drafter.block_size

    def advance(self, features: Tensor, tokens: Tensor, position: int) -> Root:
        cond = features.to(self.device, self.dtype)[None]
        out, cache = self._timed(
            self.drafter.extend, cond, tokens.to(self.device)[None], self.cache, position=position
        )
        self.cache = cache
        block = (out.logits[0, -1], out.hidden[0, -1], cache, out.rank_logits[0, -1])  # [K,Vd] [K,H] . [K,C]
        return Root(self, position + features.shape[0] - 1, cache, {(): block})

    def keys_for(self, prefix: Prefix) -> list[Prefix]:
        return [prefix[: b * self.K] for b in range(len(prefix) // self.K + 1)]

    def law_key(self, prefix: Prefix) -> tuple:
        # the law at depth i reads slot i % K of the block started after prefix[:i // K * K]
        cut = len(prefix) // self.K * self.K
        return prefix[:cut], len(prefix) - cut

    def compute(self, root: Root, keys: list[Prefix]) -> dict[Prefix, tuple]:
        K = self.K
        parents = [root._state[k[: len(k) - K]] for k in keys]
        hidden = torch.stack([p[1][K - 1] for p in parents])  # [n,H] slot K-1 of the block before
        token = torch.tensor([k[-1] for k in keys], device=self.device)
        past = _stack_caches([p[2] for p in parents])
        logits, hid, rank, cache = self._timed(
            self.drafter.draft_block, hidden, token, past, position=root.position, offset=len(keys[0]),
            inherited=True,
        )  # fmt: skip
        return {k: (logits[i], hid[i], cache.rows(torch.tensor([i])), rank[i]) for i, k in enumerate(keys)}

    def logits_after(self, root: Root, prefix: Prefix) -> Tensor:
        return root._state[prefix[: len(prefix) // self.K * self.K]][0][len(prefix) % self.K]

    def tree(self, root: Root, cfg: TreeConfig, more: MoreRounds | None = None) -> DraftTree:
        return specblock_tree(root, cfg, more)


class Eagle3Session(DrafterSession):
    """States are steps, keyed by the full prefix: () is step 0 at the root, y the step after y."""

    def advance(self, features: Tensor, tokens: Tensor, position: int) -> Root:
        cond = features.to(self.device, self.dtype)[None]
        logits, hidden, cache = self._timed(
            self.drafter.extend, cond, tokens.to(self.device)[None], self.cache, position=position
        )
        self.cache = cache
        return Root(
            self, position + features.shape[0] - 1, cache, {(): (logits[0, -1], hidden[0, -1], cache)}
        )

    def keys_for(self, prefix: Prefix) -> list[Prefix]:
        return [prefix[:i] for i in range(len(prefix) + 1)]

    def compute(self, root: Root, keys: list[Prefix]) -> dict[Prefix, tuple]:
        parents = [root._state[k[:-1]] for k in keys]
        hidden = torch.stack([p[1] for p in parents])
        token = torch.tensor([k[-1] for k in keys], device=self.device)
        past = _stack_caches([p[2] for p in parents])
        logits, hid, cache = self._timed(
            self.drafter.draft_step,
            hidden,
            token,
            past,
            position=root.position + len(keys[0]),
            inherited=True,
        )
        return {k: (logits[i], hid[i], cache.rows(torch.tensor([i]))) for i, k in enumerate(keys)}

    def logits_after(self, root: Root, prefix: Prefix) -> Tensor:
        return root._state[prefix][0]

    def tree(self, root: Root, cfg: TreeConfig, more: MoreRounds | None = None) -> DraftTree:
        return eagle_tree(root, cfg, more)


def _stack_caches(caches: list[DraftCache]) -> DraftCache:
    """Batch rows of equal-length caches (each of batch 1) into one cache of batch n."""
    if len(caches) == 1:
        return caches[0]
    keys = [torch.cat([c.keys[i] for c in caches]) for i in range(len(caches[0].keys))]
    values = [torch.cat([c.values[i] for c in caches]) for i in range(len(caches[0].values))]
    vis = None
    if any(c.visible is not None for c in caches):
        vis = torch.cat(
            [c.visible if c.visible is not None else torch.ones(1, len(c), dtype=torch.bool) for c in caches]
        )
    return DraftCache(keys, values, vis)


def make_session(
    drafter: torch.nn.Module, vocab_size: int, temperature: float, top_p: float
) -> DrafterSession:
    if isinstance(drafter, SpecBlockDrafter):
        return SpecBlockSession(drafter, vocab_size, temperature, top_p)
    if isinstance(drafter, Eagle3Drafter):
        return Eagle3Session(drafter, vocab_size, temperature, top_p)
    raise TypeError(f"no drafting session for {type(drafter).__name__}")


# ---------------------------------------------------------------- chains and i.i.d. drafts


def sample_drafts(root: Root, num_drafts: int, length: int, sampler):
    """K i.i.d. drafts of L tokens from the draft law, depth by depth (one batched call per new depth),
    drawn with `sampler` (verify/sampling.py).
    Returns tokens [K, L] int64 (target ids) and draft_probs [K, L, V] float32."""
    drafts: list[list[int]] = [[] for _ in range(num_drafts)]
    rows: list[list[Tensor]] = [[] for _ in range(num_drafts)]
    for _ in range(length):
        prefixes = [tuple(d) for d in drafts]
        root.logits(list(dict.fromkeys(prefixes)))  # one batched call for the distinct prefixes
        for k, y in enumerate(prefixes):
            law = root.law(y)
            rows[k].append(law)
            drafts[k].append(int(sampler.categorical(law)))
    return torch.tensor(drafts, dtype=torch.int64), torch.stack([torch.stack(r) for r in rows])


def greedy_draft(root: Root, length: int) -> Tensor:
    """Temperature 0: the drafter's argmax chain of L tokens (target ids) [1, L] int64. It is what
    `sample_drafts` draws from the one-hot laws, read without forming them (no [V] float64 rows)."""
    y: Prefix = ()
    for _ in range(length):
        y += (int(root.session.d2t[root.logits([y])[0].argmax()]),)
    return torch.tensor([y], dtype=torch.int64)


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


# ---------------------------------------------------------------- dynamic trees


@dataclass
class TreeConfig:
    """budget: draft tokens kept (the root not counted), or "auto": chosen per iteration by the cost model
    of evaluate/budget.py among the `max_budget` best nodes; steps: block (SpecBlock) or step (EAGLE)
    rounds; beam: leaves expanded per round; topk: EAGLE children per node and SpecBlock slot-0 cap;
    topk_per_class: SpecBlock branching per predicted rank class (0 = stop the block there); default the
    authors' release preset (2, 4, 6, 4) (docs/specblock.md 1.3), which never gives up a slot."""

    budget: Any = 32  # int >= 1 or "auto"
    max_budget: int = 64
    steps: int = 2
    beam: int = 10
    topk: int = 10
    topk_per_class: list[int] = field(default_factory=lambda: list(RELEASE_TOPK_PER_CLASS))

    def __post_init__(self):
        if self.budget != AUTO and not (isinstance(self.budget, int) and self.budget >= 1):
            raise ValueError(f"tree budget must be an int >= 1 or {AUTO!r}, got {self.budget!r}")
        if self.max_budget < 1:
            raise ValueError(f"tree max_budget must be >= 1, got {self.max_budget}")

    @property
    def drafted(self) -> int:
        """The nodes a tree is pruned to when it is drafted (the auto choice prunes further)."""
        return self.max_budget if self.budget == AUTO else self.budget


def _draft_logprobs(logits: Tensor) -> Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def specblock_tree(root: Root, cfg: TreeConfig, more: MoreRounds | None = None) -> DraftTree:
    """The SpecBlock dynamic tree (docs/specblock.md 1.3-1.4): each block lays a greedy chain with per-slot
    alternatives (top-k by the Rank Head's class); the best `beam` pending leaves (alternatives, greedy
    nodes of branching slots, the chain's end) start new blocks from their slot's hidden state, for
    `steps` rounds; the tree is then pruned to `budget` nodes by cumulative draft log-prob."""
    session: SpecBlockSession = root.session  # type: ignore[assignment]
    K, d2t = session.K, session.d2t
    table = torch.tensor(cfg.topk_per_class)
    tree = DraftTree()
    logits, hidden, cache, rank = root._state[()]
    blocks = [(0, logits, hidden, cache, rank, 0)]  # (parent node, logits, hidden, cache, rank, offset)
    for step in range(cfg.steps):
        pending = []  # (score, node, block index, slot)
        for b, (parent, logits, hidden, cache, rank, offset) in enumerate(blocks):
            widths = table[rank.argmax(-1).cpu()].tolist()
            logp = _draft_logprobs(logits)  # [K,Vd]
            node = parent
            for k in range(K):
                width = min(widths[k], cfg.topk)
                if width == 0:
                    break
                top = logp[k].topk(width)
                ids = d2t[top.indices].tolist()
                children = [tree.add(node, t, tree.score[node] + float(s)) for t, s in zip(ids, top.values)]
                pending += [(tree.score[c], c, b, k) for c in children[1:]]
                if width > 1 or k == K - 1:  # a branching slot's greedy node, and the chain's end
                    pending.append((tree.score[children[0]], children[0], b, k))
                node = children[0]
        if step == cfg.steps - 1 or not pending:
            break
        pending = sorted(pending, key=lambda p: (-p[0], p[1]))[: cfg.beam]
        if more is not None and not more(tree.score[1:], [p[0] for p in pending]):
            break
        hid = torch.stack([blocks[b][2][k] for _, _, b, k in pending])  # [n,H]
        token = torch.tensor([tree.tokens[n] for _, n, _, _ in pending], device=session.device)
        offsets = torch.tensor([blocks[b][5] + k + 1 for _, _, b, k in pending], device=session.device)
        past = _leaf_caches([(blocks[b][3], k, K) for _, _, b, k in pending])
        logits, hidden, rank, cache = session._timed(
            session.drafter.draft_block, hid, token, past, position=root.position + offsets, inherited=True
        )
        blocks = [
            (n, logits[i], hidden[i], cache.rows(torch.tensor([i])), rank[i], int(offsets[i]))
            for i, (_, n, _, _) in enumerate(pending)
        ]
    return tree.pruned(cfg.drafted)[0]


def _leaf_caches(sources: list[tuple[DraftCache, int, int]]) -> DraftCache:
    """Batch the caches of leaves started from slot m of a block whose K entries end each cache: every
    row keeps its block's slots <= m visible and hides the later ones."""
    caches = []
    for cache, m, K in sources:
        n = len(cache)
        vis = cache.visible.clone() if cache.visible is not None else torch.ones(1, n, dtype=torch.bool)
        vis[:, n - K + m + 1 :] = False
        caches.append(DraftCache(cache.keys, cache.values, vis.to(cache.keys[0].device)))
    return _stack_caches(caches)


def eagle_tree(root: Root, cfg: TreeConfig, more: MoreRounds | None = None) -> DraftTree:
    """EAGLE-2's dynamic tree: the root's top-k children, then `steps - 1` rounds that expand the `beam`
    best nodes of the newest layer by cumulative log-prob with their top-k children each (one batched
    drafter step per round); pruned to `budget` nodes."""
    session: Eagle3Session = root.session  # type: ignore[assignment]
    tree, frontier = DraftTree(), [()]
    node_of: dict[Prefix, int] = {(): 0}
    for step in range(cfg.steps):
        if step and more is not None and not more(tree.score[1:], [tree.score[node_of[y]] for y in frontier]):
            break
        logits = root.logits(frontier)  # one batched call for the frontier (the root's is precomputed)
        layer = []
        for y, lg in zip(frontier, logits):
            top = _draft_logprobs(lg).topk(cfg.topk)
            for t, s in zip(session.d2t[top.indices].tolist(), top.values):
                n = tree.add(node_of[y], t, tree.score[node_of[y]] + float(s))
                node_of[y + (t,)] = n
                layer.append((tree.score[n], n, y + (t,)))
        frontier = [y for _, _, y in sorted(layer, key=lambda e: (-e[0], e[1]))[: cfg.beam]]
    return tree.pruned(cfg.drafted)[0]
