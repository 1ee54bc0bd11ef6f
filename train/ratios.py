"""Ratios of global sums (STYLE habit 13), for training, validation and evaluation alike.

A metric such as top-1 accuracy or acceptance length is one ratio of two sums taken over everything
measured: micro-batches, batches, steps and ranks add their sums first, and the division happens once,
when the number is read. Never a mean of per-batch ratios, which weighs a short batch like a long one.

`Sums` holds named sums as float64 tensors of any shape on one device (training: no host sync per
micro-batch) and adds them over ranks in one collective; `ratio` divides two totals (None where
nothing was counted); `add_padded` adds per-position counts of unequal lengths (evaluation's
per-draft-position acceptance). `evaluate.metrics.Counts` is the typed form of the same idea for
decoding: plain numbers, gathered from ranks as dicts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor


def ratio(num: float, den: float) -> float | None:
    """num / den, or None where the denominator is 0 (undefined, not zero; JSON writes it as null)."""
    return num / den if den else None


def add_padded(a: Sequence[float], b: Sequence[float]) -> list:
    """Element-wise sum, the shorter sequence padded with zeros."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


class Sums:
    """Named sums: float64 tensors of any shape, on `device`. Add, `reduce` over ranks, then divide."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.values: dict[str, Tensor] = {}

    def add(self, name: str, value: Tensor | float) -> None:
        value = torch.as_tensor(
            value.detach() if isinstance(value, Tensor) else value, dtype=torch.float64, device=self.device
        )
        self.values[name] = self.values[name] + value if name in self.values else value

    def update(self, values: Mapping[str, Tensor | float]) -> Sums:
        for name, value in values.items():
            self.add(name, value)
        return self

    def reduce(self, accelerator: Any, op: str = "sum") -> dict[str, Tensor]:
        """The sums added (op "sum") or averaged ("mean") over every rank: one collective of the
        flattened values in name order. Collective: every rank must hold the same names and shapes."""
        if not self.values:
            return {}
        names = sorted(self.values)
        flat = torch.cat([self.values[n].reshape(-1) for n in names])
        total = accelerator.reduce(flat, op) if accelerator is not None else flat
        parts = total.split([self.values[n].numel() for n in names])
        return {n: p.view_as(self.values[n]) for n, p in zip(names, parts)}


def ratios(totals: Mapping[str, Tensor], num_suffix: str, den_suffix: str) -> dict[str, float]:
    """Every `<name><num_suffix>` / `<name><den_suffix>` pair of scalar totals -> {name: ratio}; NaN where
    nothing was counted (loggers take floats). Entries of other names are left out."""
    out = {}
    for key, num in totals.items():
        if key.endswith(num_suffix):
            name = key[: -len(num_suffix)]
            if name + den_suffix in totals:
                value = ratio(float(num), float(totals[name + den_suffix]))
                out[name] = value if value is not None else float("nan")
    return out
