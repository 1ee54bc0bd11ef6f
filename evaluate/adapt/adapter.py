"""The adapter the decoding loop calls (package docstring): arms, updates, the replayed reward and the
guards that undo an update."""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor, nn

from specblock.evaluate.decoding.drafters import drafting_spec
from specblock.train.modeling.vocab import target_to_draft_ids

from .bandit import CostAwareBandit, Window
from .feedback import Feedback, feedback_loss, slot_labels

ARMS = ("none", "rank_head", "last_layer", "lora")


@dataclass
class AdaptConfig:
    """enabled: adapt at all; arms: the subsets the bandit may update (besides none); window: requests per
    decision; steps / lr: Adam steps and rate per update; lora_rank; buffer_positions: ring size;
    ucb_c: exploration weight; optimistic_lift / cost_prior: what an unexplored arm is assumed to give /
    cost; revert_margin: relative drop of tokens per target call that reverts an update."""

    enabled: bool = False
    arms: list[str] = field(default_factory=lambda: ["rank_head", "last_layer", "lora"])
    window: int = 2
    steps: int = 4
    lr: float = 1e-3
    lora_rank: int = 8
    buffer_positions: int = 1024
    ucb_c: float = 0.5
    optimistic_lift: float = 1.0
    cost_prior: float = 0.0
    revert_margin: float = 0.02
    seed: int = 0

    def __post_init__(self):
        bad = [a for a in self.arms if a not in ARMS or a == "none"]
        if bad:
            raise ValueError(f"adapt.arms {bad}: choose among {ARMS[1:]}")
        if min(self.window, self.steps, self.lora_rank, self.buffer_positions) < 1 or self.lr <= 0:
            raise ValueError("adapt.window, steps, lora_rank, buffer_positions and lr must be positive")


class LowRankHead(nn.Module):
    """base(x) + B(A(x)) with the base head frozen; B starts at 0 (the adapter starts as a no-op)."""

    def __init__(self, base: nn.Linear, rank: int, seed: int = 0):
        super().__init__()
        self.base = base
        gen = torch.Generator().manual_seed(seed)
        self.A = nn.Parameter(
            torch.randn(rank, base.in_features, generator=gen) / math.sqrt(base.in_features)
        )
        self.B = nn.Parameter(torch.zeros(base.out_features, rank))

    @property
    def weight(self) -> Tensor:  # what code reading `lm_head.weight` sees
        return self.base.weight + self.B @ self.A

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + (x @ self.A.T) @ self.B.T


def arm_parameters(drafter: nn.Module, arm: str, lora_rank: int, seed: int = 0) -> list[nn.Parameter]:
    """The parameters an arm trains (installing the LoRA head on first use); the drafter's spec says
    which parameters its own arms are."""
    if arm == "lora":
        if not isinstance(drafter.lm_head, LowRankHead):
            drafter.lm_head = LowRankHead(drafter.lm_head, lora_rank, seed).to(drafter.d2t.device)
        return [drafter.lm_head.A, drafter.lm_head.B]
    arms = drafting_spec(drafter.cfg.name).arms
    if arm not in arms:
        raise ValueError(f"{type(drafter).__name__} has no arm {arm!r}; its arms: {sorted(arms)} and lora")
    return arms[arm](drafter)


def available_arms(drafter: nn.Module, arms: list[str]) -> list[str]:
    own = drafting_spec(drafter.cfg.name).arms
    return [a for a in arms if a == "lora" or a in own]


@dataclass
class Event:
    """One window: what it measured and what was decided after it."""

    window: int
    tokens: int
    target_calls: int
    seconds: float
    arm: str
    update_seconds: float = 0.0  # training + the two replays
    replay_lift: float | None = None  # held-out accepted-prefix change the update made (the reward)
    rejected: bool = False  # the update did not help on held-out feedback and was undone at once
    reverted: bool = False  # the previous window's update was undone by the served-window guard
    loss: float | None = None


class Snapshot(NamedTuple):
    """The drafter's weights and LM head (the LoRA arm installs a new one) before an update."""

    state: dict
    head: nn.Module


