"""Supervision from verification, free of any extra target forward (package docstring: `Feedback`).

Every target forward of the decoding loop (the prefill and each verification) returns the target's
features and logits at the positions it commits; the buffer keeps them, bounded, and `feedback_loss`
turns a drafter's outputs on them into the served-data loss.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import torch
from torch import Tensor, nn

from specblock.train.losses import leading_run
from specblock.train.rank_labels import rank_classes, rank_of_token


class Position(NamedTuple):
    """One committed position in the feedback buffer: the request (segment) it belongs to, its features
    [F*H] (half precision), the token after it and the target's argmax after it (its greedy label)."""

    segment: int
    features: Tensor
    token: int
    label: int


class Segment(NamedTuple):
    """Consecutive positions of one request: features [T, F*H], tokens [T], labels [T]."""

    features: Tensor
    tokens: Tensor
    labels: Tensor


class Feedback:
    """A bounded ring of committed positions (`Position`), one segment id per request."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.rows: deque[Position] = deque(maxlen=capacity)
        self.segment = 0

    def new_request(self) -> None:
        self.segment += 1

    def add(self, features: Tensor, tokens: Tensor, logits: Tensor) -> None:
        """features [M, F*H], tokens [M] (the token after each position), logits [M, V] (the target's
        at each position: its argmax is the greedy label of the token after)."""
        labels = logits.argmax(-1).tolist()
        for f, t, y in zip(features.detach().to(torch.float16).cpu(), tokens.tolist(), labels):
            self.rows.append(Position(self.segment, f, int(t), int(y)))

    def __len__(self) -> int:
        return len(self.rows)

    def segments(self) -> list[Segment]:
        """Consecutive runs of one request (of two positions or more)."""
        out, cur, seg = [], [], None
        for row in self.rows:
            if row.segment != seg and cur:
                out.append(cur)
                cur = []
            seg = row.segment
            cur.append(row)
        if cur:
            out.append(cur)
        return [
            Segment(
                torch.stack([r.features for r in c]),
                torch.tensor([r.token for r in c]),
                torch.tensor([r.label for r in c]),
            )
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
    logits: Tensor,
    rank_logits: Tensor | None,
    targets: Tensor,
    valid: Tensor,
    buckets: tuple[int, ...] | None,
) -> tuple[Tensor, dict[str, float]]:
    """The served-data loss (pure). logits [T, K, Vd] draft logits; rank_logits [T, K, C] or None;
    targets [T, K] draft-vocabulary ids of the target's greedy choices (-1: outside the draft vocab);
    valid [T, K] bool; buckets: the rank classes rank_logits predict (None without them). Slot k counts
    only while slots < k were right (the valid prefix, curriculum masking as in training); the Rank Head
    learns the class of the target token's rank on the same slots. Returns the loss (mean over counted
    slots) and accuracy metrics."""
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
