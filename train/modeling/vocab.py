"""The draft vocabulary (EAGLE-3 style frequency pruning).

d2t: LongTensor [Vd], draft id -> target id, sorted ascending, so `x[..., t2d] == x[..., d2t]` for any
target-vocabulary tensor x (boolean indexing keeps ascending order). t2d: BoolTensor [V], True for the
target ids the drafter can emit. Unlike EAGLE-3's checkpoint format (d2t stored as the offset
target_id - draft_id), d2t holds the target ids themselves; an exporter converts.
"""

from __future__ import annotations

import torch
from torch import Tensor


def build_vocab_map(token_counts: Tensor, draft_vocab_size: int | None) -> tuple[Tensor, Tensor]:
    """token_counts [V] -> (d2t [Vd], t2d [V]): the draft_vocab_size most frequent target ids (ties go
    to the lower id), sorted ascending. draft_vocab_size None (or V) = the full vocabulary."""
    V = token_counts.shape[0]
    if draft_vocab_size is None or draft_vocab_size == V:
        return torch.arange(V), torch.ones(V, dtype=torch.bool)  # the identity map
    if not 0 < draft_vocab_size < V:
        raise ValueError(f"draft_vocab_size must be in [1, {V}] or None, got {draft_vocab_size}")
    # A stable descending sort keeps ids in increasing order among equal counts.
    order = torch.sort(token_counts.cpu().long(), descending=True, stable=True).indices
    d2t = order[:draft_vocab_size].sort().values
    return d2t, t2d_from_d2t(d2t, V)


def t2d_from_d2t(d2t: Tensor, vocab_size: int) -> Tensor:
    """[Vd] target ids -> [V] bool membership."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device=d2t.device)
    t2d[d2t] = True
    return t2d


def check_vocab_map(d2t: Tensor, vocab_size: int) -> None:
    """Raises ValueError unless d2t is a strictly increasing LongTensor of target ids in [0, V)."""
    if d2t.dtype != torch.long or d2t.dim() != 1 or d2t.numel() == 0:
        raise ValueError(f"d2t must be a non-empty 1-D LongTensor, got {d2t.dtype} {tuple(d2t.shape)}")
    if d2t[0] < 0 or d2t[-1] >= vocab_size or (d2t.numel() > 1 and not bool((d2t[1:] > d2t[:-1]).all())):
        raise ValueError(f"d2t must hold strictly increasing target ids in [0, {vocab_size})")


def count_tokens(input_ids: Tensor, vocab_size: int, mask: Tensor | None = None) -> Tensor:
    """input_ids [...] (and mask [...], 1 = count) -> counts [V] (long): the input of build_vocab_map."""
    ids = input_ids.reshape(-1)
    if mask is not None:
        ids = ids[mask.reshape(-1).bool()]
    return torch.bincount(ids.long(), minlength=vocab_size)[:vocab_size]


def target_to_draft_ids(target_ids: Tensor, d2t: Tensor) -> Tensor:
    """Target ids [...] -> draft ids [...], -1 where the token is not in the draft vocabulary."""
    d2t = d2t.to(target_ids.device)
    idx = torch.searchsorted(d2t, target_ids.long()).clamp(max=d2t.numel() - 1)
    return torch.where(d2t[idx] == target_ids, idx, torch.full_like(idx, -1))


def resolve_vocab_map(d2t: Tensor | None, draft_vocab_size: int | None, vocab_size: int) -> Tensor:
    """The d2t a drafter is built with: the given map (checked against draft_vocab_size) or, when None,
    the full vocabulary (only allowed when draft_vocab_size is None or V)."""
    if d2t is None:
        if draft_vocab_size not in (None, vocab_size):
            raise ValueError(
                f"draft_vocab_size={draft_vocab_size} needs a vocab map: pass d2t from "
                "build_vocab_map(token_counts, draft_vocab_size)"
            )
        return torch.arange(vocab_size)
    d2t = d2t.detach().long().cpu()
    check_vocab_map(d2t, vocab_size)
    if draft_vocab_size is not None and d2t.numel() != draft_vocab_size:
        raise ValueError(f"d2t holds {d2t.numel()} ids but draft_vocab_size={draft_vocab_size}")
    return d2t
