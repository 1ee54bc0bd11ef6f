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


def residual_lam(rows: Rows, y: Prefix, row: RowLaw, t: float, pj: float) -> float:
    """lam' with (T(y) T(.|y) - P(y) p(.|y))_+ proportional to (q - lam' p)_+, for a (q - lam p) row:
    T(y) T(.|y) = c (q - lam p)_+ with c = T(y) / S(lam), hence lam' = lam + P(y) / c."""
    return row.lam + pj * rows.mass(y, row.lam) / t


@dataclass(frozen=True)
class Stage:
    """One verified draft: its L tokens and how many of them it accepted (tau_k)."""

    tokens: tuple[int, ...]
    accepted: int


def replay(path: Prefix, rows: Rows, stages: list[Stage] | tuple[Stage, ...], horizon: int):
    """The law of Y after `stages` along `path` (n tokens from the block start); VERIFIERS.md 7.3.

    Returns (laws, t_joint, p_joint): laws[i] = T(.|path[:i]) as RowLaw and t_joint[i] = T(path[:i]) for
    the live rows (T-probability > 0; at most n + 1), p_joint[i] = P(path[:i]) for i <= min(n, horizon).
    """
    n = len(path)
    p_joint = [1.0]
    for i in range(min(n, horizon)):
        p_joint.append(p_joint[-1] * rows.p(path[:i], path[i]))
    laws = [RowLaw()] * (n + 1)
    t_joint = joints(path, rows, laws)
    for stage in stages:
        updated = []
        for i, t in enumerate(t_joint):
            row = laws[i]
            if i < stage.accepted:  # committed prefix: Y follows the accepted draft tokens
                row = RowLaw(token=stage.tokens[i])
            elif i < horizon and row.token is None and t > 0:
                # (T(yx) - P(yx))_+ normalised; a point-mass row stays one, a zero residual (a branch of
                # probability 0) keeps the old law.
                lam = residual_lam(rows, path[:i], row, t, p_joint[i])
                row = RowLaw(lam) if rows.mass(path[:i], lam) > 0 else row
            updated.append(row)
        laws = updated
        t_joint = joints(path, rows, laws)
    return laws, t_joint, p_joint


def joints(path: Prefix, rows: Rows, laws: list[RowLaw]) -> list[float]:
    """T(path[:i]) for the rows up to the first zero (later rows are dead)."""
    out = [1.0]
    for i in range(min(len(path), len(laws))):
        t = out[-1] * laws[i].prob(rows, path[:i], path[i])
        if t <= 0.0:
            break
        out.append(t)
    return out


def gbv_weight(i: int, path: Prefix, rows: Rows, laws: list[RowLaw], t_joint: list[float], p_joint: list[float]) -> float:
    """GBV acceptance weight h_i (1 <= i <= L) of draft `path` (length L) against the law T of `laws`."""
    if i >= len(t_joint):  # T(X^i) = 0: the sub-block was rejected by an earlier draft (the set H)
        return 0.0
    q_i, p_i = t_joint[i], p_joint[i]
    if q_i >= p_i or i == len(path):
        return min(1.0, q_i / p_i) if p_i > 0 else 1.0
    row, y = laws[i], path[:i]
    if row.token is not None:  # A_i = sum_x (Q_i onehot - P_i p)_+
        a = max(q_i - p_i * rows.p(y, row.token), 0.0)
    else:  # A_i = c S(lam + P_i / c), c = Q_i / S(lam)
        a = q_i / rows.mass(y, row.lam) * rows.mass(y, residual_lam(rows, y, row, q_i, p_i))
    return a / (a + p_i - q_i)


@dataclass(frozen=True)
class RGBVContinuation:
    """The law the next iterations verify against: T_{K+1} after every verified draft (Algorithm 2)."""

    stages: tuple[Stage, ...]
    horizon: int

    def cache_key(self) -> tuple:
        """Equal keys give equal laws: a stage only matters through its accepted tokens."""
        return (self.horizon, tuple(st.tokens[: st.accepted] for st in self.stages))

    def __call__(self, prefix: tuple[int, ...], target_probs_at: LawAt, draft_probs_at: LawAt) -> torch.Tensor:
        prefix = tuple(prefix)
        if len(prefix) >= self.horizon:
            return target_probs_at(prefix)
        rows = Rows(target_probs_at, draft_probs_at)
        laws, _, _ = replay(prefix, rows, self.stages, self.horizon)
        if len(laws) <= len(prefix):  # the prefix has probability 0 under T: any law will do
            return target_probs_at(prefix)
        law = row_law(rows, prefix, laws[len(prefix)])
        return law / law.sum()


def recursive_gbv(target_probs, draft_probs, draft_tokens, s: Sampler) -> VerifyOutput:
    """RGBV over the K drafts (shapes as in base.py's calling convention)."""
    tokens = draft_tokens.tolist()
    n = len(tokens[0])
    rows = draft_rows(target_probs, draft_probs, tokens)
    stages: list[Stage] = []
    best_k, best_tau = 0, 0
    for k, x in enumerate(tokens):
        path = tuple(x)
        laws, t_joint, p_joint = replay(path, rows, stages, n)
        tau = backward_scan(s, lambda i: gbv_weight(i, path, rows, laws, t_joint, p_joint), n)
        stages.append(Stage(path, tau))
        if tau > best_tau:
            best_k, best_tau = k, tau
        if best_tau == n:  # a whole block is accepted: later drafts cannot change anything
            break
    cont = RGBVContinuation(tuple(stages), n)
    if best_tau == n:
        return VerifyOutput(n, best_k, s.categorical(target_probs[best_k, n].to(ACC_DTYPE)), cont)
    best = tuple(tokens[best_k][:best_tau])
    laws, _, _ = replay(best, rows, stages, n)
    return VerifyOutput(best_tau, best_k, s.categorical(row_law(rows, best, laws[best_tau])), cont)


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
