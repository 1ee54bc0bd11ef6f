"""Multi-draft verifiers over the trie of K i.i.d. drafts: SpecTr K-SEQ, recursive rejection sampling,
and greedy (temperature 0) verification.

All three walk the drafts position by position: at position i the alive drafts share the accepted
prefix, so their conditionals are equal and their next tokens are i.i.d. candidates from p(.|prefix).
A node rule picks one candidate (the drafts carrying it stay alive) or returns the correction law.
"""

from __future__ import annotations

from typing import Callable

import torch

from .base import VerifyOutput, check_inputs, register_verifier
from .residuals import Prefix, Rows, draft_rows, working
from .randomness import ACC_DTYPE, Sampler, first_success, make_sampler

# A node rule: (rows, the node's prefix y, candidate tokens in draft order, sampler) ->
# (index of the accepted candidate, None), or (None, the correction: a [V] law or a token id).
NodeRule = Callable[[Rows, Prefix, list[int], Sampler], tuple[int | None, torch.Tensor | int | None]]

# Bisection tolerance on rho (relative to the bracket [1, k]). Any rho with g(rho) >= 0 keeps K-SEQ
# exact; the tolerance only costs acceptance rate (at most ~RHO_TOL relative) against iterations
# (about log2(k / RHO_TOL) = 25 at k = 4). This is the "binary search" that SpecTr-GBV removes.
RHO_TOL = 1e-7


def walk_drafts(draft_tokens: torch.Tensor, rows: Rows, rule: NodeRule, s: Sampler) -> VerifyOutput:
    """Verify the trie of drafts [K, L] with `rule` at every node."""
    tokens = draft_tokens.tolist()
    n, alive, prefix = len(tokens[0]), list(range(len(tokens))), ()
    for i in range(n):
        candidates = [tokens[j][i] for j in alive]  # alive drafts share `prefix`, hence its conditionals
        choice, correction = rule(rows, prefix, candidates, s)
        if choice is None:
            token = correction if isinstance(correction, int) else s.categorical(correction)
            return VerifyOutput(i, alive[0], token)
        prefix += (candidates[choice],)
        alive = [j for j in alive if tokens[j][i] == candidates[choice]]
    return VerifyOutput(n, alive[0], s.categorical(rows.target_at(prefix)))


def kseq_rho(rows: Rows, y: Prefix, k: int) -> tuple[float, float]:
    """SpecTr's rho*: the root in [1, k] of 1 - (1 - beta(rho))^k = rho beta(rho), where
    beta(rho) = sum_x min(p(x), q(x)/rho) = (1 - S(rho)) / rho (residuals.py). Bisection keeps the upper end,
    so g(rho) = rho beta - 1 + (1-beta)^k >= 0, which keeps the residual non-negative. Returns
    (rho, beta(rho))."""

    def beta(rho: float) -> float:
        return (1.0 - rows.mass(y, rho)) / rho if rho != 1.0 else 1.0 - rows.mass(y, 1.0)

    b1 = beta(1.0)
    if b1 - 1.0 + (1.0 - b1) ** k >= 0:  # p = q here (g(1) = 0): rho = 1 accepts every candidate
        return 1.0, b1
    lo, hi = 1.0, float(k)
    while hi - lo > RHO_TOL * k:
        mid = 0.5 * (lo + hi)
        b = beta(mid)
        if mid * b - 1.0 + (1.0 - b) ** k >= 0:
            hi = mid
        else:
            lo = mid
    return hi, beta(hi)


