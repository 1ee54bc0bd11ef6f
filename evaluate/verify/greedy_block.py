"""Greedy block verification (GBV) and SpecTr-GBV, as recursive greedy block verification (RGBV).

What is published and what is derived (VERIFIERS.md sections 4 and 7):
- [paper, abstract] SpecTr-GBV (Lin, Sheng, Cai, Zhou; arXiv 2604.25925) verifies K i.i.d. draft
  blocks against the target block as an optimal-transport problem, draft after draft, skipping the
  set H of already rejected sub-blocks, outputs the longest accepted sub-block plus a residual
  correction (its Eq. 4), and modifies the target law of later iterations (its Algorithm 2).
- [2nd-hand] Its Eq. 2 at K = 1 is h = (A + Delta_+)/(A - Delta); its expected-length theorem
  E[tau] = sum Q[1 - (1 - min(1, P/Q))^K] is realisable but NOT optimal, and we do not claim it.
- [derived] The algorithm here, RGBV: keep one (virtual) coupled target sample Y; couple each draft in
  turn with the current conditional law T_k of Y by greedy block verification; the law left after the
  last draft is both the correction law and the continuation. Lossless by construction; equals GBV at
  K = 1 (so `greedy_block` is this code with one draft) and recursive rejection sampling at L = 1.
  tests/evaluate/test_verifiers_exact.py checks all of it by exact enumeration.
- [derived] GBV's formulas (section 4), with joints from the block start Q_i = T(X^i), P_i = P(X^i):
  h_i = 1 if Q_i >= P_i else A_i / (A_i + P_i - Q_i), A_i = sum_x (Q_i T(x|X^i) - P_i p(x|X^i))_+,
  h_L = min(1, Q_L / P_L), tau = max{i : eta_i < h_i}. After the draft, Y's law is onehot(X[|y|]) on
  the committed prefix (|y| < tau), (T(yx) - P(yx))_+ normalised for tau <= |y| < L, the target beyond.

Why it is cheap (derived here): nested residuals collapse, (a (alpha q - beta p)_+ - b p)_+ =
(a alpha q - (a beta + b) p)_+ for a, b >= 0, so after any number of drafts every row of T is either a
point mass (on a committed prefix) or (q - lam p)_+ normalised for ONE scalar lam. A stage update is
scalar arithmetic plus one residual mass S(lam) = sum_x (q - lam p)_+ (a pass over V, memoised per
prefix and lam, so drafts sharing a prefix share it); rows with Q_i >= P_i need no pass at all, and rows
whose prefix lost all T-probability (the "H skip") are never touched. There is no root search.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LawAt, VerifyOutput, check_inputs, register_verifier
from .laws import Prefix, Rows, draft_rows
from .sampling import ACC_DTYPE, Sampler, backward_scan, make_sampler


@dataclass(frozen=True)
class RowLaw:
    """T(.|y): a point mass on `token` (a committed prefix), else (q - lam p)_+ normalised."""

    lam: float = 0.0
    token: int | None = None

    def prob(self, rows: Rows, y: Prefix, x: int) -> float:
        if self.token is not None:
            return 1.0 if x == self.token else 0.0
        s = rows.mass(y, self.lam)
        return rows.point(y, self.lam, x) / s if s > 0 else 0.0


def row_law(rows: Rows, y: Prefix, row: RowLaw) -> torch.Tensor:
    """The row's [V] law, unnormalised (float64)."""
    if row.token is not None:
        law = torch.zeros_like(rows.target_at(y), dtype=ACC_DTYPE)
        law[row.token] = 1.0
        return law
    return rows.residual(y, row.lam)


@dataclass(frozen=True)
class Stage:
    """One verified draft: its L tokens and how many of them it accepted (tau_k)."""

    tokens: tuple[int, ...]
    accepted: int


