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

from .teacher_law import TeacherLaw, argmax_last


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
    if "target_argmax" in rows[0]:  # the cache's full-vocabulary argmax (data/target_argmax.py); 0 on padding
        batch["target_argmax"] = torch.zeros(len(rows), length, dtype=torch.long)
        for i, r in enumerate(rows):
            batch["target_argmax"][i, : len(r["target_argmax"])] = r["target_argmax"]
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
    target_argmax: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[TeacherLaw, torch.Tensor]:
    """The teacher's law per target position and the validity of every (position, slot).

    target_logits [B, T, V] in any float dtype (bf16 included: only the draft columns are upcast, exactly).
    With `target_argmax` [B, T] (the target's argmax over its full vocabulary, from the feature cache),
    target_logits are the draft vocabulary's columns only, [B, T, Vd]: the same law and validity.
    Returns law [B, T+slots] (a TeacherLaw over the draft vocabulary: row j is the softmax of the target's
    logits / `temperature` at position j restricted to the draft vocabulary; rows j >= T are zero padding,
    never valid) and valid [B, S, slots]. Slot k at context position t reads row t+1+k:
    `law.slot_grid(1 + offset, S, K)` gives a block at token offset `offset` its [B, S, K, Vd] teacher as a
    view, without K copies.
    valid[:, t, k]: the predicted token t+2+k exists, is a real token, is an assistant token (loss_mask),
    and the target's own next token (its argmax over the FULL vocabulary) lies in the draft vocabulary:
    a slot whose target token the drafter cannot even emit cannot be accepted at temperature 0, and
    training it against the renormalised rest would teach a wrong argmax (EAGLE-3 masks it the same way).
    """
    _, length, _ = target_logits.shape
    steps, device = length - 1, target_logits.device
    law = TeacherLaw.from_logits(
        target_logits if target_argmax is not None else target_logits[:, :, d2t],
        pad=slots,
        temperature=temperature,
    )
    rows = torch.arange(steps, device=device)[:, None] + 1 + torch.arange(slots, device=device)  # [S, K]
    predicted = rows + 1  # the predicted token's position t + 2 + k
    exists = predicted <= length - 1
    predicted = predicted.clamp(max=length - 1)
    real = (batch["attention_mask"].bool() & batch["loss_mask"].bool())[:, predicted]  # [B, S, K]
    top = target_argmax if target_argmax is not None else argmax_last(target_logits)  # [B, T]
    reachable = t2d[top][:, rows.clamp(max=length - 1)]  # [B, S, K]
    return law, exists[None] & real & reachable