class Adapter:
    """Drives adaptation for one drafter over one benchmark run: `observe_request` after every request,
    `reset` at the start of a run (original weights, empty buffer, fresh bandit)."""

    def __init__(self, drafter: nn.Module, cfg: AdaptConfig):
        self.drafter, self.cfg = drafter, cfg
        self._original = copy.deepcopy(drafter.state_dict())
        self._original_head = drafter.lm_head
        self.reset()

    def reset(self) -> None:
        self.drafter.lm_head = self._original_head
        self.drafter.load_state_dict(self._original)
        self.drafter.eval()
        self.feedback = Feedback(self.cfg.buffer_positions)
        self.bandit = CostAwareBandit(available_arms(self.drafter, self.cfg.arms), self.cfg)
        self.events: list[Event] = []
        self._acc = Window(0, 0, 0.0)
        self._requests = 0
        self._pending: tuple[Window, Snapshot] | None = None  # the window before the last update, snapshot

    # the decoding loop's hooks
    def new_request(self) -> None:
        self.feedback.new_request()

    def collect(self, features: Tensor, tokens: Tensor, logits: Tensor) -> None:
        self.feedback.add(features, tokens, logits)

    def observe_request(self, tokens: int, target_calls: int, seconds: float) -> Event | None:
        """Count one finished request; at the end of a window judge the last update and decide the next."""
        self._acc = Window(
            self._acc.tokens + tokens, self._acc.target_calls + target_calls, self._acc.seconds + seconds
        )
        self._requests += 1
        if self._requests % self.cfg.window:
            return None
        window, self._acc = self._acc, Window(0, 0, 0.0)
        reverted = False
        if self._pending is not None:  # served-window guard on the update made before this window
            before, snapshot = self._pending
            if window.beta < (1.0 - self.cfg.revert_margin) * before.beta:
                self._restore(snapshot)
                reverted = True
            self._pending = None
        arm = self.bandit.choose(window)
        event = Event(
            len(self.events), window.tokens, window.target_calls, window.seconds, arm, reverted=reverted
        )
        if arm != "none":
            segments = self.feedback.segments()
            held, train = segments[-1:], segments[:-1] or segments  # the newest request is held out
            snapshot = self._snapshot()
            start = time.perf_counter()
            old = self.replay_acceptance(held)
            event.loss = self.update(arm, train)
            event.replay_lift = self.replay_acceptance(held) - old
            event.update_seconds = time.perf_counter() - start
            self.bandit.observe(arm, event.replay_lift, event.update_seconds)
            if event.replay_lift <= 0:  # no better on held-out feedback: never served
                self._restore(snapshot)
                event.rejected = True
            else:
                self._pending = (window, snapshot)
        self.events.append(event)
        return event

    def _forward(self, feats: Tensor, toks: Tensor, labels: Tensor):
        """The drafter, teacher-forced on one feedback segment -> (DrafterOutput, slot targets [T, K] as
        draft-vocabulary ids (-1: not in it), their validity [T, K]), all on the drafter's device."""
        dev, dtype = self.drafter.d2t.device, next(self.drafter.parameters()).dtype
        out = self.drafter(feats[None].to(dev, dtype), toks[None].to(dev))
        targets, valid = slot_labels(labels, self.drafter.block_size)
        return out, target_to_draft_ids(targets.to(dev), self.drafter.d2t), valid.to(dev)

    @torch.no_grad()
    def replay_acceptance(self, segments) -> float:
        """Mean accepted-prefix length per position (of K slots, greedy labels) of the current drafter on
        buffered feedback: the acceptance the verifier would have given these drafts, replayed for free."""
        total, count = 0.0, 0
        for feats, toks, labels in segments:
            out, targets, valid = self._forward(feats, toks, labels)
            full = valid.all(-1)  # positions with all K labels
            right = (out.logits[0].argmax(-1) == targets) & valid
            accepted = torch.cumprod(right.int(), dim=1).sum(-1)  # leading right slots
            total += float(accepted[full].sum())
            count += int(full.sum())
        return total / count if count else 0.0

    def _snapshot(self) -> Snapshot:
        return Snapshot(copy.deepcopy(self.drafter.state_dict()), self.drafter.lm_head)

    def _restore(self, snap: Snapshot) -> None:
        self.drafter.lm_head = snap.head
        self.drafter.load_state_dict(snap.state)

    def update(self, arm: str, segments) -> float | None:
        """`steps` Adam steps of the feedback loss on the arm's parameters over `segments` (Feedback.
        segments()); returns the last loss."""
        if not segments:
            return None
        params = arm_parameters(self.drafter, arm, self.cfg.lora_rank, self.cfg.seed)
        frozen = [p.requires_grad for p in self.drafter.parameters()]
        for p in self.drafter.parameters():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.Adam(params, lr=self.cfg.lr)
        self.drafter.train()
        loss_value = None
        try:
            for _ in range(self.cfg.steps):
                opt.zero_grad()
                total = 0.0
                for feats, toks, labels in segments:
                    out, targets, valid = self._forward(feats, toks, labels)
                    rank = None if out.rank_logits is None else out.rank_logits[0]
                    # a drafter with a Rank Head names its classes in its config (SpecBlockConfig)
                    buckets = None if rank is None else tuple(self.drafter.cfg.rank_buckets)
                    loss, _ = feedback_loss(out.logits[0], rank, targets, valid, buckets)
                    (loss / len(segments)).backward()
                    total += float(loss.detach()) / len(segments)
                opt.step()
                loss_value = total
        finally:
            self.drafter.eval()
            for p, f in zip(self.drafter.parameters(), frozen):
                p.requires_grad_(f)
        return loss_value
