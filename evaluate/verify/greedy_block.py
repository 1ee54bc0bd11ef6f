"""Greedy block verification (GBV) and SpecTr-GBV, as recursive greedy block verification (RGBV).

What is published and what is derived (docs/verifiers.md sections 4 and 7):
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
prefix and lam, so drafts sharing a prefix share it); rows with Q_i >= P_i need no pass at all. Rows
whose prefix left a committed prefix (the set H of rejected sub-blocks) have T-probability 0 for good:
`committed_reach` finds them from the accepted tokens alone, so they cost no pass either. The rows of
one draft that replay a stage get their masses in one pass over [rows, V]. There is no root search.

Two forms of the same coupling: `PathCoupling` (the verification call: rows addressed by their position
in the input tensors) and `Coupling` (the continuation, continuation.py: rows at any prefix, through law
lookups). The
tests check that the verifier and a verifier written on `Coupling` give the same outcome law.
"""

from __future__ import annotations


import torch

from .base import VerifyOutput, check_inputs, register_verifier
from .continuation import RGBVContinuation, Stage, committed_reach
from .residuals import Prefix, residual_law, residual_masses, token_probs, working
from .randomness import Sampler, backward_scan, make_sampler


# A row law along the drafts' own paths: (lam, token, S) = a point mass on `token`, else (q - lam p)_+ with
# mass S = S(lam); (0.0, None, 1.0) is the plain target.
_TARGET = (0.0, None, 1.0)


class PathCoupling:
    """Coupling, restricted to the rows a verification call reads: the prefixes of the drafts themselves.

    Same arithmetic as `Coupling` (tests/evaluate/test_verifiers_exact.py checks the two give the same
    outcome law), organised for speed: a row is addressed by its position (k, i) in the input tensors, the
    scalars along the paths (q and p of the draft tokens, the draft joints) are read once, and when draft k
    replays an earlier stage its rows that need a residual mass get it in ONE pass over [rows, V]
    (`residual_masses`) instead of one call per row.
    """

    def __init__(self, target_probs: torch.Tensor, draft_probs: torch.Tensor, tokens: list[list[int]]):
        self.tp, self.dp, self.tokens = target_probs, draft_probs, tokens
        self.n = n = len(tokens[0])
        first: dict[Prefix, tuple[int, int]] = {}  # drafts sharing a prefix share its row
        self.row = [[first.setdefault(tuple(x[:i]), (k, i)) for i in range(n)] for k, x in enumerate(tokens)]
        self.qx, self.px = token_probs(target_probs, draft_probs, tokens)
        self.P = []  # P[k][i] = P(draft k's first i tokens)
        for pk in self.px:
            joint = [1.0]
            for v in pk:
                joint.append(joint[-1] * v)
            self.P.append(joint)
        self.laws: dict[tuple[int, int], list[tuple]] = {r: [_TARGET] for r in first.values()}
        self.stages: list[Stage] = []
        self._mass: dict[tuple[tuple[int, int], float], float] = {}

    def prob(self, law: tuple, k: int, m: int) -> float:
        """T(x | y) for y = draft k's first m tokens and x its next one."""
        lam, token, s = law
        if token is not None:
            return 1.0 if self.tokens[k][m] == token else 0.0
        if lam == 0.0:
            return self.qx[k][m]
        return max(self.qx[k][m] - lam * self.px[k][m], 0.0) / s if s > 0 else 0.0

    def joints(self, k: int, j: int, upto: int) -> list[float]:
        """T_j of draft k's prefixes of length 0..upto."""
        out = [1.0]
        for m in range(upto):
            t = out[-1]
            out.append(t * self.prob(self.laws[self.row[k][m]][j], k, m) if t > 0.0 else 0.0)
        return out

    def masses(self, k: int, items: list[tuple[int, float]]) -> list[float]:
        """Residual masses S(lam) of rows (k, i) for items (i, lam), memoised, new ones in one pass."""
        todo = sorted({(i, lam) for i, lam in items if (self.row[k][i], lam) not in self._mass})
        if todo:
            lo, hi = todo[0][0], todo[-1][0] + 1
            if hi - lo == len(todo):  # consecutive rows: a view, no copy
                q, p = self.tp[k, lo:hi], self.dp[k, lo:hi]
            else:
                idx = torch.tensor([i for i, _ in todo], device=self.tp.device)
                q, p = self.tp[k].index_select(0, idx), self.dp[k].index_select(0, idx)
            for (i, lam), s in zip(todo, residual_masses(q, p, [lam for _, lam in todo])):
                self._mass[(self.row[k][i], lam)] = s
        return [self._mass[(self.row[k][i], lam)] for i, lam in items]

    def bring(self, k: int, stage: int, upto: int) -> None:
        """Give draft k's rows 0..upto-1 their laws after `stage` stages (a row's law after stage j + 1
        depends on its law and joint after stage j, docs/verifiers.md 7.3)."""
        for j in range(stage):
            behind = [i for i in range(upto) if len(self.laws[self.row[k][i]]) == j + 1]
            if not behind:
                continue
            st, joint = self.stages[j], self.joints(k, j, behind[-1])
            new: dict[int, tuple] = {}
            passes: list[tuple[int, float]] = []
            for i in behind:
                law, t = self.laws[self.row[k][i]][j], joint[i]
                if t <= 0.0:  # a dead row, never read again
                    new[i] = law
                elif i < st.accepted:  # the committed prefix
                    new[i] = (0.0, st.tokens[i], 1.0)
                elif law[1] is not None:  # a point mass stays one
                    new[i] = law
                else:  # (T(yx) - P(yx))_+ normalised: lam' = lam + P(y) S(lam) / T(y)
                    passes.append((i, law[0] + self.P[k][i] * law[2] / t))
            for (i, lam), s in zip(passes, self.masses(k, passes)):
                new[i] = (lam, None, s) if s > 0 else self.laws[self.row[k][i]][j]
            for i in behind:
                self.laws[self.row[k][i]].append(new[i])

    def weight(self, k: int, joint: list[float], i: int) -> float:
        """GBV acceptance weight h_i (1 <= i <= L) of draft k against T_k; joint = T_k along the draft."""
        q_i, p_i = joint[i], self.P[k][i]
        if q_i <= 0.0:  # the sub-block was rejected by an earlier draft (the set H)
            return 0.0
        if q_i >= p_i or i == self.n:
            return min(1.0, q_i / p_i) if p_i > 0 else 1.0
        lam, token, s = self.laws[self.row[k][i]][k]
        if token is not None:  # A_i = sum_x (Q_i onehot - P_i p)_+
            a = max(q_i - p_i * float(self.dp[k, i, token]), 0.0)
        else:  # A_i = c S(lam + P_i / c), c = Q_i / S(lam)
            a = q_i / s * self.masses(k, [(i, lam + p_i * s / q_i)])[0]
        return a / (a + p_i - q_i)