def kseq_rule(rows: Rows, y: Prefix, candidates: list[int], s: Sampler):
    """K-SEQ (Sun et al., NeurIPS 2023) at one node, docs/verifiers.md section 5."""
    k = len(candidates)
    rho, beta = kseq_rho(rows, y, k)
    # accept X_j with probability min(1, q(X_j) / (rho p(X_j))), the first success wins
    accept = [min(1.0, rows.q(y, x) / (rho * rows.p(y, x))) if rows.p(y, x) > 0 else 1.0 for x in candidates]
    j = first_success(s, torch.tensor(accept, dtype=ACC_DTYPE))
    if j < k:
        return j, None
    none = (1.0 - beta) ** k  # probability that every candidate was rejected
    q = working(rows.target_at(y))  # residuals.py: vocabulary-wide work in the input's dtype
    if beta <= 0.0 or none <= 0.0:
        return None, q
    residual = kseq_residual(q, working(rows.draft_at(y)), rho, beta, none)
    if residual.sum() > 0:
        return None, residual
    # (1 - beta)^k below q's resolution: q - m cancelled in float32; redone in float64, and where that cancels
    # too (none below ~1e-16, a path no sampler reaches in practice) the target's own law
    residual = kseq_residual(q.to(ACC_DTYPE), rows.draft_at(y).to(ACC_DTYPE), rho, beta, none)
    return None, residual if residual.sum() > 0 else q


def kseq_residual(q: torch.Tensor, p: torch.Tensor, rho: float, beta: float, none: float) -> torch.Tensor:
    """K-SEQ's correction law, unnormalised: (q - m)_+ with m(x) = min(p(x), q(x) / rho) (1 - none) / beta,
    in q's dtype; its sum is `none` = (1 - beta)^k, so where that is below q's resolution (p nearly q) the
    float32 difference cancels to 0 and the caller redoes it in float64. q, p: [V]."""
    accepted = torch.minimum(p.to(q.dtype), q / rho).mul_((1.0 - none) / beta)
    return torch.sub(q, accepted).clamp_(min=0)


def rrs_rule(rows: Rows, y: Prefix, candidates: list[int], s: Sampler):
    """Recursive rejection sampling with replacement (SpecInfer; docs/verifiers.md section 6a).

    r starts at q; a rejection sets r <- (r - p)_+ normalised, i.e. lam <- lam + S(lam) (residuals.py). A
    rejected token gets r(x) = 0, so a duplicate candidate is rejected too."""
    lam = 0.0
    for j, x in enumerate(candidates):
        mass, px = rows.mass(y, lam), rows.p(y, x)
        r_x = rows.point(y, lam, x) / mass if mass > 0 else 0.0
        if s.bernoulli(min(1.0, r_x / px) if px > 0 else float(r_x > 0)):
            return j, None
        lam += mass
    return None, rows.residual(y, lam) if rows.mass(y, lam) > 0 else rows.target_at(y)


def greedy_token(q: torch.Tensor) -> int:
    """The target's greedy token. torch.argmax returns the FIRST maximal index; the decoding loop's
    temperature-0 sampler uses this same function, so ties break identically."""
    return int(torch.argmax(q))


def greedy_rule(rows: Rows, y: Prefix, candidates: list[int], s: Sampler):
    """Temperature 0 (docs/verifiers.md section 6d): descend iff a candidate is the target's argmax."""
    best = greedy_token(rows.target_at(y))
    return (candidates.index(best), None) if best in candidates else (None, best)


def _trie_verifier(name: str, rule: NodeRule, doc: str):
    def verify(
        target_probs: torch.Tensor,
        draft_probs: torch.Tensor,
        draft_tokens: torch.Tensor,
        generator: torch.Generator | None = None,
        *,
        sampler: Sampler | None = None,
    ) -> VerifyOutput:
        check_inputs(target_probs, draft_probs, draft_tokens)
        rows = draft_rows(target_probs, draft_probs, draft_tokens.tolist())
        return walk_drafts(draft_tokens, rows, rule, make_sampler(generator, sampler))

    verify.__name__ = f"{name}_verify"
    verify.__doc__ = doc + "\n\ntarget_probs [K, L+1, V], draft_probs [K, L, V], draft_tokens [K, L]."
    return register_verifier(name)(verify)


spectr_verify = _trie_verifier(
    "spectr", kseq_rule, "SpecTr K-SEQ over K i.i.d. drafts, drafts pruned position by position."
)
rrs_verify = _trie_verifier(
    "rrs", rrs_rule, "Multi-draft recursive rejection sampling over the trie of K i.i.d. drafts (SpecInfer)."
)
greedy_verify = _trie_verifier(
    "greedy", greedy_rule, "Greedy (temperature 0) verification of one or several drafts: the longest match."
)
