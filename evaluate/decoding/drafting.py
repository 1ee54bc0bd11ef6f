"""Drafting at inference: a drafter's cache across iterations and its draft law along any prefix.

One `DrafterSession` per generation keeps the drafter's committed cache (SpecBlock: block 1's K slots at
every verified context position; EAGLE-3: step 0 at every verified position). After each verification
the loop calls `advance(features, tokens, position)` with the newly verified positions: ONE drafter
forward appends them and yields the draft at the last one, the `Root` of the next iteration.

Every drafter answers the same two calls (modeling/common.py): `extend` over consecutive context
positions and `draft` at one position per row, each returning a `DraftStep` whose K' tokens per call
are a block's K slots (SpecBlock) or one step (EAGLE-3, K' = 1). So one session serves every drafter:
its states are the calls' outputs (`DraftState`), keyed by the prefix they start after.

A `Root` answers "the draft law after prefix y" (y: draft tokens after the root, target ids) for any y,
lazily and memoised, batching every missing prefix of one depth into one drafter call: depth i reads
the token i % K' of the state started after y[:i // K' * K']; a state after y[:bK'] starts from the last
token's hidden state of the one before, with the token y[bK'-1] (SpecBlock's cross-block inheritance,
EAGLE-3's next step). Within a SpecBlock block the slots do not see each other's sampled tokens, so the
law at depth i < K is the same for every y. Chains, i.i.d. drafts, the continuation laws of
cross-iteration verifiers and the trees (trees.py, drafters.py) all read laws this way; drafts that
share a prefix share its work.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from specblock.evaluate.decoding.temperature import next_token_law
from specblock.train.modeling.common import DraftCache, DraftStep

if TYPE_CHECKING:
    from specblock.evaluate.decoding.trees import DraftTree, MoreRounds, TreeBuilder, TreeConfig

Prefix = tuple[int, ...]


class DraftCalls(NamedTuple):
    """Drafter forwards and their wall seconds."""

    calls: int
    seconds: float


@dataclass
class DraftCost:
    """Drafter forwards and their wall seconds, accumulated until the loop reads and resets them."""

    calls: int = 0
    seconds: float = 0.0

    def take(self) -> DraftCalls:
        out = DraftCalls(self.calls, self.seconds)
        self.calls, self.seconds = 0, 0.0
        return out


class DraftState(NamedTuple):
    """One drafter call's output for one prefix: logits [K', Vd], pre-norm hidden [K', H] and rank_logits
    [K', C] or None of its K' drafted tokens, and the cache (batch 1) it leaves, which the states started
    after it extend."""

    logits: Tensor
    hidden: Tensor
    cache: DraftCache
    rank_logits: Tensor | None

    @staticmethod
    def rows(step: DraftStep) -> list[DraftState]:
        """A batched `draft` call's [n, K', ...] outputs as n states (cache row i each)."""
        return [
            DraftState(
                step.logits[i],
                step.hidden[i],
                step.cache.rows(torch.tensor([i])),
                None if step.rank_logits is None else step.rank_logits[i],
            )
            for i in range(step.logits.shape[0])
        ]


def column_law(law: Tensor) -> Tensor:
    """[..., Vd] law over the draft vocabulary -> [..., Vd + 1] over the verification columns (columns.py:
    the draft ids, then 0 for every other target id)."""
    return torch.nn.functional.pad(law, (0, 1))


class Root:
    """The drafter's state at one root (see the module docstring); `law(y)` and `logits(ys)` are memoised.
    `width` (K') is the number of tokens one drafter call drafts; `position` the root's context index."""

    def __init__(self, session: DrafterSession, position: int, first: DraftState):
        self.session, self.position, self.width = session, position, first.logits.shape[0]
        self._states: dict[Prefix, DraftState] = {(): first}  # key prefix -> the state started after it
        self._laws: dict[tuple, Tensor] = {}

    def state(self, key: Prefix) -> DraftState:
        """The state started after `key` (`key_of` a prefix; computed by `logits` / `prefetch` first)."""
        return self._states[key]

    def key_of(self, prefix: Prefix) -> Prefix:
        """The prefix after which the state holding the law after `prefix` starts."""
        return prefix[: len(prefix) // self.width * self.width]

    def logits(self, prefixes: list[Prefix]) -> Tensor:
        """[n, Vd] draft logits after each prefix, computing missing depths in batched drafter calls."""
        self.prefetch(prefixes)
        return torch.stack([self._states[self.key_of(y)].logits[len(y) % self.width] for y in prefixes])

    def law(self, prefix: Prefix) -> Tensor:
        """[Vd + 1] draft law (temperature / top-p applied) after `prefix` (target ids) over the verification
        columns (columns.py: the draft ids, then 0 for the rest), float32 (the verifiers accumulate their
        scalars in float64); memoised per `law_key`."""
        key = self.law_key(prefix)
        if key not in self._laws:
            logits = self.logits([prefix])[0]
            self._laws[key] = column_law(next_token_law(logits, self.session.temperature, self.session.top_p))
        return self._laws[key]

    def law_key(self, prefix: Prefix) -> tuple:
        """Prefixes with equal keys have the same draft law (memoised once per key): the law at depth i
        reads token i % K' of the state started after `key_of(prefix)`."""
        key = self.key_of(prefix)
        return key, len(prefix) - len(key)

    def prefetch(self, prefixes: list[Prefix]) -> None:
        """Compute the states the laws after `prefixes` need, one batched drafter call per missing depth."""
        K = self.width
        need = {y[: b * K] for y in prefixes for b in range(len(y) // K + 1)}
        missing = sorted((k for k in need if k not in self._states), key=len)
        for depth in sorted({len(k) for k in missing}):
            keys = [k for k in missing if len(k) == depth]
            parents = [self._states[k[:-K]] for k in keys]
            step = self.session.draft(
                torch.stack([p.hidden[K - 1] for p in parents]),  # [n,H] the last token of the state before
                torch.tensor([k[-1] for k in keys], device=self.session.device),
                stack_caches([p.cache for p in parents]),
                position=self.position,
                offset=depth,
            )
            self._states.update(zip(keys, DraftState.rows(step)))


class DrafterSession:
    """A drafter's committed cache over one generation (module docstring). temperature / top_p shape the
    draft law exactly as they shape the target's; `tree_builder` grows this drafter's dynamic tree
    (its spec's, drafters.py)."""

    def __init__(
        self,
        drafter: torch.nn.Module,
        vocab_size: int,
        temperature: float,
        top_p: float = 1.0,
        tree_builder: TreeBuilder | None = None,
    ):
        self.drafter, self.vocab_size = drafter, vocab_size
        self.temperature, self.top_p = temperature, top_p
        self.tree_builder = tree_builder
        self.d2t = drafter.d2t
        self.ids: list[int] = self.d2t.tolist()  # column c of a draft law -> its target id
        self.device = drafter.d2t.device
        self.dtype = next(drafter.parameters()).dtype
        self.cost = DraftCost()
        self.cache: DraftCache | None = None
        # a drafter whose extend() can skip the heads over all but the last appended position (ours can)
        self._last_only = "last_only" in inspect.signature(drafter.extend).parameters

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
        cond = features.to(self.device, self.dtype)[None]
        last = {"last_only": True} if self._last_only else {}
        step = self._timed(
            self.drafter.extend, cond, tokens.to(self.device)[None], self.cache, position=position, **last
        )
        self.cache = step.cache
        rank = None if step.rank_logits is None else step.rank_logits[0, -1]
        first = DraftState(
            step.logits[0, -1], step.hidden[0, -1], step.cache, rank
        )  # [K',Vd] [K',H] . [K',C]
        return Root(self, position + features.shape[0] - 1, first)

    def draft(
        self, hidden: Tensor, token: Tensor, past: DraftCache, *, position: int | Tensor, offset: int | Tensor
    ) -> DraftStep:
        """One timed, batched drafter call started from pre-norm hidden states [n, H] with tokens [n] (target
        ids) after the cache rows `past` (batch n), at `position` (int or [n]) + `offset` (the start's
        depth after the root)."""
        return self._timed(
            self.drafter.draft, hidden, token, past, position=position, offset=offset, inherited=True
        )

    def tree(self, root: Root, cfg: TreeConfig, more: MoreRounds | None = None) -> DraftTree:
        """This drafter's dynamic draft tree at `root`; `more(scores, frontier)`, when given, is asked
        before every further drafter round (budget.py's auto depth)."""
        if self.tree_builder is None:
            raise ValueError(f"{type(self.drafter).__name__} has no tree builder")
        return self.tree_builder(root, cfg, more)


def stack_caches(caches: list[DraftCache]) -> DraftCache:
    """Batch rows of equal-length caches (each of batch 1) into one cache of batch n. Caches that hold
    the same stored entries (rows of one batched call, leaves of one block) become one shared cache
    (DraftCache.shared: their visibility rows over one copy); others are copied into n batch rows."""
    first = caches[0]
    if len(caches) == 1 or not first.keys:  # one row, or a drafter without attention layers
        return first
    if all(c.keys[0] is first.keys[0] and c.values[0] is first.values[0] for c in caches):
        vis = [c.visible if c.visible is not None else c.all_visible(1) for c in caches]
        return DraftCache(first.keys, first.values, torch.cat(vis))
    keys = [torch.cat([c.keys[i] for c in caches]) for i in range(len(caches[0].keys))]
    values = [torch.cat([c.values[i] for c in caches]) for i in range(len(caches[0].values))]
    vis = None
    if any(c.visible is not None for c in caches):
        vis = torch.cat(
            [c.visible if c.visible is not None else torch.ones(1, len(c), dtype=torch.bool) for c in caches]
        )
    return DraftCache(keys, values, vis)


# ---------------------------------------------------------------- chains and i.i.d. drafts


def sample_drafts(root: Root, num_drafts: int, length: int, sampler):
    """K i.i.d. drafts of L tokens from the draft law, depth by depth (one batched call per new depth),
    drawn with `sampler` (verify/randomness.py).
    Returns tokens [K, L] int64 (target ids) and draft_probs [K, L, Vd + 1] float32 (over the columns)."""
    ids = root.session.ids
    drafts: list[list[int]] = [[] for _ in range(num_drafts)]
    rows: list[list[Tensor]] = [[] for _ in range(num_drafts)]
    for _ in range(length):
        prefixes = [tuple(d) for d in drafts]
        root.logits(list(dict.fromkeys(prefixes)))  # one batched call for the distinct prefixes
        for k, y in enumerate(prefixes):
            law = root.law(y)
            rows[k].append(law)
            drafts[k].append(ids[int(sampler.categorical(law))])
    return torch.tensor(drafts, dtype=torch.int64), torch.stack([torch.stack(r) for r in rows])


def greedy_draft(root: Root, length: int) -> Tensor:
    """Temperature 0: the drafter's argmax chain of L tokens (target ids) [1, L] int64. It is what
    `sample_drafts` draws from the one-hot laws, read without forming them (no [V] float64 rows)."""
    y: Prefix = ()
    for _ in range(length):
        y += (int(root.session.d2t[root.logits([y])[0].argmax()]),)
    return torch.tensor([y], dtype=torch.int64)
