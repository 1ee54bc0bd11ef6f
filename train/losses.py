"""Drafter training losses and metrics: pure functions on tensors (docs/specblock.md 1.3 and 1.5).

Shared shapes. Every drafter returns per-slot draft logits [B,S,K,V]: slot k at context position t
predicts token t+2+k. The trainer passes the target's logits for the same tokens, restricted to the
draft vocabulary (teacher [B,S,K,V]), and `valid` [B,S,K] bool (the predicted token exists, is a real
token and is an assistant token). Rank-head logits are [B,S,K,C] with C = len(rank_buckets)+1.

Metrics are returned as `<name>_sum` / `<name>_count` tensor pairs so the trainer can all-reduce them
before dividing. Losses are float32 even for bf16 inputs.

The loss is kept as TERMS (`LossTerms`): per slot, the sum of its entries' weighted losses and how many
entries it averages over. `normalised_loss(sums, counts)` divides; it is linear in `sums`, so the loss
of several micro-batches (and ranks) taken as one batch is `normalised_loss` of each one's sums with the
counts summed over all of them: the trainer's gradient-accumulation contract (`strategy.py`). Some
counts (the valid-prefix entries, the Rank Head's chain and classes) depend on the drafter's predictions,
so they are known only after its forward.

Reference: the authors' `specforge/core/specblock.py::_compute_batched_loss_acc_and_rank`. Deliberate
difference: a slot whose target token is invalid breaks both chains (valid-prefix and rank chain), as
greedy verification never gets past it; the reference compares whatever argmax it finds there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .rank_labels import RANK_BUCKETS, rank_classes, rank_of_target
from .teacher_law import TeacherLaw, argmax_last, as_law, at_least_fp32, forward_kl

CURRICULUM_UNITS = ("steps", "epochs")
CURRICULUM_SHAPES = ("linear", "cosine", "step", "off")  # off: alpha = 0, the plain full loss (EAGLE-3)
# Denominator floor of weighted means whose weights are all zero (the numerator is then 0 too).
_EPS = 1e-12


@dataclass
class CurriculumConfig:
    """Schedule of alpha in loss = (1-alpha) * full loss (every valid slot) + alpha * valid-prefix loss.

    alpha is 0 before `start`, 1 from `end` on, and in between follows `shape`: "linear", "cosine"
    (half-cosine: flat at both ends) or "step" (0 until `end`, then 1). `unit` says whether start/end
    count optimizer steps or epochs.

    Default: linear from step 0 to step 1000. A fresh drafter's top-1 is almost always wrong, so a
    pure valid-prefix loss from step 0 gives slots >= 1 almost no entries (only where every earlier slot
    is already right) and trains little but slot 0 at first. The full loss lets every slot learn the
    easy tokens first; the ramp then hands over to the loss that matches inference (slot k matters only
    when slots < k were accepted) as slot-0 accuracy rises. Linear is the simplest monotone handover;
    steps (not epochs) keep it independent of the data-set size and short runs. start = end = 0 gives
    the authors' recipe (valid-prefix loss from step 0).
    """

    start: int = 0
    end: int = 1000
    unit: str = "steps"
    shape: str = "linear"

    def __post_init__(self) -> None:
        if self.unit not in CURRICULUM_UNITS:
            raise ValueError(f"curriculum unit {self.unit!r} not in {CURRICULUM_UNITS}")
        if self.shape not in CURRICULUM_SHAPES:
            raise ValueError(f"curriculum shape {self.shape!r} not in {CURRICULUM_SHAPES}")
        if not 0 <= self.start <= self.end:
            raise ValueError(f"curriculum needs 0 <= start <= end, got start={self.start} end={self.end}")


@dataclass
class LossConfig:
    """Weights and switches of `specblock_loss`.

    slot_decay: slot k's distillation loss is weighted by slot_decay**k (0.8, like EAGLE-3).
    rank_budget: per-batch, per-slot class re-weighting w(c) = min(1, budget / count_c); <= 0 disables.
    rank_start_step: the rank loss counts from this optimizer step on (authors' default 2000, 0 in
        their release scripts).
    draft_topk: HASS-style distillation over the teacher's top-k tokens only; None = full vocabulary.
    teacher_temperature: the drafter distils softmax(target logits / teacher_temperature); 1 is the target's
        own law (exact distillation), below 1 a sharper law with the same argmax, which puts the loss on the
        token greedy (T = 0) verification accepts.
    """

    slot_decay: float = 0.8
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    rank_budget: int = 10
    rank_start_step: int = 0
    rank_weight: float = 1.0
    draft_topk: int | None = None
    teacher_temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.slot_decay <= 0:
            raise ValueError(f"slot_decay must be > 0, got {self.slot_decay}")
        if self.rank_weight < 0:
            raise ValueError(f"rank_weight must be >= 0, got {self.rank_weight}")
        if not self.teacher_temperature > 0:
            raise ValueError(f"teacher_temperature must be > 0, got {self.teacher_temperature}")
        if self.draft_topk is not None and self.draft_topk < 1:
            raise ValueError(f"draft_topk must be None or >= 1, got {self.draft_topk}")


@dataclass
class LossOutput:
    """loss: the batch's own loss (`normalised_loss` of `terms`: what a single micro-batch, with no
    accumulation and one rank, back-propagates). terms: the same loss as sums and counts, for a batch made
    of several micro-batches or ranks. metrics: detached `<name>_sum`/`<name>_count` pairs.
    slot_losses [K]: per-slot distillation loss before slot weights. rank_loss: before gating and
    rank_weight (0 without a rank head). prefix_alpha: the curriculum's alpha at this step."""

    loss: Tensor
    terms: LossTerms
    metrics: dict[str, Tensor]
    slot_losses: Tensor
    rank_loss: Tensor
    prefix_alpha: float


