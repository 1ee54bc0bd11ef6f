"""Answers cut where they start to repeat: a small target's greedy answers often fall into loops.

SmolLM2-135M's greedy answers of up to 384 tokens (the regenerated ShareGPT sets) repeat themselves: in the
6k set 47 % of the answer tokens come after the answer's first repeated 32-token span, and prompt lookup
would guess 89 % of the tokens past position 192 (README, section "The `cpu_full` recipe"). A drafter
trained on them spends its steps on text that lookup drafts for free, and its validation is inflated by it.
`cut_at_repeat` finds where a row's answer first repeats an n-token span it already contains; training
(`TrainConfig.cut_repeats`) keeps the row up to there.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch


def check_cut_repeats(n: int, setting: str) -> None:
    """Refuses a cut_repeats setting (named `setting` in the error) other than 0 (off) or a span length."""
    if n < 0:
        raise ValueError(f"{setting} must be 0 (off) or a span length >= 1, got {n}")


def cut_at_repeat(input_ids: Sequence[int], loss_mask: Sequence[int], n: int) -> int:
    """The length to keep: the row up to (not including) the first answer token that completes an n-token
    span seen before inside the answer (spans start at the first answer token, loss_mask 1); the whole row
    when no span repeats or the row has no answer. n >= 1."""
    if n < 1:
        raise ValueError(f"cut_repeats needs a span length n >= 1, got {n}")
    ids, mask = list(input_ids), list(loss_mask)
    if not any(mask):
        return len(ids)
    start, seen = mask.index(1), set()
    for end in range(start + n, len(ids) + 1):
        span = tuple(ids[end - n : end])
        if span in seen:
            return end - 1
        seen.add(span)
    return len(ids)


def cut_row(row: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The row with every per-token field (input_ids, loss_mask, features, last_hidden, target_argmax: first
    dimension T) cut to `cut_at_repeat` tokens: views, no copies. Other fields are kept as they are."""
    ids, mask = row["input_ids"], row["loss_mask"]
    as_list = lambda x: x.tolist() if isinstance(x, torch.Tensor) else list(x)  # noqa: E731
    keep, length = cut_at_repeat(as_list(ids), as_list(mask), n), len(ids)
    if keep == length:
        return dict(row)
    return {k: (v[:keep] if hasattr(v, "__len__") and len(v) == length else v) for k, v in row.items()}


class CutRepeats(torch.utils.data.Dataset):
    """A row dataset whose rows are cut where their answers start to repeat (`cut_row`), lazily."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], n: int):
        self.rows, self.n = rows, n

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return cut_row(self.rows[i], self.n)
