"""Cost-aware serving-time adaptation: the drafter learns from verifier feedback while it serves.

docs/specblock.md 1.6: the authors' code keeps only hooks, so this is our design (README "Serving-time
adaptation" gives the rule and its parameters).

Supervision, free of any extra target forward (`Feedback`): every target forward of the decoding loop
(the prefill and each verification) already returns the target's features and logits at the positions
it commits. For each committed context position t the buffer keeps the features at t, the token after
t, and the target's argmax after t (its greedy label). Slot k at position t must predict the target's
choice after position t+1+k: that label, and whether the drafter's argmax got it (the valid prefix: no
loss after the first wrong slot), and the rank of the label in the draft distribution (the Rank Head's
class label) all follow from the buffer. Memory is bounded: a ring of `buffer_positions` positions.

Arms (`ARMS`): `none`; `rank_head` (SpecBlock's Rank Head); `last_layer` (the drafter's last decoder
layer and final norm); `lora` (a rank-r adapter on the draft LM head, W + B A with B = 0 at the start).
An update is `steps` Adam steps on the chosen subset over the buffered segments, timed.

Bandit (`CostAwareBandit`, one decision per window of `window` requests). With beta the tokens per
target call and c the seconds per target call measured on the last window, and N its tokens, an update
of arm a that lifts beta by d saves N c (1/beta - 1/(beta + d)) seconds over a window like the last one.
UCB1 on the lift: d_a = mean lift of a + ucb_c sqrt(ln n / n_a) (n: decisions so far; unexplored arms
are optimistic, d = `optimistic_lift`); the cost C_a is the mean measured update time of a (unexplored:
`cost_prior` seconds). The bandit picks argmax_a saved_a - C_a and updates only if that is > 0; else
`none`. The lift is measured at once, without serving: the newest request's feedback is held out of
the update, and the reward is the change of the mean accepted-prefix length (greedy labels, K slots)
that the verifier would have given the drafter's drafts on it, replayed before and after the update
(accepted draft tokens per position: the same units as tokens per target call). Window-level
acceptance is too noisy for this (two requests move it by +-0.1).

Guards: an update whose replayed lift is <= 0 is undone at once (never served); a served update is
reverted when the next window's tokens per target call fall below (1 - revert_margin) x the window
before. Both restore a snapshot of the drafter taken before the update.
Adaptation never touches verification, so the output law stays the target's whatever the drafter does.
"""

from __future__ import annotations

import copy
import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from specblock.train.losses import RANK_BUCKETS, leading_run, rank_classes, rank_of_token
from specblock.train.modeling.specblock import SpecBlockDrafter
from specblock.train.modeling.vocab import target_to_draft_ids

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


# ---------------------------------------------------------------- supervision


