"""Validation during training and the best checkpoint.

Every `eval_every` optimizer steps (and after the last one) the trainer runs the strategy's own
`forward_loss` on a held-out split, without gradients, in micro-batches of rows of similar length (the
split ordered by length once: a third less time than in split order on the cpu_full split, where padding to
the longest of four random rows made every batch ~1.5x its tokens), and reduces its metric sums over every
batch and rank before dividing (the same ratios of global sums as training: per-slot top-1, simulated acceptance
length, Rank Head accuracy, KL). `val/loss` is the loss of the whole split taken as one batch: the
strategy's `loss` of the loss sums and counts added over every batch and rank. The logged names are
`val/<metric>`.

The best step by `best_metric` is saved as a checkpoint whatever `save_every` says, survives `keep_last`
pruning, and is named in `<output_dir>/best.json`; the run exports it (as speculators keeps its
best-validation checkpoint). `BestStep` is registered for checkpointing, so a resumed run compares
against the best it had seen before it was stopped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device

from specblock.data.io import write_json_atomic

from .ratios import Sums
from .strategy import DrafterStrategy
from .tracking import headline, log0

BEST_FILE = "best.json"
# What the trainer's reduced window holds besides the strategy's metrics: not validation results.
_TRAINING_ONLY = ("tokens_per_s", "grad_norm", "lr")


@dataclass
class BestStep:
    """The best validation result so far (step -1: none yet); saved with every checkpoint."""

    step: int = -1
    value: float = math.nan

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.value = int(state["step"]), float(state["value"])

    def improves(self, value: float, mode: str) -> bool:
        """True if `value` beats the best so far (`mode` "max" or "min"); NaN never does."""
        if math.isnan(value):
            return False
        if self.step < 0:
            return True
        return value > self.value if mode == "max" else value < self.value


def split_indices(n: int, fraction: float, max_rows: int | None, seed: int) -> tuple[list[int], list[int]]:
    """A seeded held-out split of range(n): (train, validation) index lists, validation =
    round(fraction * n) rows (at most max_rows), chosen by one permutation, both sorted."""
    n_val = min(round(fraction * n), max_rows if max_rows is not None else n)
    if fraction > 0 and n_val == 0:
        n_val = 1
    if n_val >= n:
        raise ValueError(f"a validation split of {n_val} rows leaves no training rows out of {n}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(perm[n_val:]), sorted(perm[:n_val])


@torch.no_grad()
def evaluate(
    accelerator: Accelerator,
    strategy: DrafterStrategy,
    dataset: Sequence[Any],
    collate_fn: Callable,
    micro_batch_size: int,
    step: int,
    window_factory: Callable[[], Any],
    order: Sequence[int] | None = None,
) -> dict[str, float]:
    """Metrics of `strategy` on `dataset` (every row once, in `order`, default the dataset's; rank r takes
    micro-batches r, r + world, ...), reduced as ratios of global sums. `window_factory` makes the
    trainer's MetricWindow. Collective: every rank must call it."""
    order = list(order) if order is not None else list(range(len(dataset)))
    if sorted(order) != list(range(len(dataset))):
        raise ValueError(f"order must list each of the {len(dataset)} rows once")
    strategy.module.eval()
    window = window_factory()
    sums, counts = Sums(accelerator.device), Sums(accelerator.device)
    starts = range(0, len(order), micro_batch_size)
    mine = [s for i, s in enumerate(starts) if i % accelerator.num_processes == accelerator.process_index]
    for start in mine:
        rows = [dataset[i] for i in order[start : start + micro_batch_size]]
        batch = send_to_device(collate_fn(rows), accelerator.device)
        with accelerator.autocast():
            out = strategy.forward_loss(batch, step, 0)
        window.add_output(out)
        sums.update(out.sums)
        counts.update(out.counts)
    stats = window.reduce(accelerator)
    # the loss of the whole split taken as one batch
    sums, counts = sums.reduce(accelerator), counts.reduce(accelerator)
    stats["loss"] = float(strategy.loss(sums, counts)) if sums else math.nan
    strategy.module.train()
    return {f"val/{k}": v for k, v in stats.items() if k not in _TRAINING_ONLY}


@dataclass
class Validator:
    """The held-out split, how to batch it, and the best result so far (`best` is checkpointed)."""

    dataset: Sequence[Any]
    collate_fn: Callable
    micro_batch_size: int
    best_metric: str
    best_mode: str
    window_factory: Callable[[], Any]
    best: BestStep = field(default_factory=BestStep)
    last: dict[str, float] = field(default_factory=dict)
    order: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.order = length_order(self.dataset)

    def run(self, accelerator: Accelerator, strategy: DrafterStrategy, tracker, step: int) -> bool:
        """Evaluate, log (tracker + console) and say whether this step is the new best. Collective."""
        self.last = evaluate(
            accelerator,
            strategy,
            self.dataset,
            self.collate_fn,
            self.micro_batch_size,
            step,
            self.window_factory,
            self.order,
        )
        tracker.log(self.last, step=step)
        key = f"val/{self.best_metric}"
        if key not in self.last:
            raise KeyError(
                f"best_metric={self.best_metric!r} is not a validation metric: {sorted(self.last)}"
            )
        improved = self.best.improves(self.last[key], self.best_mode)
        if improved:
            self.best.step, self.best.value = step, self.last[key]
        log0(
            f"step {step} validation: {headline(self.last, 'val/')}"
            + (" (best)" if improved else f" (best {self.best.value:.4f} at step {self.best.step})")
        )
        return improved


def length_order(dataset: Sequence[Any]) -> list[int]:
    """The rows' indices by their number of tokens (`input_ids`; rows without them count as equal), ties in
    dataset order: micro-batches of consecutive rows in this order pad little."""
    lengths = [len(dataset[i].get("input_ids", ())) for i in range(len(dataset))]
    return sorted(range(len(dataset)), key=lambda i: lengths[i])


def write_best(output_dir: str | Path, best: BestStep, metric: str, step_folder: Path) -> None:
    """`<output_dir>/best.json`: which step folder holds the best validation result (atomic)."""
    record = {"step": best.step, "metric": f"val/{metric}", "value": best.value, "folder": step_folder.name}
    write_json_atomic(Path(output_dir) / BEST_FILE, record)


def read_best(output_dir: str | Path) -> dict[str, Any] | None:
    """The record `write_best` left, or None when the run had no validation."""
    path = Path(output_dir) / BEST_FILE
    return json.loads(path.read_text()) if path.is_file() else None
