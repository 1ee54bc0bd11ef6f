"""Target and draft conditionals along draft prefixes, and the residual laws every verifier needs.

One identity makes the verifiers cheap. Every residual law they form is (q - lam p)_+ normalised for a
scalar lam >= 0, because nested residuals collapse: for a, b >= 0,
    (a (alpha q - beta p)_+ - b p)_+ = (a alpha q - (a beta + b) p)_+.
- token-wise correction: (q - p)_+, lam = 1;
- block verification: (p_i q - p)_+ = p_i (q - p / p_i)_+, lam = 1 / p_i;
- recursive rejection sampling: after a rejection r <- (r - p)_+ with r = (q - lam p)_+ / S(lam) gives
  lam' = lam + S(lam);
- SpecTr: beta(rho) = sum_x min(p, q / rho) = (1 - S(rho)) / rho;
- greedy block verification / SpecTr-GBV: every row of the modified target (greedy_block.py).
So a verifier needs scalars q(x), p(x) at draft tokens and residual masses S(lam) = sum_x (q - lam p)_+,
one pass over the vocabulary each, memoised per (prefix, lam), accumulated in float64.
"""

from __future__ import annotations

import math

from typing import Callable

import torch

Prefix = tuple[int, ...]
LawAt = Callable[[Prefix], torch.Tensor]

# Vocabulary-wide work (q - lam p, its positive part and their sum) runs in the probabilities' own dtype, at
# least float32; every scalar of the acceptance arithmetic (ratios, running products, masses once summed,
# h_i, coins) is float64, and so is the cumulative sum a token is sampled from. With float64 inputs (the
# exact tests) everything is float64. With float32 inputs the extra rounding (one subtraction, and a cascade
# sum of non-negative terms) is of the size of the rounding the inputs already carry, while a float64 copy
# of each row would cost more than the arithmetic it serves: 19 us instead of 48 us per residual mass at V =
# 128k on our CPU.
_SCRATCH: dict[tuple[str, torch.dtype, int], torch.Tensor] = {}


