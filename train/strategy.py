"""The small interface between the one training loop (`trainer.fit`) and a drafter algorithm.

A drafter type (SpecBlock, EAGLE-3, ...) implements `DrafterStrategy`; the trainer never asks which
one it runs. Anchors: fairseq2 `TrainUnit.process_batch`, SpecForge `DraftTrainStrategy`.

Loss normalisation (what makes micro-batch 4 x accumulation 1 equal to 2 x 2, and 2 ranks equal to 1):
the loss of an optimizer step is the loss of its EFFECTIVE batch (every micro-batch of every rank taken
as one batch), not a mean of per-micro-batch losses. A strategy's loss is a sum of terms of the form
"numerator / count" (e.g. the mean KL of slot k = sum of its KL / its number of entries), so
`forward_loss` returns the numerators (`StepOutput.sums`, with grad) and the counts (`StepOutput.counts`)
of one micro-batch, and `loss(sums, counts)` divides. The trainer adds the counts over every
micro-batch of the step and every rank and back-propagates `loss(sums_i, global counts)` for each
micro-batch i. Because `loss` is linear in `sums`, these add up to the effective batch's loss, whatever
the split. With one micro-batch and one rank this is `loss(sums, counts)` of the batch itself: the loss
value does not depend on the accumulation machinery.

Counts may depend on the forward (SpecBlock's valid-prefix entries depend on which slots the drafter
gets right), so they are known only after it. The trainer therefore asks for the counts of the step's
later micro-batches first (`loss_counts`, without gradients: for the real drafters one extra forward
per extra micro-batch), then runs the first micro-batch, adds its counts, all-reduces once and
back-propagates every micro-batch with the global counts; gradient accumulation keeps its memory
footprint (nothing is held across micro-batches) at that price. With `grad_accum` 1 there is no extra
forward: the counts all-reduce between the forward and the backward.
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

    sums: name -> tensor (any shape, with grad): the loss's numerators over this micro-batch.
    counts: name -> tensor (detached): what `loss` divides them by, over this micro-batch; they must
        be sums over entries, so that adding them over micro-batches and ranks gives the effective
        batch's. Keys and shapes are the same for every micro-batch and rank of a step (the trainer
        reduces them in one collective).
    metrics: () tensors, detached. Ratios come as two keys, `"<name>/sum"` and `"<name>/count"`
        (e.g. `"acc_slot0/sum"`, `"acc_slot0/count"`); the trainer adds both over micro-batches,
        steps and ranks before it divides, and logs `<name>` (habit 13: ratios of global sums).
        Plain values go under `"scalar/<name>"` and are logged as their mean over ranks at the
        last micro-batch of the logging window. Every call must return the same keys, on every
        rank, because the trainer reduces them in one collective.
    """

    sums: dict[str, Tensor]
    counts: dict[str, Tensor]
    metrics: dict[str, Tensor] = field(default_factory=dict)


@runtime_checkable
class DrafterStrategy(Protocol):
    """One drafter algorithm, as the trainer sees it.

    `module` is the trainable drafter: the only module the optimizer sees. `teacher` is the frozen
    target (or None): the trainer prepares it for inference only (`eval()`, no gradients, never in
    the optimizer; see `accel.prepare_teacher`). Before the loop the trainer REPLACES both
    attributes with their prepared wrappers (DDP / DeepSpeed engine), so `forward_loss` must call
    `self.module(...)` and `self.teacher(...)` and must not unwrap them; after `fit` returns,
    `module` is the unwrapped drafter again. Frozen pieces the drafter shares with the target
    (e.g. the lm_head) belong inside `module` with `requires_grad=False`.

    `state_dict`/`load_state_dict` hold only extra, non-parameter state (e.g. a curriculum
    counter); return `{}` when there is none. They are saved in every checkpoint.
    """

    module: nn.Module
    teacher: nn.Module | None

    def loss_counts(self, batch: dict[str, Any], step: int, epoch: int) -> dict[str, Tensor]:
        """`forward_loss(batch, step, epoch).counts`, as cheaply as the strategy can (the trainer calls it
        without gradients for the later micro-batches of a step). It may run the forward; it must not
        change the strategy's state."""
        ...

    def loss(self, sums: dict[str, Tensor], counts: dict[str, Tensor]) -> Tensor:
        """() the loss from one micro-batch's `sums` and the `counts` of the batch it is normalised
        over (its own, or summed over every micro-batch and rank of the step). Linear in `sums`."""
        ...

    def num_tokens(self, batch: dict[str, Any]) -> int | Tensor:
        """Sequence tokens the micro-batch holds, for tokens/s and the tokens-seen counter."""
        ...

    def forward_loss(self, batch: dict[str, Any], step: int, epoch: int) -> StepOutput:
        """Loss numerators, counts and metrics of one micro-batch; `step` counts optimizer steps already
        taken."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