def leading_run(ok: Tensor) -> Tensor:
    """[..., K] bool -> [..., K] bool: True at slot k iff ok[..., :k] are all True (slot 0: always)."""
    run = torch.cumprod(ok.long(), dim=-1)  # 1 while every slot so far, inclusive, is ok
    return torch.cat([torch.ones_like(run[..., :1]), run[..., :-1]], dim=-1).bool()


# ---------------------------------------------------------------- distillation


def slot_weights(K: int, decay: float = 0.8, device: torch.device | None = None) -> Tensor:
    """[K] float32: decay**k, the weight of slot k's distillation loss."""
    return decay ** torch.arange(K, dtype=torch.float32, device=device)


FULL, PREFIX, RANK = "full", "prefix", "rank"  # the loss terms (`LossTerms` keys)


class LossTerms(NamedTuple):
    """A loss before normalisation, as sums that add over micro-batches and ranks.

    sums: term -> numerator (with grad): FULL and PREFIX [K] = slot weight x curriculum weight x the sum
        of the slot's KL over its valid (resp. valid-prefix) entries; RANK [K, C] = the gated, weighted
        sum of the Rank Head's distance-weighted CE over its chain entries of true class c at slot k.
    counts: term -> the entries each numerator sums (same shapes, detached float32).
    Keys may carry a prefix (`"block1/full"`); `normalised_loss` reads the last path part.
    """

    sums: dict[str, Tensor]
    counts: dict[str, Tensor]


def distill_terms(kl: Tensor, valid: Tensor, prefix: Tensor, decay: float, alpha: float) -> LossTerms:
    """kl [B,S,K], valid and prefix [B,S,K] bool -> FULL and PREFIX terms (see `normalised_loss`).

    Normalised: sum_k decay**k ((1-alpha) mean KL over slot k's valid entries + alpha mean over its
    prefix entries) (docs/specblock.md 1.5: total = sum_k w_k L_draft,k); alpha = 1 is the authors'
    chain-masked loss. Blending the two means, not weighting entries 1 / (1-alpha) in one mean, keeps
    alpha effective on a slot with few prefix entries: a single weighted mean would normalise the
    (1-alpha) away there."""
    w = slot_weights(kl.shape[-1], decay, kl.device)  # [K]
    sums = {FULL: (1.0 - alpha) * w * (kl * valid).sum((0, 1)), PREFIX: alpha * w * (kl * prefix).sum((0, 1))}
    counts = {FULL: valid.float().sum((0, 1)), PREFIX: prefix.float().sum((0, 1))}
    return LossTerms(sums, counts)


