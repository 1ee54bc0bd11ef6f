"""The distillation strategies (`strategy.DrafterStrategy`): how one micro-batch becomes loss terms, per
drafter type (trainer.fit has no branches; each drafter's spec in drafters.py names its strategy).

`DistillStrategy` trains any drafter whose forward returns K slots per position (EAGLE-3 and drafters
without extra training machinery use it as is); `SpecBlockStrategy` adds SpecBlock's multi-block
training-time test and its Rank Head's classes. Both distill the frozen target into the drafter with `losses.specblock_loss`, whose terms
(per-slot KL and Rank Head sums with their entry counts) they return for the trainer to normalise over
the whole step (`strategy.py`: the accumulation contract). The target's
features and logits come either online (a forward of the frozen target inside the step) or offline
(cached features + final hidden state; logits recomputed through a frozen copy of the LM head, with
`data.target.TargetHead`, the same function that evaluation and the feature cache use).

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

from specblock.data.target import TargetHead, concat_features

from .batching import shifted_tokens, teacher_and_valid
from .losses import LossConfig, normalised_loss, specblock_loss
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
    `last_hidden`, and `head` is the target's LM head, e.g. `TargetHead.of(target, copy=True)`).
    rank_buckets: the rank classes a drafter with a Rank Head predicts (None: it has none)."""

    rank_buckets: tuple[int, ...] | None = None

    def __init__(
        self,
        module: nn.Module,
        teacher: nn.Module | None,
        feature_layers: list[int],
        loss: LossConfig,
        cfg: StrategyConfig,
        head: TargetHead | None = None,
    ):
        if teacher is None and head is None:
            raise ValueError("offline features need the target's LM head (head)")
        self.module, self.teacher, self.feature_layers = module, teacher, list(feature_layers)
        self.loss_cfg, self.cfg, self.head = loss, cfg, head
        self.slots = module.block_size
        self.d2t, self.t2d = module.d2t, module.t2d
        self._draft_head: TargetHead | None = None  # the head cut to the draft vocabulary (teacher_inputs)

    # ---------------------------------------------------------------- trainer interface
    def loss_counts(self, batch: dict[str, Any], step: int, epoch: int) -> dict[str, Tensor]:
        """The counts need the forward: the valid-prefix and Rank Head entries depend on the drafter's
        top-1 and rank predictions (and `valid` on the target's argmax)."""
        with torch.no_grad():
            return self.forward_loss(batch, step, epoch).counts

    def loss(self, sums: dict[str, Tensor], counts: dict[str, Tensor]) -> Tensor:
        """Every block's per-slot means (and Rank Head loss) over the entries `counts` holds, added."""
        return normalised_loss(sums, counts, self.loss_cfg.rank_budget)

    def num_tokens(self, batch: dict[str, Any]) -> int:
        return int(batch["attention_mask"].sum())

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def forward_loss(self, batch: dict[str, Any], step: int, epoch: int) -> StepOutput:
        features, logits, top = self.teacher_inputs(batch)
        tokens, attention = shifted_tokens(batch["input_ids"]), batch["attention_mask"][:, 1:]
        outputs, offsets = self.draft(features[:, :-1], tokens, attention, step)
        slots, temperature = self.slots + max(offsets), self.loss_cfg.teacher_temperature
        law, valid = teacher_and_valid(batch, logits, self.d2t, self.t2d, slots, top, temperature)
        sums, counts, metrics = {}, {}, {}
        for b, (out, off) in enumerate(zip(outputs, offsets)):
            res = specblock_loss(
                out.logits,
                law.slot_grid(1 + off, tokens.shape[1], self.slots),
                valid[:, :, off : off + self.slots],
                out.rank_logits,
                self.loss_cfg,
                step,
                epoch,
                rank_buckets=self.rank_buckets,
            )
            sums.update({f"block{b}/{k}": v for k, v in res.terms.sums.items()})
            counts.update({f"block{b}/{k}": v for k, v in res.terms.counts.items()})
            metrics.update(flat_metrics(res.metrics, prefix="" if b == 0 else f"block{b}/"))
            metrics[f"{SCALAR_PREFIX}loss_block{b}"] = res.loss.detach()
            if b == 0:
                metrics[f"{SCALAR_PREFIX}prefix_alpha"] = torch.tensor(res.prefix_alpha)
                metrics[f"{SCALAR_PREFIX}rank_loss"] = res.rank_loss
        return StepOutput(sums, counts, metrics)

    # ---------------------------------------------------------------- pieces
    @torch.no_grad()
    def teacher_inputs(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor | None]:
        """features, the teacher's logits and the target's full-vocabulary argmax, as `teacher_and_valid`
        reads them. An offline batch that carries the cache's argmax (`target_argmax`, data/target_argmax.py)
        needs only the draft vocabulary's columns [B, T, Vd], through the head cut to them (8k of SmolLM2's
        49k products); otherwise `target_outputs`' full logits and None."""
        if "features" not in batch or "target_argmax" not in batch:
            return *self.target_outputs(batch), None
        device = batch["last_hidden"].device
        if self._draft_head is None or self._draft_head.weight.device != device:
            head, idx = self.head.to(device), self.d2t.to(device)
            bias = head.bias[idx] if head.bias is not None else None
            self._draft_head = TargetHead(head.weight[idx].contiguous(), bias, head.softcap)
        dtype = next(self.module.parameters()).dtype
        logits = self._draft_head(batch["last_hidden"], upcast=False)
        return batch["features"].to(dtype), logits, batch["target_argmax"]

    @torch.no_grad()
    def target_outputs(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """features [B, T, F*H] and logits [B, T, V] of the frozen target, in its own dtype: the teacher reads
        the draft vocabulary's columns upcast to float32 and the argmax (`teacher_and_valid`), and an upcast is
        exact, so the same bits as upcasting all 49k columns first, which cost ~0.24 s of a cpu_full step."""
        dtype = next(self.module.parameters()).dtype  # a bf16 target or cache may feed an fp32 drafter
        if "features" in batch:  # offline: logits recomputed through the frozen LM head
            # in the head's own dtype, as the online target computes them (bf16 matmuls are also ~4x faster)
            if self.head.weight.device != batch["last_hidden"].device:
                self.head = self.head.to(batch["last_hidden"].device)  # once, not every step
            return batch["features"].to(dtype), self.head(batch["last_hidden"], upcast=False)
        out = self.teacher(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            output_hidden_states=True,
            use_cache=False,
        )  # the model's own logits: its head, soft-capped where the model does so
        return concat_features(out.hidden_states, self.feature_layers).to(dtype), out.logits

    def draft(
        self, features: Tensor, tokens: Tensor, attention: Tensor, step: int
    ) -> tuple[list[DrafterOutput], list[int]]:
        """Drafter outputs and the token offset of each block."""
        return [self.module(features, tokens, attention_mask=attention)], [0]


class SpecBlockStrategy(DistillStrategy):
    def __init__(self, module: nn.Module, *args, **kwargs):
        super().__init__(module, *args, **kwargs)
        self.rank_buckets = tuple(module.cfg.rank_buckets)  # the drafter's classes: set in one place

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
