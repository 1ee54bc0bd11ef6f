"""SpecTr-GBV's (and GBV's) continuation: the law the next iterations verify against (its Algorithm 2).

After the K verified drafts, Y's law T_{K+1} is the target beyond the horizon and, inside it, row by row,
a point mass on a committed prefix or (q - lam p)_+ normalised (greedy_block.py's module docstring).
`Coupling` computes those rows for ANY prefix through law lookups (the next iteration's drafts are new);
`RGBVContinuation` is what the verifier returns and the decoding loop calls per prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import LawAt
from .residuals import Prefix, Rows, beyond, into, residual_law, residual_masses, working
from .randomness import ACC_DTYPE


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


def committed_reach(stages: tuple[Stage, ...] | list[Stage], x: tuple[int, ...] | list[int]) -> int:
    """The longest prefix of x that can keep positive probability after `stages`: a stage fixes Y's first
    tau tokens to its own (point masses), so a prefix that leaves them at position m < tau has probability
    0 beyond m, whatever the residuals (the set H of rejected sub-blocks, found without a pass over V)."""
    reach = len(x)
    for st in stages:
        m = 0
        while m < st.accepted and m < len(x) and x[m] == st.tokens[m]:
            m += 1
        if m < st.accepted and m < len(x):
            reach = min(reach, m)
    return reach


class Coupling:
    """The law T_j of the virtual target sample Y after the first j verified drafts (docs/verifiers.md 7.3),
    row by row: law(j, y) = T_j(.|y) and joint(j, y) = T_j(y), for prefixes y from the block start.

    A row depends on its prefix only, so both are memoised per (j, y): drafts that share a prefix (row 0
    is shared by all) share its work, and rows are computed only when a weight asks for them.
    """

    def __init__(self, rows: Rows, horizon: int, stages: tuple[Stage, ...] = ()):
        self.rows, self.horizon, self.stages = rows, horizon, list(stages)
        self._law: dict[tuple[int, Prefix], RowLaw] = {}
        self._joint: dict[tuple[int, Prefix], float] = {}
        self._draft: dict[Prefix, float] = {(): 1.0}
        self.final: dict[Prefix, torch.Tensor] = {}  # normalised laws after every stage, made by `prepare`

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

    def prepare(self, ys: list[Prefix]) -> None:
        """Before the laws after `ys` are asked: every row's law and joint after every stage, computed stage
        by stage over all rows at once (the arithmetic of `law` and `joint`, whose memos it fills): the rows'
        q and p stacked once, each stage's new residual masses in ONE pass over [rows, V]
        (`residual_masses`), the scalars in flat lists instead of the memoised recursion."""
        ys = sorted({y[:m] for y in ys for m in range(len(y) + 1)}, key=len)  # ys[0] = (), parents first
        rows, horizon, n = self.rows, self.horizon, len(ys)
        where = {y: r for r, y in enumerate(ys)}
        up = [-1] + [where[y[:-1]] for y in ys[1:]]
        qx = [1.0] + [rows.q(y[:-1], y[-1]) for y in ys[1:]]  # the row's last token under its parent row
        px = [1.0] + [rows.p(y[:-1], y[-1]) for y in ys[1:]]
        draft = [self.draft_joint(y) for y in ys]
        # the rows that may take a new mass: inside the horizon, not known from an earlier call
        last = len(self.stages)
        stacked = [r for r, y in enumerate(ys) if len(y) < horizon and (last, y) not in self._law]
        slot = {r: i for i, r in enumerate(stacked)}
        if stacked:
            q = torch.stack([working(rows.target_at(ys[r])) for r in stacked])
            p = torch.stack([rows.draft_at(ys[r]) for r in stacked]).to(q.dtype)
        law = [RowLaw()] * n  # after stage j (j = 0: the plain target), with lam, token and S(lam)
        lam, token, mass = [0.0] * n, [None] * n, [1.0] * n
        for j in range(len(self.stages) + 1):
            joint = [1.0] * n  # T_j along each row's prefix (RowLaw.prob, inlined)
            for r in range(1, n):
                t = self._joint.get((j, ys[r]))
                if t is None:
                    u = up[r]
                    if token[u] is not None:
                        t = joint[u] * (1.0 if ys[r][-1] == token[u] else 0.0)
                    elif lam[u] == 0.0:
                        t = joint[u] * qx[r]
                    else:
                        t = joint[u] * (max(qx[r] - lam[u] * px[r], 0.0) / mass[u] if mass[u] > 0 else 0.0)
                    self._joint[(j, ys[r])] = t
                joint[r] = t
            if j == len(self.stages):
                if stacked:
                    rows_at = [(joint[r], lam[r], token[r], mass[r]) for r in stacked]
                    self._final_laws([ys[r] for r in stacked], q, p, rows_at)
                return
            st, todo = self.stages[j], []
            for r, y in enumerate(ys):  # _after_stage's cases, the new masses left for one pass
                key, t = (j + 1, y), joint[r]
                known = self._law.get(key)
                if known is not None:
                    law[r], lam[r], token[r] = known, known.lam, known.token
                    mass[r] = 1.0 if known.token is not None else rows.mass(y, known.lam)
                elif t > 0.0 and len(y) < st.accepted:
                    law[r] = self._law[key] = RowLaw(token=st.tokens[len(y)])
                    lam[r], token[r], mass[r] = 0.0, st.tokens[len(y)], 1.0
                elif t <= 0.0 or len(y) >= horizon or token[r] is not None:
                    self._law[key] = law[r]
                else:  # lam' = lam + P(y) S(lam) / T(y) (residual_lam)
                    todo.append((r, lam[r] + draft[r] * mass[r] / t))
            if todo:
                lams = [0.0] * len(stacked)
                for r, v in todo:
                    lams[slot[r]] = v
                masses = residual_masses(q, p, lams)
                for r, v in todo:
                    m = rows.remember_mass(ys[r], v, masses[slot[r]])
                    if m > 0:
                        law[r], lam[r], mass[r] = RowLaw(v), v, m
                    self._law[(j + 1, ys[r])] = law[r]

    def _final_laws(self, ys: list[Prefix], q: torch.Tensor, p: torch.Tensor, rows: list[tuple]) -> None:
        """The normalised laws (q - lam p)_+ / S(lam) after every stage of the stacked rows ys (q, p [R, V];
        rows: (joint, lam, token, S(lam)) of each) that have one, in one pass over [R, V] instead of one per
        row as RGBVContinuation asks for them; the arithmetic of `residual_masses`, so S(lam) is their sum."""
        keep = [i for i, (t, lam, token, _) in enumerate(rows) if t > 0.0 and token is None and lam != 0.0]
        if not keep:
            return
        if len(keep) < len(ys):
            idx = torch.tensor(keep, device=q.device)
            q, p = q.index_select(0, idx), p.index_select(0, idx)
        lams = torch.tensor([rows[i][1] for i in keep], dtype=q.dtype, device=q.device).unsqueeze(1)
        masses = [rows[i][3] for i in keep]
        if any(beyond(q, rows[i][1]) for i in keep):  # a lam past q's dtype: float64, row by row
            for n, i in enumerate(keep):
                self.final[ys[i]] = residual_law(q[n], p[n], rows[i][1]).div_(masses[n]).to(q.dtype)
            return
        law = torch.addcmul(q, p, lams, value=-1.0).clamp_(min=0)
        law.div_(torch.tensor(masses, dtype=q.dtype, device=q.device).unsqueeze(1))
        for n, i in enumerate(keep):
            self.final[ys[i]] = law[n]

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


@dataclass(frozen=True)
class RGBVContinuation:
    """The law the next iterations verify against: T_{K+1} after every verified draft (Algorithm 2).

    Called with the same two law lookups again (the decoding loop asks for every prefix of the next
    iteration's drafts), it keeps one Coupling for them, so the prefixes share their ancestors' rows and
    residual masses instead of replaying every stage along every prefix from scratch.
    """

    stages: tuple[Stage, ...]
    horizon: int
    _bound: list = field(default_factory=list, compare=False, hash=False, repr=False)

    def _coupling(self, target_probs_at: LawAt, draft_probs_at: LawAt) -> Coupling:
        if not (self._bound and self._bound[0] is target_probs_at and self._bound[1] is draft_probs_at):
            rows = Rows(target_probs_at, draft_probs_at)
            self._bound[:] = [target_probs_at, draft_probs_at, Coupling(rows, self.horizon, self.stages)]
        return self._bound[2]

    def cache_key(self) -> tuple:
        """Equal keys give equal laws: a stage only matters through its accepted tokens."""
        return (self.horizon, tuple(st.tokens[: st.accepted] for st in self.stages))

    def reads_draft(self, prefix: tuple[int, ...]) -> bool:
        """Whether the law after `prefix` may read draft laws (along it): not past the horizon, nor after
        a prefix of probability 0 (committed_reach), where the plain target is returned."""
        return len(prefix) < self.horizon and committed_reach(self.stages, prefix) >= len(prefix)

    def prepare(self, prefixes: list[tuple[int, ...]], target_probs_at: LawAt, draft_probs_at: LawAt) -> None:
        """Before the laws after `prefixes` are asked with these lookups: their rows, one batched residual
        mass pass per stage (`Coupling.prepare`). `prefixes`: ones that `reads_draft` (the caller filters
        them: Level.prefetch), closed under taking prefixes."""
        if prefixes:
            self._coupling(target_probs_at, draft_probs_at).prepare([tuple(y) for y in prefixes])

    def __call__(
        self,
        prefix: tuple[int, ...],
        target_probs_at: LawAt,
        draft_probs_at: LawAt,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The law T_{K+1}(.|prefix) [V], normalised; written into `out` ([V], the input's dtype) when given
        (the decoding loop passes its row of the next verification's [K, L+1, V] input: no copy)."""
        prefix = tuple(prefix)
        if len(prefix) >= self.horizon or committed_reach(self.stages, prefix) < len(prefix):
            return into(target_probs_at(prefix), out)  # past the horizon, or probability 0: the target
        coupling = self._coupling(target_probs_at, draft_probs_at)
        if prefix in coupling.final:  # made in one batch by `prepare`
            return into(coupling.final[prefix], out)
        j = len(self.stages)
        if coupling.joint(j, prefix) <= 0.0:  # the prefix has probability 0 under T: any law will do
            return into(target_probs_at(prefix), out)
        row, rows = coupling.law(j, prefix), coupling.rows
        if row.token is not None or row.lam == 0.0:
            law = row_law(rows, prefix, row)
            return into(law / law.sum(), out)
        # (q - lam p)_+ over its mass S(lam), which the coupling has already summed (the same float ops, so
        # the same value as its sum): one pass over V less than normalising by the sum, and no second tensor
        q = working(rows.target_at(prefix))
        if beyond(q, row.lam):
            return into(
                (residual_law(q, rows.draft_at(prefix), row.lam) / rows.mass(prefix, row.lam)).to(q.dtype),
                out,
            )
        law = torch.sub(q, rows.draft_at(prefix).to(q.dtype), alpha=row.lam, out=out)
        return law.clamp_(min=0).div_(rows.mass(prefix, row.lam))