class Coupling:
    """The law T_j of the virtual target sample Y after the first j verified drafts (VERIFIERS.md 7.3),
    row by row: law(j, y) = T_j(.|y) and joint(j, y) = T_j(y), for prefixes y from the block start.

    A row depends on its prefix only, so both are memoised per (j, y): drafts that share a prefix (row 0
    is shared by all) share its work, and rows are computed only when a weight asks for them.
    """

    def __init__(self, rows: Rows, horizon: int, stages: tuple[Stage, ...] = ()):
        self.rows, self.horizon, self.stages = rows, horizon, list(stages)
        self._law: dict[tuple[int, Prefix], RowLaw] = {}
        self._joint: dict[tuple[int, Prefix], float] = {}
        self._draft: dict[Prefix, float] = {(): 1.0}

    def draft_joint(self, y: Prefix) -> float:
        """P(y), this iteration's draft law."""
        if y not in self._draft:
            self._draft[y] = self.draft_joint(y[:-1]) * self.rows.p(y[:-1], y[-1])
        return self._draft[y]

    def joint(self, j: int, y: Prefix) -> float:
        if not y:
            return 1.0
        key = (j, y)
        if key not in self._joint:
            self._joint[key] = self.joint(j, y[:-1]) * self.law(j, y[:-1]).prob(self.rows, y[:-1], y[-1])
        return self._joint[key]

    def law(self, j: int, y: Prefix) -> RowLaw:
        if j == 0:
            return RowLaw()
        key = (j, y)
        if key not in self._law:
            self._law[key] = self._after_stage(self.stages[j - 1], j, y)
        return self._law[key]

    def _after_stage(self, stage: Stage, j: int, y: Prefix) -> RowLaw:
        prev, t = self.law(j - 1, y), self.joint(j - 1, y)
        if t <= 0.0:  # y lost all probability: a dead row, never read
            return prev
        if len(y) < stage.accepted:  # the committed prefix: Y follows the accepted draft tokens
            return RowLaw(token=stage.tokens[len(y)])
        if len(y) >= self.horizon or prev.token is not None:  # the plain target; a point mass stays one
            return prev
        # (T(yx) - P(yx))_+ normalised; a zero residual (a branch of probability 0) keeps the old law
        lam = self.residual_lam(y, prev, t, self.draft_joint(y))
        return RowLaw(lam) if self.rows.mass(y, lam) > 0 else prev

    def residual_lam(self, y: Prefix, row: RowLaw, t: float, pj: float) -> float:
        """lam' with (T(y) T(.|y) - P(y) p(.|y))_+ proportional to (q - lam' p)_+, for a (q - lam p) row:
        T(y) T(.|y) = c (q - lam p)_+ with c = T(y) / S(lam), hence lam' = lam + P(y) / c."""
        return row.lam + pj * self.rows.mass(y, row.lam) / t

    def gbv_weight(self, path: Prefix, i: int) -> float:
        """GBV acceptance weight h_i (1 <= i <= L) of the draft `path` against T_j, j = len(self.stages)."""
        j, y = len(self.stages), path[:i]
        q_i, p_i = self.joint(j, y), self.draft_joint(y)
        if q_i <= 0.0:  # the sub-block was rejected by an earlier draft (the set H)
            return 0.0
        if q_i >= p_i or i == len(path):
            return min(1.0, q_i / p_i) if p_i > 0 else 1.0
        row = self.law(j, y)
        if row.token is not None:  # A_i = sum_x (Q_i onehot - P_i p)_+
            a = max(q_i - p_i * self.rows.p(y, row.token), 0.0)
        else:  # A_i = c S(lam + P_i / c), c = Q_i / S(lam)
            a = q_i / self.rows.mass(y, row.lam) * self.rows.mass(y, self.residual_lam(y, row, q_i, p_i))
        return a / (a + p_i - q_i)


@dataclass(frozen=True)
class RGBVContinuation:
    """The law the next iterations verify against: T_{K+1} after every verified draft (Algorithm 2)."""

    stages: tuple[Stage, ...]
    horizon: int

    def cache_key(self) -> tuple:
        """Equal keys give equal laws: a stage only matters through its accepted tokens."""
        return (self.horizon, tuple(st.tokens[: st.accepted] for st in self.stages))

    def __call__(
        self, prefix: tuple[int, ...], target_probs_at: LawAt, draft_probs_at: LawAt
    ) -> torch.Tensor:
        prefix = tuple(prefix)
        if len(prefix) >= self.horizon:
            return target_probs_at(prefix)
        coupling = Coupling(Rows(target_probs_at, draft_probs_at), self.horizon, self.stages)
        j = len(self.stages)
        if coupling.joint(j, prefix) <= 0.0:  # the prefix has probability 0 under T: any law will do
            return target_probs_at(prefix)
        law = row_law(coupling.rows, prefix, coupling.law(j, prefix))
        return law / law.sum()


def recursive_gbv(target_probs, draft_probs, draft_tokens, s: Sampler) -> VerifyOutput:
    """RGBV over the K drafts (shapes as in base.py's calling convention)."""
    tokens = draft_tokens.tolist()
    n = len(tokens[0])
    coupling = Coupling(draft_rows(target_probs, draft_probs, tokens), n)
    best_k, best_tau = 0, 0
    for k, x in enumerate(tokens):
        path = tuple(x)
        tau = backward_scan(s, lambda i: coupling.gbv_weight(path, i), n)
        coupling.stages.append(Stage(path, tau))
        if tau > best_tau:
            best_k, best_tau = k, tau
        if best_tau == n:  # a whole block is accepted: later drafts cannot change anything
            break
    cont = RGBVContinuation(tuple(coupling.stages), n)
    if best_tau == n:
        return VerifyOutput(n, best_k, s.categorical(target_probs[best_k, n].to(ACC_DTYPE)), cont)
    best = tuple(tokens[best_k][:best_tau])
    law = row_law(coupling.rows, best, coupling.law(len(coupling.stages), best))
    return VerifyOutput(best_tau, best_k, s.categorical(law), cont)


@register_verifier("greedy_block", single_draft=True, cross_iteration=True)
def greedy_block_verify(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    sampler: Sampler | None = None,
) -> VerifyOutput:
    """Greedy block verification: target_probs [1, L+1, V], draft_probs [1, L, V], draft_tokens [1, L].

    First-iteration E[tau] = sum_t sum_{x^t} min(P, Q)(x^t), but the next iterations MUST verify against
    `out.continuation`, which covers the target badly: over whole decodes it often needs more target
    calls than block verification (VERIFIERS.md section 4, caveat 2).
    """
    check_inputs(target_probs, draft_probs, draft_tokens, single=True)
    return recursive_gbv(target_probs, draft_probs, draft_tokens, make_sampler(generator, sampler))


@register_verifier("spectr_gbv", cross_iteration=True)
def spectr_gbv_verify(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    sampler: Sampler | None = None,
) -> VerifyOutput:
    """SpecTr-GBV over K i.i.d. drafts: target_probs [K, L+1, V], draft_probs [K, L, V], draft_tokens [K, L].

    Implemented as RGBV (module docstring): Algorithm 1 (drafts in turn, rejected sub-blocks skipped,
    early stop on a full block, longest accepted sub-block, residual correction) and Algorithm 2 (the
    continuation returned for the next iterations).
    """
    check_inputs(target_probs, draft_probs, draft_tokens)
    return recursive_gbv(target_probs, draft_probs, draft_tokens, make_sampler(generator, sampler))
