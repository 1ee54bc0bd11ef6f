"""What one logging window of the trainer accumulates, reduced over ranks as ratios of global sums."""

from __future__ import annotations

import math
import resource
import time

import torch
from accelerate import Accelerator

from .ratios import Sums, ratios
from .strategy import COUNT_SUFFIX, SCALAR_PREFIX, SUM_SUFFIX, StepOutput

KIB_PER_GIB = 1024**2  # ru_maxrss is in KiB on Linux
BYTES_PER_GIB = 1024**3
# Names the trainer logs itself (as train/<name>); strategy metrics may not reuse them.
TOKENS = "tokens"  # the step's sequence tokens, reduced with the loss counts (a name no count uses)
# The window's step losses, added (every rank adds its micro-batches' shares of each step's loss).
LOSS_SUM = "loss" + SUM_SUFFIX
RESERVED_METRICS = {"loss", "lr", "grad_norm", "epoch", "tokens_per_s", "tokens_seen", "peak_mem_gib"}


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak, or max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / BYTES_PER_GIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / KIB_PER_GIB


class MetricWindow:
    """What one logging window accumulates.

    `sums` and `scalars` are per rank and get reduced over ranks before dividing (sum / mean);
    `tokens` and `grad_norm_sum` are already global (every rank holds the same value).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device  # sums stay on the device: no host sync per micro-batch
        self.sums = Sums(device)
        self.scalars: dict[str, torch.Tensor] = {}
        self.steps, self.tokens, self.grad_norm_sum, self.lr = 0, 0.0, 0.0, math.nan
        self.start = time.perf_counter()

    def add(self, name: str, value: torch.Tensor | float) -> None:
        self.sums.add(name, value)

    def add_output(self, out: StepOutput, loss: torch.Tensor | None = None) -> None:
        """A micro-batch's metrics and its share of the step's loss (None: validation, see there)."""
        clash = {k.removeprefix(SCALAR_PREFIX).rsplit("/", 1)[0] for k in out.metrics} & RESERVED_METRICS
        if clash:
            raise ValueError(f"strategy metrics use names the trainer logs itself: {sorted(clash)}")
        if loss is not None:
            self.add(LOSS_SUM, loss)
        for name, value in out.metrics.items():
            if name.startswith(SCALAR_PREFIX):
                self.scalars[name[len(SCALAR_PREFIX) :]] = value.detach()
            else:
                self.add(name, value)

    def add_step(self, tokens: float, grad_norm: float, lr: float) -> None:
        """Once per optimizer step; `lr` is the one this step used."""
        self.steps, self.tokens, self.lr = self.steps + 1, self.tokens + tokens, lr
        self.grad_norm_sum += grad_norm

    def reduce(self, accelerator: Accelerator) -> dict[str, float]:
        """`<name>` = global sum of `<name>/sum` / global sum of `<name>/count`; scalars: mean over ranks;
        `loss`: the mean over the window's optimizer steps of each step's (effective batch's) loss.
        Collective."""
        totals = self.sums.reduce(accelerator)
        out = ratios(totals, SUM_SUFFIX, COUNT_SUFFIX)
        paired = {name + suffix for name in out for suffix in (SUM_SUFFIX, COUNT_SUFFIX)}
        out.update({k: float(v) for k, v in totals.items() if k not in paired and k != LOSS_SUM})
        if LOSS_SUM in totals:
            out["loss"] = float(totals[LOSS_SUM]) / max(self.steps, 1)
        scalars = Sums(self.device).update(self.scalars).reduce(accelerator, "mean")
        out.update({k: float(v) for k, v in scalars.items()})
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        grad_norm = self.grad_norm_sum / max(self.steps, 1)
        out.update(tokens_per_s=self.tokens / elapsed, grad_norm=grad_norm, lr=self.lr)
        return out
