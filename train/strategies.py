"""Drafter strategies: how one micro-batch becomes a loss, per drafter type (trainer.fit has no branches).

Both strategies distill the frozen target into the drafter with `losses.specblock_loss`. The target's
features and logits come either online (a forward of the frozen target inside the step) or offline
(cached features + final hidden state; logits recomputed through a frozen copy of the LM head).

SpecBlock adds the multi-block training-time test (docs/specblock.md 1.5): from `rank_start_step` on, after
each block a source slot m ~ U{0..K-1} is drawn and the next block starts from slot m's hidden state,
with tokens and targets shifted by the cumulative offset. The draw is seeded by (seed, step), so a
resumed run draws the same slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .batching import shifted_tokens, teacher_and_valid
from .losses import LossConfig, at_least_fp32, specblock_loss
from .modeling import DrafterOutput, block_offsets
from .strategy import COUNT_SUFFIX, SCALAR_PREFIX, SUM_SUFFIX, StepOutput


@dataclass
class StrategyConfig:
    num_ttt_blocks: int = 3  # SpecBlock blocks per step once multi-block training is on (1 = off)
    seed: int = 0


def flat_metrics(metrics: dict[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """losses' `<name>_sum`/`<name>_count` (scalars or [K]) -> the trainer's scalar
    `<name>[_k]/sum|count` keys."""
    out = {}
    for key, value in metrics.items():
        for suffix, trainer_suffix in (("_sum", SUM_SUFFIX), ("_count", COUNT_SUFFIX)):
            if key.endswith(suffix):
                name = prefix + key[: -len(suffix)]
                if value.dim() == 0:
                    out[name + trainer_suffix] = value.double()
                else:
                    for k, v in enumerate(value.reshape(-1)):
                        out[f"{name}_{k}{trainer_suffix}"] = v.double()
    return out


class DistillStrategy:
    """Distillation of the target into `module`; subclasses say how many blocks a step drafts.

    teacher: the frozen target (online features) or None (offline: batches carry `features` and
    `last_hidden`, and `head_weight` [V, H] is the target's LM head)."""

    def __init__(
        self,
        module: nn.Module,
        teacher: nn.Module | None,
        feature_layers: list[int],
        loss: LossConfig,
        cfg: StrategyConfig,
        head_weight: Tensor | None = None,
    ):
        if teacher is None and head_weight is None:
            raise ValueError("offline features need the target's LM head weight (head_weight)")
        self.module, self.teacher, self.feature_layers = module, teacher, list(feature_layers)
        self.loss_cfg, self.cfg, self.head_weight = loss, cfg, head_weight
        self.slots = module.block_size
        self.d2t, self.t2d = module.d2t, module.t2d

    # ---------------------------------------------------------------- trainer interface
    def num_loss_items(self, batch: dict[str, Any]) -> int:
        """Supervised positions (assistant tokens the first slot predicts): the loss is a mean over
        them times their count, so accumulation weighs micro-batches by their supervised positions."""
        mask = batch["loss_mask"][:, 2:].bool() & batch["attention_mask"][:, 2:].bool()
        return int(mask.sum())

    def num_tokens(self, batch: dict[str, Any]) -> int:
        return int(batch["attention_mask"].sum())

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def forward_loss(self, batch: dict[str, Any], step: int, epoch: int) -> StepOutput:
        features, logits = self.target_outputs(batch)
        tokens, attention = shifted_tokens(batch["input_ids"]), batch["attention_mask"][:, 1:]
        outputs, offsets = self.draft(features[:, :-1], tokens, attention, step)
        law, valid = teacher_and_valid(batch, logits, self.d2t, self.t2d, self.slots + max(offsets))
        total, metrics = 0.0, {}
        for b, (out, off) in enumerate(zip(outputs, offsets)):
            res = specblock_loss(
                out.logits,
                law.slot_grid(1 + off, tokens.shape[1], self.slots),
                valid[:, :, off : off + self.slots],
                out.rank_logits,
                self.loss_cfg,
                step,
                epoch,
            )
            total = total + res.loss
            metrics.update(flat_metrics(res.metrics, prefix="" if b == 0 else f"block{b}/"))
            metrics[f"{SCALAR_PREFIX}loss_block{b}"] = res.loss.detach()
            if b == 0:
                metrics[f"{SCALAR_PREFIX}prefix_alpha"] = torch.tensor(res.prefix_alpha)
                metrics[f"{SCALAR_PREFIX}rank_loss"] = res.rank_loss
        items = self.num_loss_items(batch)
        return StepOutput(total * items, metrics)

    # ---------------------------------------------------------------- pieces
    @torch.no_grad()
    def target_outputs(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """features [B, T, F*H] and logits [B, T, V] (at least float32) of the frozen target."""
        dtype = next(self.module.parameters()).dtype  # a bf16 target or cache may feed an fp32 drafter
        if "features" in batch:  # offline: logits recomputed through the frozen LM head
            # in the head's own dtype, as the online target computes them (bf16 matmuls are also ~4x faster)
            head = self.head_weight.to(batch["last_hidden"].device)
            return batch["features"].to(dtype), at_least_fp32(batch["last_hidden"].to(head.dtype) @ head.T)
        out = self.teacher(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            output_hidden_states=True,
            use_cache=False,
        )
        features = torch.cat([out.hidden_states[i] for i in self.feature_layers], dim=-1)
        return features.to(dtype), at_least_fp32(out.logits)

    def draft(
        self, features: Tensor, tokens: Tensor, attention: Tensor, step: int
    ) -> tuple[list[DrafterOutput], list[int]]:
        """Drafter outputs and the token offset of each block."""
        return [self.module(features, tokens, attention_mask=attention)], [0]


class SpecBlockStrategy(DistillStrategy):
    def source_slots(self, step: int) -> list[int]:
        """Multi-block TTT: K-1 slot draws per later block, from `rank_start_step` on, seeded by step."""
        if self.cfg.num_ttt_blocks <= 1 or step < self.loss_cfg.rank_start_step:
            return []
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
        return torch.randint(0, self.slots, (self.cfg.num_ttt_blocks - 1,), generator=g).tolist()

    def draft(self, features, tokens, attention, step):
        slots = self.source_slots(step)
        if not slots:
            return super().draft(features, tokens, attention, step)
        outputs = self.module(features, tokens, attention_mask=attention, source_slots=slots)
        return outputs, block_offsets(slots)[: len(outputs)]


class Eagle3Strategy(DistillStrategy):
    """EAGLE-3: the training-time test unroll lives in the module; one output with K = ttt_length steps."""


STRATEGIES = {"specblock": SpecBlockStrategy, "eagle3": Eagle3Strategy}
