"""The small interface between the one training loop (`trainer.fit`) and a drafter algorithm.

A drafter type (SpecBlock, EAGLE-3, ...) implements `DrafterStrategy`; the trainer never asks which
one it runs. Anchors: fairseq2 `TrainUnit.process_batch`, SpecForge `DraftTrainStrategy`.

Loss normalisation (what makes micro-batch 4 x accumulation 1 equal to 2 x 2, and 2 ranks equal to 1):
`forward_loss` returns the SUM of its loss terms over the micro-batch, never a mean, and
`num_loss_items(batch)` says how many terms that sum has (e.g. supervised tokens x unrolled
positions). Before the first micro-batch of an optimizer step the trainer adds `num_loss_items`
over all micro-batches of the step and all ranks (N), and back-propagates `loss_sum / N`: the
gradient is that of the mean over every loss term of the effective batch, whatever the split.
Weighted terms (e.g. a per-position decay) are fine as long as the same weights appear in the sum
for every split. A strategy that returns a per-micro-batch mean instead gets a mean of means,
which differs whenever micro-batches hold different numbers of terms.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

SUM_SUFFIX = "/sum"
COUNT_SUFFIX = "/count"
SCALAR_PREFIX = "scalar/"


@dataclass
class StepOutput:
    """What `forward_loss` returns for one micro-batch.

    loss: () the SUM of the loss terms of the micro-batch (see module docstring), with grad.
    metrics: () tensors, detached. Ratios come as two keys, `"<name>/sum"` and `"<name>/count"`
        (e.g. `"acc_slot0/sum"`, `"acc_slot0/count"`); the trainer adds both over micro-batches,
        steps and ranks before it divides, and logs `<name>` (habit 13: ratios of global sums).
        Plain values go under `"scalar/<name>"` and are logged as their mean over ranks at the
        last micro-batch of the logging window. Every call must return the same keys, on every
        rank, because the trainer reduces them in one collective.
    """

    loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


@runtime_checkable
class DrafterStrategy(Protocol):
    """One drafter algorithm, as the trainer sees it.

    `module` is the trainable drafter: the only module the optimizer sees. `teacher` is the frozen
    target (or None): the trainer prepares it for inference only (`eval()`, no gradients, never in
    the optimizer; see `trainer.prepare_teacher`). Before the loop the trainer REPLACES both
    attributes with their prepared wrappers (DDP / DeepSpeed engine), so `forward_loss` must call
    `self.module(...)` and `self.teacher(...)` and must not unwrap them; after `fit` returns,
    `module` is the unwrapped drafter again. Frozen pieces the drafter shares with the target
    (e.g. the lm_head) belong inside `module` with `requires_grad=False`.

    `state_dict`/`load_state_dict` hold only extra, non-parameter state (e.g. a curriculum
    counter); return `{}` when there is none. They are saved in every checkpoint.
    """

    module: nn.Module
    teacher: nn.Module | None

    def num_loss_items(self, batch: dict[str, Any]) -> int | Tensor:
        """How many terms `forward_loss(batch).loss` sums (cheap: from masks, no forward)."""
        ...

    def num_tokens(self, batch: dict[str, Any]) -> int | Tensor:
        """Sequence tokens the micro-batch holds, for tokens/s and the tokens-seen counter."""
        ...

    def forward_loss(self, batch: dict[str, Any], step: int, epoch: int) -> StepOutput:
        """Loss SUM and metrics of one micro-batch; `step` counts optimizer steps already taken."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
