"""AdamW and the learning-rate schedule (linear warmup, then cosine / linear / constant)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

SCHEDULES = ("cosine", "linear", "constant")


@dataclass
class OptimConfig:
    lr: float = 5e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 0.5  # max global grad norm; 0 disables clipping
    warmup_steps: int = 0
    schedule: str = "cosine"  # one of SCHEDULES
    min_lr_ratio: float = 0.0  # the decay ends at lr * min_lr_ratio

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)  # OmegaConf.to_object gives a list
        if self.schedule not in SCHEDULES:
            raise ValueError(f"optim.schedule={self.schedule!r}; expected one of {SCHEDULES}")
        if self.lr <= 0 or self.eps <= 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError(f"optim: lr and eps must be > 0, weight_decay and grad_clip >= 0: {self}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas={self.betas}; expected two values in [0, 1)")
        if self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim: warmup_steps >= 0 and 0 <= min_lr_ratio <= 1: {self}")


def build_optimizer(module: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters of `module`.

    Weight decay applies to matrices only (ndim >= 2); biases and norm gains are not decayed
    (nanoGPT's split), since shrinking them towards 0 only hurts.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the drafter module has no trainable parameters")
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Multiplier of `cfg.lr` for the update after `step` updates (0-based).

    Warmup: update s < warmup_steps uses lr * (s + 1) / warmup_steps (so the first update is not
    wasted at lr 0, and update warmup_steps - 1 is at full lr). Then progress p goes 0 -> 1 over the
    remaining updates and the factor decays from 1 to min_lr_ratio (cosine or linear in p).
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> LambdaLR:
    """LambdaLR stepping once per optimizer update (the trainer calls `.step()` after each update)."""
    return LambdaLR(optimizer, partial(lr_factor, total_steps=total_steps, cfg=cfg))