class Feedback:
    """A bounded ring of committed positions: features [F*H] (stored in half precision), the token after
    the position, the target's argmax after it, and a segment id (one per request)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.rows: deque[tuple[int, Tensor, int, int]] = deque(maxlen=capacity)
        self.segment = 0

    def new_request(self) -> None:
        self.segment += 1

    def add(self, features: Tensor, tokens: Tensor, logits: Tensor) -> None:
        """features [M, F*H], tokens [M] (the token after each position), logits [M, V] (the target's
        at each position: its argmax is the greedy label of the token after)."""
        labels = logits.argmax(-1).tolist()
        for f, t, y in zip(features.detach().to(torch.float16).cpu(), tokens.tolist(), labels):
            self.rows.append((self.segment, f, int(t), int(y)))

    def __len__(self) -> int:
        return len(self.rows)

    def segments(self) -> list[tuple[Tensor, Tensor, Tensor]]:
        """Consecutive runs of one request: (features [T, F*H], tokens [T], labels [T])."""
        out, cur, seg = [], [], None
        for row in self.rows:
            if row[0] != seg and cur:
                out.append(cur)
                cur = []
            seg = row[0]
            cur.append(row)
        if cur:
            out.append(cur)
        return [
            (torch.stack([r[1] for r in c]), torch.tensor([r[2] for r in c]), torch.tensor([r[3] for r in c]))
            for c in out
            if len(c) >= 2
        ]


def slot_labels(labels: Tensor, K: int) -> tuple[Tensor, Tensor]:
    """labels [T] (target argmax after each position) -> slot targets [T, K] (slot k at t: labels[t+1+k])
    and their validity [T, K] (False past the segment's end)."""
    T = labels.shape[0]
    idx = torch.arange(T)[:, None] + 1 + torch.arange(K)[None]  # [T,K]
    valid = idx < T
    return labels[idx.clamp(max=T - 1)], valid


def feedback_loss(
    logits: Tensor, rank_logits: Tensor | None, targets: Tensor, valid: Tensor, buckets: tuple[int, ...]
) -> tuple[Tensor, dict[str, float]]:
    """The served-data loss (pure). logits [T, K, Vd] draft logits; rank_logits [T, K, C] or None;
    targets [T, K] draft-vocabulary ids of the target's greedy choices (-1: outside the draft vocab);
    valid [T, K] bool. Slot k counts only while slots < k were right (the valid prefix, curriculum
    masking as in training); the Rank Head learns the class of the target token's rank on the same
    slots. Returns the loss (mean over counted slots) and accuracy metrics."""
    ok = valid & (targets >= 0)
    safe = targets.clamp(min=0)
    right = (logits.argmax(-1) == safe) & ok  # [T,K]
    mask = ok & leading_run(right)
    ce = nn.functional.cross_entropy(logits.flatten(0, 1).float(), safe.flatten(), reduction="none")
    n = mask.sum().clamp(min=1)
    loss = (ce * mask.flatten()).sum() / n
    if rank_logits is not None:
        classes = rank_classes(rank_of_token(logits, safe), buckets)
        rce = nn.functional.cross_entropy(
            rank_logits.flatten(0, 1).float(), classes.flatten(), reduction="none"
        )
        loss = loss + (rce * mask.flatten()).sum() / n
    return loss, {
        "slot0_acc": float(right[:, 0].sum() / ok[:, 0].sum().clamp(min=1)),
        "supervised": int(mask.sum()),
    }


# ---------------------------------------------------------------- parameter subsets


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
    """The parameters an arm trains (installing the LoRA head on first use)."""
    if arm == "rank_head":
        if not hasattr(drafter, "rank_head"):
            raise ValueError(f"{type(drafter).__name__} has no Rank Head")
        return list(drafter.rank_head.parameters())
    if arm == "last_layer":
        last = drafter.layers[-1] if hasattr(drafter, "layers") else drafter.midlayer
        return [*last.parameters(), *drafter.norm.parameters()]
    if arm == "lora":
        if not isinstance(drafter.lm_head, LowRankHead):
            drafter.lm_head = LowRankHead(drafter.lm_head, lora_rank, seed).to(drafter.d2t.device)
        return [drafter.lm_head.A, drafter.lm_head.B]
    raise ValueError(f"unknown arm {arm!r}")


def available_arms(drafter: nn.Module, arms: list[str]) -> list[str]:
    return [a for a in arms if a != "rank_head" or isinstance(drafter, SpecBlockDrafter)]


# ---------------------------------------------------------------- the bandit


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


# ---------------------------------------------------------------- the adapter


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
        self._pending: tuple[Window, dict] | None = None  # the window before the last update, snapshot

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

    def _snapshot(self) -> dict:
        return {"state": copy.deepcopy(self.drafter.state_dict()), "head": self.drafter.lm_head}

    def _restore(self, snap: dict) -> None:
        self.drafter.lm_head = snap["head"]
        self.drafter.load_state_dict(snap["state"])

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
        buckets = tuple(getattr(getattr(self.drafter, "cfg", None), "rank_buckets", RANK_BUCKETS))
        self.drafter.train()
        loss_value = None
        try:
            for _ in range(self.cfg.steps):
                opt.zero_grad()
                total = 0.0
                for feats, toks, labels in segments:
                    out, targets, valid = self._forward(feats, toks, labels)
                    rank = None if out.rank_logits is None else out.rank_logits[0]
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
