"""The law each iteration verifies against, across iterations.

Cross-iteration verifiers (greedy_block, spectr_gbv) return a continuation; while it is in force (until
its block's horizon has been emitted) the next iterations verify against it instead of the plain target.
Computing it needs the older iteration's target law along the new prefix (its rows, or the new forward's
rows) and its DRAFT law along the new prefix: for SpecBlock within a block that is free (slot laws),
beyond it and for EAGLE-3 it costs drafter calls from the old root's cache, counted as drafting cost.
`LawBook` holds the target laws by prefix of the generated tokens and the `Level`s in force.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specblock.evaluate.decoding.drafting import Prefix, Root
from specblock.evaluate.verify.residuals import into


class Level:
    """The law one iteration's continuation puts in force: for generated tokens g shorter than `horizon`,
    law(g) = cont(g relative to `start`, prev's law, this iteration's draft law); past it, the plain
    target (horizons grow with every iteration, so no older continuation applies there either)."""

    def __init__(self, book: LawBook, start: int, horizon: int, cont, root: Root, prev: Level | None):
        self.book, self.start, self.horizon = book, start, horizon
        self.cont, self.root, self.prev = cont, root, prev
        self.memo: dict[Prefix, Tensor] = {}
        self.lookups = None  # (target_at, draft_at) relative to the block start, made once per level

    def law(self, g: Prefix, out: Tensor | None = None) -> Tensor:
        """The [V] law after g; a new one is computed into `out` when given (and kept: the caller must not
        write to `out` afterwards), a known one copied there."""
        if len(g) >= self.horizon:
            return into(self.book.plain[g], out)
        if g in self.memo:
            return into(self.memo[g], out)
        if self.cont is None:
            raise RuntimeError(f"frozen continuation asked for an uncommitted prefix of length {len(g)}")
        self.memo[g] = law = self.cont(g[self.start :], *self._lookups(g[: self.start]), out=out)
        return law

    def _lookups(self, base: Prefix) -> tuple:
        """(target_at, draft_at) relative to the block start `base`, made once: every prefix asked
        extends the same block start."""
        if self.lookups is None:
            prev, root = self.prev, self.root
            target_at = (
                (lambda y: prev.law(base + tuple(y)))
                if prev
                else (lambda y: self.book.plain[base + tuple(y)])
            )
            self.lookups = (target_at, lambda y: root.law(tuple(y)))
        return self.lookups

    def prefetch(self, queries: set[Prefix]) -> None:
        """Before `law` is asked for `queries` (absolute prefixes of generated tokens, closed under taking
        prefixes): compute the draft laws it will read in batched drafter calls (one per depth) instead of
        one call per prefix as the coupling asks for them, then the coupling's residual masses, one
        batched pass over [rows, V] per stage (`prepare`). Over the full 49k vocabulary batching did not pay
        (~32 us of arithmetic per row dominated); over the verification columns (columns.py) a row is 8k
        numbers and the per-call overhead is what batching saves."""
        if self.cont is None:
            return
        reads = getattr(self.cont, "reads_draft", lambda y: True)
        asked = [g for g in queries if self.start <= len(g) < self.horizon and g not in self.memo]
        ys = sorted({g[self.start :] for g in asked if reads(g[self.start :])}, key=len)
        if ys:
            self.root.prefetch(ys)
            if hasattr(self.cont, "prepare"):  # its residual masses, one batched pass per stage
                self.cont.prepare(ys, *self._lookups(asked[0][: self.start]))

    def freeze(self, out: Prefix) -> None:
        """Once the emitted tokens reach the horizon, the next level can only ask about committed
        prefixes, all memoised by then: keep those, drop the drafter state and the chain behind."""
        self.memo = {g: v for g, v in self.memo.items() if out[: len(g)] == g}
        self.cont = self.root = self.prev = self.lookups = None


class LawBook:
    """Target laws by prefix of the generated tokens g, and the law each iteration verifies against:
    `plain[g]` is the target's (tempered) law after g, for every node a forward saw; while continuations
    are in force, `law(g)` reads the newest `Level`."""

    def __init__(self):
        self.plain: dict[Prefix, Tensor] = {}
        self.levels: list[Level] = []  # in force, oldest first

    def law(self, g: Prefix, out: Tensor | None = None) -> Tensor:
        """The [V] law the next verification reads after g, written into `out` when given (Level.law)."""
        return self.levels[-1].law(g, out) if self.levels else into(self.plain[g], out)

    def laws(self, prefixes: list[list[Prefix]]) -> Tensor:
        """[K, L+1, V]: the law after each prefix, each row written once into one new tensor (a
        continuation's rows are computed in place there; a prefix several drafts share is copied)."""
        flat = [g for row in prefixes for g in row]
        like = next(iter(self.plain.values()))  # the rows of this iteration's forward (add_rows)
        out = torch.empty(len(flat), like.shape[-1], dtype=like.dtype, device=like.device)
        seen: dict[Prefix, int] = {}
        for n, g in enumerate(flat):
            if g in seen:
                out[n].copy_(out[seen[g]])
            else:
                seen[g] = n
                self.law(g, out[n])
        return out.view(len(prefixes), len(prefixes[0]), -1)

    def prefetch(self, queries: list[Prefix]) -> None:
        """Before `law` is asked for `queries`: every live level computes the draft laws it will read for
        them and their prefixes in batched drafter calls (EAGLE-3 beyond the old drafts, SpecBlock beyond
        its first block)."""
        live = [lv for lv in self.levels if lv.cont is not None]  # frozen levels read no draft law
        if not live:
            return
        low = min(lv.start for lv in live)
        closed = {g[:m] for g in queries for m in range(low, len(g) + 1)}
        for lv in live:
            lv.prefetch(closed)

    def add_rows(self, base: Prefix, paths: list[Prefix], laws: Tensor) -> None:
        """laws [N, V]: the target's (tempered) law at each node of a tree drafted after `base`; paths[n]:
        node n's tokens after the root."""
        for n, y in enumerate(paths):
            self.plain[base + y] = laws[n]

    def carry(self, base: Prefix, horizon: int, cont, root: Root, out: Prefix) -> None:
        """After the iteration that started at `base` emitted up to `out`: put its continuation in force,
        or drop every level once `out` reaches its horizon (the target alone takes over)."""
        if cont is None or len(out) >= len(base) + horizon:
            self.levels = []
        else:
            prev = self.levels[-1] if self.levels else None
            self.levels.append(Level(self, len(base), len(base) + horizon, cont, root, prev))
        for lv in self.levels[:-1]:
            if lv.cont is not None and len(out) >= lv.horizon:
                lv.freeze(out)
        # a frozen level is read only by the next one (its `prev`): keep the one before the oldest live
        # level, drop the rest (at temperature > 0 with short acceptances they piled up, one per iteration)
        first = next((i for i, lv in enumerate(self.levels) if lv.cont is not None), len(self.levels))
        self.levels = self.levels[max(first - 1, 0) :]
        live = [lv.start for lv in self.levels if lv.cont is not None]
        keep = min(live) if live else len(out)
        self.plain = {
            g: v
            for g, v in self.plain.items()
            if len(g) >= keep and out[: min(len(g), len(out))] == g[: len(out)]
        }