def budget_weights(class_counts: Tensor, budget: int) -> Tensor:
    """Rank-class re-weighting: class_counts [..., K, C] (entries of true class c at slot k) -> weights
    min(1, budget / count) of the same shape; budget <= 0 disables (all 1)."""
    if budget <= 0:
        return torch.ones_like(class_counts)
    return (budget / class_counts.clamp_min(1.0)).clamp(max=1.0)


def normalised_loss(sums: dict[str, Tensor], counts: dict[str, Tensor], rank_budget: int) -> Tensor:
    """The loss from `LossTerms` sums and counts (the counts of the whole batch the loss averages over).

    FULL / PREFIX: sum over slots of numerator / count (a slot without entries adds 0). RANK (as the
    reference): sum(w * numerator) / sum(w * count) over slots and classes with w = `budget_weights` of
    the counts: each class's entries weigh at most budget / count. Linear in `sums`."""
    total = torch.zeros((), device=next(iter(sums.values())).device)
    for key, num in sums.items():
        count = counts[key].to(num.dtype)
        if key.rsplit("/", 1)[-1] == RANK:
            w = budget_weights(count, rank_budget)
            total = total + (w * num).sum() / (w * count).sum().clamp_min(_EPS)
        else:
            total = total + (num / count.clamp_min(1.0)).sum()
    return total


@torch.no_grad()
def top1_correct(draft_logits: Tensor, teacher: Tensor | TeacherLaw, valid: Tensor) -> Tensor:
    """draft logits [B,S,K,V], teacher logits [B,S,K,V] or law, valid [B,S,K] -> [B,S,K] bool: valid and
    argmax draft == argmax teacher."""
    return valid & (argmax_last(draft_logits) == as_law(teacher).argmax)


@torch.no_grad()
def valid_prefix_mask(draft_logits: Tensor, teacher: Tensor | TeacherLaw, valid: Tensor) -> Tensor:
    """The authors' chain mask: [B,S,K] bool, True where slot k is valid and slots 0..k-1 at that
    position are all top-1 correct (and valid). Slot k itself counts even if it is wrong."""
    return valid & leading_run(top1_correct(draft_logits, teacher, valid))


def prefix_weight(cfg: CurriculumConfig, step: int, epoch: float) -> float:
    """Curriculum alpha in [0, 1] at this step / epoch (see CurriculumConfig); non-decreasing in time."""
    t = step if cfg.unit == "steps" else epoch
    if cfg.shape == "off":
        return 0.0
    if t >= cfg.end:
        return 1.0
    if t < cfg.start or cfg.shape == "step":
        return 0.0
    frac = (t - cfg.start) / (cfg.end - cfg.start)
    return frac if cfg.shape == "linear" else 0.5 * (1.0 - math.cos(math.pi * frac))


# ---------------------------------------------------------------- rank loss


def ordinal_soft_targets(classes: Tensor, num_classes: int) -> Tensor:
    """Asymmetric ordinal label smoothing: classes [...] -> soft targets [..., C], rows sum to 1.
    s(c | t) ∝ 1 / (1 + |c-t| + max(t-c, 0))^2: a class below the truth (under-estimating the rank,
    which would prune the right token) gets less mass than one equally far above it."""
    c = torch.arange(num_classes, device=classes.device, dtype=torch.float32)  # [C]
    diff = classes.unsqueeze(-1).float() - c  # [..., C]  t - c
    raw = 1.0 / (1.0 + diff.abs() + diff.clamp(min=0.0)).square()
    return raw / raw.sum(-1, keepdim=True)


def distance_weight(target: Tensor, pred: Tensor) -> Tensor:
    """Asymmetric distance weight 1 + |t-p| + max(t-p, 0), float: under-estimating (p < t) costs
    2 per class of distance, over-estimating (only wasted branches) 1."""
    diff = (target - pred).float()
    return 1.0 + diff.abs() + diff.clamp(min=0.0)


def rank_chain_mask(pred: Tensor, classes: Tensor, valid: Tensor) -> Tensor:
    """Rank-chain curriculum: pred, classes [B,S,K] long, valid [B,S,K] bool -> [B,S,K] bool, True on
    slots 0..M where M is the first slot whose rank prediction is wrong (inclusive), valid only."""
    return valid & leading_run(valid & (pred == classes))