def recursive_gbv(target_probs, draft_probs, draft_tokens, s: Sampler) -> VerifyOutput:
    """RGBV over the K drafts (shapes as in base.py's calling convention)."""
    tokens = draft_tokens.tolist()
    n = len(tokens[0])
    pc = PathCoupling(target_probs, draft_probs, tokens)
    best_k, best_tau = 0, 0
    for k, x in enumerate(tokens):
        pc.bring(k, k, min(committed_reach(pc.stages, x) + 1, n))  # rows past the reach are never read
        joint = pc.joints(k, k, n)
        tau = backward_scan(s, lambda i: pc.weight(k, joint, i), n)
        pc.stages.append(Stage(tuple(x), tau))
        if tau > best_tau:
            best_k, best_tau = k, tau
        if best_tau == n:  # a whole block is accepted: later drafts cannot change anything
            break
    cont = RGBVContinuation(tuple(pc.stages), n)
    if best_tau == n:
        return VerifyOutput(n, best_k, s.categorical(target_probs[best_k, n]), cont)
    pc.bring(best_k, len(pc.stages), best_tau + 1)
    lam, token, _ = pc.laws[pc.row[best_k][best_tau]][len(pc.stages)]
    if token is not None:
        return VerifyOutput(best_tau, best_k, token, cont)
    q = working(target_probs[best_k, best_tau])
    law = residual_law(q, draft_probs[best_k, best_tau], lam) if lam else q
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
    calls than block verification (docs/verifiers.md section 4, caveat 2).
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
