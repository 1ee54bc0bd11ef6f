"""Verification at temperature > 0 over the draft vocabulary's columns and ONE column for the rest.

A drafter drafts from its draft vocabulary (d2t: Vd target ids, 8k of SmolLM2's 49k), so every draft law
is 0 outside it. Every verifier here forms laws (a q - b p)_+ (residuals.py) or point masses on draft
tokens, and where p = 0 such a law is a q: over the target ids outside the draft vocabulary (the rest)
every law a verifier forms, the continuations of cross-iteration verifiers included, is proportional to the
plain target law q at that prefix. So verification can run on Vd + 1 columns (q at the draft ids, the rest's
total mass q(rest) in the last column; p padded with 0) and, where it picks the rest column, the token is
drawn from q restricted to the rest: the law of the emitted token is the full-vocabulary verifier's, and
every later decision reads the target's rows at the actual prefix, never which rest token it was. Each
pass over a row (a residual mass, a correction law) reads Vd + 1 numbers instead of V.
tests/evaluate/test_columns.py checks the law of whole generations by exact enumeration with a draft
vocabulary smaller than the target's, where the rest column is drawn.

The loop keeps its law book (continuations.py) in column space: prefixes of generated tokens are column
tuples, a token of the rest is the column `other` (two prefixes that differ only there never meet: every
kept row extends the emitted sequence, and drafts never hold the rest column).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specblock.evaluate.decoding.drafting import Prefix, Root


class DraftColumns:
    """Columns 0..Vd-1 are the draft ids d2t [Vd]; column `other` = Vd is every other target id."""

    def __init__(self, d2t: Tensor, vocab_size: int):
        self.d2t = d2t
        self.ids: list[int] = d2t.tolist()
        self.other = len(self.ids)
        self._col = {t: c for c, t in enumerate(self.ids)}
        rest = torch.ones(vocab_size, dtype=torch.bool, device=d2t.device)
        rest[d2t] = False
        self.rest = rest
        self._rest_weight = rest.float()  # q(rest) as one matrix-vector product over the [N, V] rows

    def cols(self, tokens) -> Prefix:
        """Target ids -> columns (a rest id -> `other`)."""
        get, other = self._col.get, self.other
        return tuple(get(t, other) for t in tokens)

    def ids_of(self, cols: Prefix) -> Prefix | None:
        """Columns -> target ids; None if one is the rest column (not one token)."""
        if self.other in cols:
            return None
        return tuple(self.ids[c] for c in cols)

    def target(self, laws: Tensor) -> Tensor:
        """laws [N, V] (target laws, float) -> [N, Vd + 1]: q at the draft ids, then q(rest)."""
        rest = torch.mv(laws, self._rest_weight.to(laws.dtype)).clamp_(min=0).unsqueeze(1)
        return torch.cat([laws.index_select(-1, self.d2t), rest], dim=-1)

    def token(self, col: int, law: Tensor, sampler) -> int:
        """The target id of a column the verifier picked; for `other`, drawn from `law` [V] (the plain target
        law at the prefix it follows) restricted to the rest."""
        if col != self.other:
            return self.ids[col]
        return int(sampler.categorical(law.masked_fill(~self.rest, 0.0)))


class ColumnRoot:
    """A drafter's `Root` addressed by column prefixes, for a continuation's draft lookups. After a rest
    token the draft joint is 0 (p(rest) = 0), so the law read there never matters: a zero row, no call."""

    def __init__(self, root: Root, columns: DraftColumns):
        self.root, self.columns = root, columns
        self._laws: dict[Prefix, Tensor] = {}  # the coupling asks for the same rows many times

    def law(self, y: Prefix) -> Tensor:
        law = self._laws.get(y)
        if law is None:
            ids = self.columns.ids_of(y)
            if ids is not None:
                law = self.root.law(ids)
            else:
                law = torch.zeros(self.columns.other + 1, device=self.columns.d2t.device)
            self._laws[y] = law
        return law

    def prefetch(self, ys: list[Prefix]) -> None:
        ids = [self.columns.ids_of(y) for y in ys]
        self.root.prefetch([y for y in ids if y is not None])
