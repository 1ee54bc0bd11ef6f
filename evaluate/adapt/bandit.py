"""The cost-aware bandit (package docstring: `CostAwareBandit`): UCB1 on the lift of tokens per target
call, net of the measured update cost, one decision per window of requests."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .adapter import AdaptConfig


@dataclass
class ArmStats:
    pulls: int = 0
    lift: float = 0.0  # sum of observed lifts of tokens per target call
    cost: float = 0.0  # sum of measured update seconds

    def mean_lift(self) -> float:
        return self.lift / self.pulls

    def mean_cost(self) -> float:
        return self.cost / self.pulls


@dataclass
class Window:
    """What one window of requests measured."""

    tokens: int
    target_calls: int
    seconds: float

    @property
    def beta(self) -> float:
        return self.tokens / max(self.target_calls, 1)

    @property
    def call_seconds(self) -> float:
        return self.seconds / max(self.target_calls, 1)


class CostAwareBandit:
    """UCB1 on the lift of tokens per target call, net of the measured update cost (module docstring)."""

    def __init__(self, arms: list[str], cfg: AdaptConfig):
        self.arms, self.cfg = list(arms), cfg
        self.stats = {a: ArmStats() for a in self.arms}
        self.decisions = 0

    def expected_net(self, arm: str, last: Window) -> float:
        """Seconds an update of `arm` is expected to save over a window like `last`, minus its cost."""
        s = self.stats[arm]
        if s.pulls == 0:
            lift, cost = self.cfg.optimistic_lift, self.cfg.cost_prior
        else:
            bonus = self.cfg.ucb_c * math.sqrt(math.log(max(self.decisions, 1) + 1) / s.pulls)
            lift, cost = s.mean_lift() + bonus, s.mean_cost()
        beta = last.beta
        new = max(beta + lift, 1e-9)
        saved = last.tokens * last.call_seconds * (1.0 / beta - 1.0 / new) if beta > 0 else 0.0
        return saved - cost

    def choose(self, last: Window) -> str:
        """The arm to update now, or "none" when no arm's expected net saving is positive."""
        self.decisions += 1
        if not self.arms:
            return "none"
        nets = {a: self.expected_net(a, last) for a in self.arms}
        best = max(self.arms, key=lambda a: (nets[a], -self.arms.index(a)))
        return best if nets[best] > 0 else "none"

    def observe(self, arm: str, lift: float, cost: float) -> None:
        s = self.stats[arm]
        s.pulls += 1
        s.lift += lift
        s.cost += cost
