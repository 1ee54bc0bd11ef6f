"""Batches and teacher alignment: the one place where the EAGLE-3 data convention is written down.

A batch holds input_ids, attention_mask and loss_mask [B, T] (right padding). The target gives
logits [B, T, V] (logits[:, t] predicts token t+1) and features [B, T, F*H]. The drafter's context
position t reads the target's features at t and the token input_ids[:, t+1] (at inference: the token the
target just emitted), and its slot k predicts token t+2+k, whose teacher law is the target's softmax
at t+1+k restricted to the draft vocabulary. Positions run over t = 0..T-2 (S = T-1).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch


def collate(rows: Sequence[Mapping[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pads rows of input_ids/loss_mask [T_i] into input_ids, attention_mask, loss_mask [B, T];
    cached target tensors (offline features: `features` [T_i, F*H], `last_hidden` [T_i, H]) are
    zero-padded the same way."""
    length = max(len(r["input_ids"]) for r in rows)
    batch = {
        "input_ids": torch.full((len(rows), length), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros(len(rows), length, dtype=torch.long),
        "loss_mask": torch.zeros(len(rows), length, dtype=torch.long),
    }
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        batch["input_ids"][i, :n] = torch.as_tensor(r["input_ids"])
        batch["attention_mask"][i, :n] = 1
        batch["loss_mask"][i, :n] = torch.as_tensor(r["loss_mask"])
    for key in ("features", "last_hidden"):
        if key in rows[0]:
            dim, dtype = rows[0][key].shape[-1], rows[0][key].dtype
            batch[key] = torch.zeros(len(rows), length, dim, dtype=dtype)
            for i, r in enumerate(rows):
                batch[key][i, : len(r[key])] = r[key]
    return batch


def shifted_tokens(input_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, S]: the token read at context position t is input_ids[:, t+1]."""
    return input_ids[:, 1:]


def teacher_and_valid(
    batch: Mapping[str, torch.Tensor],
    target_logits: torch.Tensor,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    slots: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher logits [B, S, K, Vd] and validity [B, S, K] for K slots.

    teacher[:, t, k] = target_logits[:, t+1+k, d2t] (-inf rows where t+1+k is past the end, never valid).
    valid[:, t, k]: the predicted token t+2+k exists, is a real token, is an assistant token (loss_mask),
    and the target's own next token (its argmax over the FULL vocabulary) lies in the draft vocabulary:
    a slot whose target token the drafter cannot even emit cannot be accepted at temperature 0, and
    training it against the renormalised rest would teach a wrong argmax (EAGLE-3 masks it the same way).
    """
    bsz, length, _ = target_logits.shape
    steps = length - 1
    # index of the teacher row for (t, k): t + 1 + k, clamped; out-of-range rows are masked below
    rows = (
        torch.arange(steps, device=target_logits.device)[:, None]
        + 1
        + torch.arange(slots, device=target_logits.device)
    )
    in_range = rows <= length - 1  # [S, K]
    rows = rows.clamp(max=length - 1)
    teacher = target_logits[:, :, d2t][:, rows]  # [B, S, K, Vd]
    teacher = teacher.masked_fill(~in_range[None, :, :, None], float("-inf"))
    predicted = rows + 1  # the predicted token's position t + 2 + k
    exists = in_range & (predicted <= length - 1)
    predicted = predicted.clamp(max=length - 1)
    real = (batch["attention_mask"].bool() & batch["loss_mask"].bool())[:, predicted]  # [B, S, K]
    reachable = t2d[target_logits.argmax(-1)][:, rows]  # [B, S, K]
    return teacher, exists[None] & real & reachable