def rank_terms(
    rank_logits: Tensor, classes: Tensor, valid: Tensor
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Rank-head loss (docs/specblock.md 1.5, 4 parts) as sums, and rank accuracy.

    rank_logits [B,S,K,C], classes [B,S,K] long (`rank_classes`), valid [B,S,K] bool -> (sums [K,C] with
    grad: the distance-weighted soft CE summed over the chain entries of true class c at slot k; counts
    [K,C] float32: those entries; metrics rank_acc_sum/count [K] (per slot, over valid entries, no chain)
    and rank_class_acc_sum/count [C] (by true class)). `normalised_loss` applies the class re-weighting
    (2), which needs the counts of the whole batch; the rank weights carry no gradient.
    """
    logits = at_least_fp32(rank_logits)
    C = logits.shape[-1]
    with torch.no_grad():
        pred = logits.argmax(-1)  # [B,S,K]
        mask = rank_chain_mask(pred, classes, valid)  # (1) chain curriculum
        in_class = F.one_hot(classes, C).float() * mask.unsqueeze(-1)  # [B,S,K,C] chain entries by class
        soft = ordinal_soft_targets(classes, C)  # (3) ordinal smoothing [B,S,K,C]
        w_dist = distance_weight(classes, pred)  # (4) asymmetric distance
    ce = -(soft * F.log_softmax(logits, -1)).sum(-1)  # [B,S,K]
    sums = ((w_dist * ce).unsqueeze(-1) * in_class).sum((0, 1))  # [K,C]
    correct = (valid & (pred == classes)).float()
    by_class = F.one_hot(classes, C).float() * valid.unsqueeze(-1)  # [B,S,K,C]
    metrics = {
        "rank_acc_sum": correct.sum((0, 1)),
        "rank_acc_count": valid.float().sum((0, 1)),
        "rank_class_acc_sum": (by_class * correct.unsqueeze(-1)).sum((0, 1, 2)),
        "rank_class_acc_count": by_class.sum((0, 1, 2)),
    }
    return sums, in_class.sum((0, 1)), metrics


def rank_loss(
    rank_logits: Tensor, classes: Tensor, valid: Tensor, budget: int = 10
) -> tuple[Tensor, dict[str, Tensor]]:
    """The rank loss of one batch on its own, as the reference computes it: sum(w_class * w_dist * CE) /
    sum(w_class) over all slots (`rank_terms`, `normalised_loss`) -> (loss [] float32, metrics)."""
    sums, counts, metrics = rank_terms(rank_logits, classes, valid)
    return normalised_loss({RANK: sums}, {RANK: counts}, budget), metrics


def rank_loss_weight(step: int, start: int) -> float:
    """Gate of the rank loss: 0.0 before optimizer step `start`, 1.0 from it on."""
    return 1.0 if step >= start else 0.0


# ---------------------------------------------------------------- metrics


@torch.no_grad()
def draft_metrics(correct: Tensor, valid: Tensor, kl: Tensor, prefix: Tensor) -> dict[str, Tensor]:
    """Sums and counts (float32) for ratio-of-global-sums metrics.

    correct, valid, prefix [B,S,K] bool (`top1_correct`, validity, valid-prefix mask), kl [B,S,K] ->
    top1 [K]: top-1 accuracy per slot over valid entries (no prefix mask); kl [K]: mean KL per slot
    over valid entries; prefix [K]: share of valid entries inside the valid prefix; accept_len []:
    simulated acceptance length under greedy verification = leading top-1-correct slots (stopping at
    the first wrong or invalid one) per position whose slot 0 is valid, draft tokens only (add 1 for
    the target's bonus token to compare with decoding's tau); accept_hist [K+1]: share of those
    positions accepting exactly 0..K slots.
    """
    K = correct.shape[-1]
    n_valid = valid.float().sum((0, 1))  # [K]
    starts = valid[..., 0].float()  # [B,S] 1 at positions that count as a verify step
    accepted = torch.cumprod(correct.long(), -1).sum(-1)  # [B,S] leading correct slots
    hist = (F.one_hot(accepted, K + 1).float() * starts.unsqueeze(-1)).sum((0, 1))  # [K+1]
    n_starts = starts.sum()
    return {
        "top1_sum": correct.float().sum((0, 1)),
        "top1_count": n_valid,
        "kl_sum": (kl.detach() * valid).sum((0, 1)),
        "kl_count": n_valid,
        "prefix_sum": prefix.float().sum((0, 1)),
        "prefix_count": n_valid,
        "accept_len_sum": (accepted * starts).sum(),
        "accept_len_count": n_starts,
        "accept_hist_sum": hist,
        "accept_hist_count": n_starts,
    }


# ---------------------------------------------------------------- combined


def _check_shapes(
    draft_logits: Tensor,
    teacher: TeacherLaw,
    valid: Tensor,
    rank_logits: Tensor | None,
    rank_buckets: tuple[int, ...] | None,
) -> None:
    if draft_logits.dim() != 4 or teacher.probs.shape != draft_logits.shape:
        raise ValueError(
            f"draft logits and teacher law must both be [B,S,K,V], got {tuple(draft_logits.shape)} "
            f"and {tuple(teacher.probs.shape)}"
        )
    if valid.shape != draft_logits.shape[:-1] or valid.dtype != torch.bool:
        raise ValueError(
            f"valid must be bool [B,S,K]={tuple(draft_logits.shape[:-1])}, got "
            f"{valid.dtype} {tuple(valid.shape)}"
        )
    if rank_logits is None:
        return
    if rank_buckets is None:
        raise ValueError("rank logits need the rank classes they predict (rank_buckets)")
    n_classes = len(rank_buckets) + 1
    if rank_logits.shape != (*valid.shape, n_classes):
        raise ValueError(
            f"rank logits must be [B,S,K,{n_classes}] (len(rank_buckets)+1), got {tuple(rank_logits.shape)}"
        )


def specblock_loss(
    draft_logits: Tensor,
    teacher: Tensor | TeacherLaw,
    valid: Tensor,
    rank_logits: Tensor | None,
    cfg: LossConfig,
    step: int,
    epoch: float = 0.0,
    rank_buckets: tuple[int, ...] | None = RANK_BUCKETS,
) -> LossOutput:
    """The SpecBlock training loss (docs/specblock.md 1.5); rank_logits None = EAGLE-3 style (no rank head).

    draft_logits [B,S,K,V]; teacher: logits [B,S,K,V] or TeacherLaw; valid [B,S,K] bool; rank_logits
    [B,S,K,C] or None, C = len(rank_buckets) + 1 (the drafter's rank classes).
    loss = sum_k decay^k L_draft,k + rank_weight * 1[step >= rank_start_step] * L_rank, with L_draft,k
    = (1-alpha) * mean KL of slot k over valid entries + alpha * over its valid-prefix entries.
    Before rank_start_step the rank term is multiplied by 0 rather than dropped, so the rank head
    still gets (zero) gradients (DDP needs every parameter).
    """
    teacher = as_law(teacher)
    _check_shapes(draft_logits, teacher, valid, rank_logits, rank_buckets)
    # Valid-prefix mask and curriculum alpha (no gradient).
    correct = top1_correct(draft_logits, teacher, valid)  # [B,S,K]
    prefix = valid & leading_run(correct)
    alpha = prefix_weight(cfg.curriculum, step, epoch)
    # Distillation: forward KL per slot, (1-alpha) * full + alpha * valid-prefix, weighted by decay^k.
    kl = forward_kl(draft_logits, teacher, valid, cfg.draft_topk)
    terms = distill_terms(kl, valid, prefix, cfg.slot_decay, alpha)
    metrics = draft_metrics(correct, valid, kl, prefix)
    rank = torch.zeros((), device=kl.device)
    if rank_logits is not None:
        classes = rank_classes(rank_of_target(draft_logits, teacher), rank_buckets)
        rank_sums, rank_counts, rank_metrics = rank_terms(rank_logits, classes, valid)
        rank = normalised_loss({RANK: rank_sums.detach()}, {RANK: rank_counts}, cfg.rank_budget)
        gate = cfg.rank_weight * rank_loss_weight(step, cfg.rank_start_step)
        terms.sums[RANK], terms.counts[RANK] = gate * rank_sums, rank_counts
        metrics.update(rank_metrics)
    with torch.no_grad():
        w = slot_weights(kl.shape[-1], cfg.slot_decay, kl.device)
        slot_losses = sum(terms.sums[t] / terms.counts[t].clamp_min(1.0) for t in (FULL, PREFIX)) / w
    loss = normalised_loss(terms.sums, terms.counts, cfg.rank_budget)
    return LossOutput(loss, terms, metrics, slot_losses, rank, alpha)