def scratch(like: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """A reused work buffer typed like `like`: [V] (rows None) or [rows, V], V = like.shape[-1].
    Verification is single-threaded and every user reduces the buffer to scalars before the next use, so
    one buffer per (device, dtype, V) serves all: no fresh allocation, whose page faults cost more than
    the arithmetic at V = 128k."""
    key, need = (str(like.device), like.dtype, like.shape[-1]), rows or 1
    buf = _SCRATCH.get(key)
    if buf is None or buf.shape[0] < need:
        buf = _SCRATCH[key] = torch.empty(max(need, 4), like.shape[-1], dtype=like.dtype, device=like.device)
    return buf[0] if rows is None else buf[:rows]


def beyond(q: torch.Tensor, lam: float) -> bool:
    """Whether lam does not fit q's dtype: block verification's lam = 1 / p_i, the inverse of a running
    ratio that a long chain of unlikely tokens drives below 1e-38 (float32's range; seen at L = 8,
    T = 0.7)."""
    return lam > torch.finfo(q.dtype).max


def wide_residual(q: torch.Tensor, p: torch.Tensor, lam: float) -> torch.Tensor:
    """(q - lam p)_+ [..., V] in float64 for a lam beyond q's dtype (`beyond`); lam = inf (a denormal
    running ratio): q where p = 0, the limit, without inf * 0."""
    q64, p64 = q.double(), p.double()
    if math.isinf(lam):
        return torch.where(p64 == 0, q64, torch.zeros_like(q64))
    return torch.sub(q64, p64, alpha=lam).clamp_(min=0)


def residual_mass(q: torch.Tensor, p: torch.Tensor, lam: float) -> float:
    """S(lam) = sum_x (q(x) - lam p(x))_+ for one row q [V], p [V] (q float32/float64): what SpecTr's
    bisection calls 25 times per node."""
    if beyond(q, lam):
        return float(wide_residual(q, p, lam).sum())
    diff = torch.sub(q, p.to(q.dtype), alpha=lam, out=scratch(q))
    return float(diff.clamp_(min=0).sum())


def residual_law(q: torch.Tensor, p: torch.Tensor, lam: float) -> torch.Tensor:
    """(q - lam p)_+ as a new [V] tensor in q's dtype (q float32/float64; float64 for a lam beyond q's
    dtype), unnormalised."""
    if beyond(q, lam):
        return wide_residual(q, p, lam)
    return torch.sub(q, p.to(q.dtype), alpha=lam).clamp_(min=0)


def residual_masses(q: torch.Tensor, p: torch.Tensor, lams: list[float]) -> list[float]:
    """S(lam_r) for each row r of q [R, V], p [R, V] (any float dtype), in ONE pass over the rows."""
    q = working(q)
    if q.shape[0] == 1 or any(beyond(q, lam) for lam in lams):
        return [residual_mass(q[r], p[r], lam) for r, lam in enumerate(lams)]
    lam = torch.tensor(lams, dtype=q.dtype, device=q.device).unsqueeze(1)
    diff = torch.addcmul(q, p.to(q.dtype), lam, value=-1.0, out=scratch(q, q.shape[0]))
    return diff.clamp_(min=0).sum(-1).tolist()


def into(law: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`law` itself, or copied into `out` when the caller gives a row to fill."""
    return law if out is None else out.copy_(law)


def working(t: torch.Tensor) -> torch.Tensor:
    """t itself if float32/float64, else a float32 copy (bf16/fp16 are too coarse for residuals)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


class Rows:
    """q(.|y) and p(.|y) along prefixes y, read lazily from the caller's tensors (any float dtype)."""

    def __init__(self, target_at: LawAt, draft_at: LawAt):
        self.target_at, self.draft_at = target_at, draft_at
        self._mass: dict[tuple[Prefix, float], float] = {}
        self._q: dict[Prefix, float] = {}  # q(x|y) keyed by y + (x,); filled in bulk by draft_rows
        self._p: dict[Prefix, float] = {}

    def preload(self, key: Prefix, q: float, p: float) -> None:
        """q(x|y) and p(x|y) for key = y + (x,), gathered in bulk (`draft_rows`); a known value stays."""
        self._q.setdefault(key, q)
        self._p.setdefault(key, p)

    def q(self, y: Prefix, x: int) -> float:
        key = y + (x,)
        if key not in self._q:
            self._q[key] = float(self.target_at(y)[x])
        return self._q[key]

    def p(self, y: Prefix, x: int) -> float:
        key = y + (x,)
        if key not in self._p:
            self._p[key] = float(self.draft_at(y)[x])
        return self._p[key]

    def point(self, y: Prefix, lam: float, x: int) -> float:
        """(q(x|y) - lam p(x|y))_+, unnormalised."""
        if lam == 0.0:
            return self.q(y, x)
        p = self.p(y, x)
        return self.q(y, x) if p == 0.0 else max(self.q(y, x) - lam * p, 0.0)  # no inf * 0

    def mass(self, y: Prefix, lam: float) -> float:
        """S(lam) = sum_x (q(x|y) - lam p(x|y))_+ ; S(0) = 1 since q is a probability vector."""
        if lam == 0.0:
            return 1.0
        key = (y, lam)
        if key not in self._mass:
            self._mass[key] = residual_mass(working(self.target_at(y)), self.draft_at(y), lam)
        return self._mass[key]

    def remember_mass(self, y: Prefix, lam: float, s: float) -> float:
        """Keep S(lam) of row y computed elsewhere (a batched pass); a known value stays. Returns the kept one."""
        return self._mass.setdefault((y, lam), s)

    def residual(self, y: Prefix, lam: float) -> torch.Tensor:
        """(q - lam p)_+ as a new [V] tensor (unnormalised; the sampler normalises in float64)."""
        q = working(self.target_at(y))
        return residual_law(q, self.draft_at(y), lam) if lam else q.clone()


def token_probs(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, tokens: list[list[int]]
) -> tuple[list[list[float]], list[list[float]]]:
    """The draft tokens' own probabilities, gathered in one op each: q_path[k][i] = target_probs[k, i,
    tokens[k][i]] and p_path[k][i] = draft_probs[k, i, tokens[k][i]] (K lists of L floats)."""
    x = torch.tensor(tokens, dtype=torch.int64, device=draft_probs.device)[:, :, None]
    n = draft_probs.shape[1]
    return (
        target_probs[:, :n].gather(-1, x).squeeze(-1).tolist(),
        draft_probs.gather(-1, x).squeeze(-1).tolist(),
    )


def draft_rows(target_probs: torch.Tensor, draft_probs: torch.Tensor, tokens: list[list[int]]) -> Rows:
    """Rows over the drafts' prefixes: draft_k[:i] -> target_probs[k, i] and draft_probs[k, i].

    target_probs [K, L+1, V], draft_probs [K, L, V], tokens: K lists of L ints. Drafts that share a prefix
    share its conditionals (the calling convention), so the first draft carrying a prefix serves it.
    """
    index: dict[Prefix, tuple[int, int]] = {}
    for k, x in enumerate(tokens):
        for i in range(len(x) + 1):
            index.setdefault(tuple(x[:i]), (k, i))
    n = draft_probs.shape[1]

    def target_at(y: Prefix) -> torch.Tensor:
        return target_probs[index[y]]

    def draft_at(y: Prefix) -> torch.Tensor:
        k, i = index[y]
        if i >= n:
            raise KeyError(f"no draft law after a whole block {y}: beyond the horizon only q is read")
        return draft_probs[k, i]

    rows = Rows(target_at, draft_at)
    q_path, p_path = token_probs(target_probs, draft_probs, tokens)  # most scalar reads hit these
    for k, path in enumerate(tokens):
        for i in range(n):
            rows.preload(tuple(path[: i + 1]), q_path[k][i], p_path[k][i])
    return rows
