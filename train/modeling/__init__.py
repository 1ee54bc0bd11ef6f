"""Drafters as pure nn.Modules (torch + transformers only) and the registry that builds them by name.

`DRAFTERS[name]` is a builder `(cfg, target_config, embed_weight, lm_head_weight, d2t) -> nn.Module`;
`DRAFTER_CONFIGS[name]` is its config dataclass. Every drafter's forward(features [B,T,F*H],
input_ids [B,T] (aligned: the target's token t+1), attention_mask [B,T]) returns a DrafterOutput whose
slot k at position t predicts token t+2+k; `drafter.block_size` is K.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn
from transformers import PretrainedConfig

from .common import DraftCache, DrafterOutput, shift_left
from .eagle3 import Eagle3Config, Eagle3Drafter
from .specblock import SpecBlockConfig, SpecBlockDrafter, block_offsets
from .vocab import build_vocab_map, count_tokens

DrafterBuilder = Callable[[object, PretrainedConfig, Tensor, Tensor, "Tensor | None"], nn.Module]

DRAFTERS: dict[str, DrafterBuilder] = {
    "specblock": SpecBlockDrafter,
    "eagle3": Eagle3Drafter,
}
DRAFTER_CONFIGS: dict[str, type] = {
    "specblock": SpecBlockConfig,
    "eagle3": Eagle3Config,
}


def build_drafter(
    name: str,
    cfg: object | None,
    target_config: PretrainedConfig,
    embed_weight: Tensor,
    lm_head_weight: Tensor,
    d2t: Tensor | None = None,
) -> nn.Module:
    """The drafter registered as `name`, for a target with this config, embedding [V,H] and LM head
    [V,H]; cfg None = the drafter's default config; d2t None = the full vocabulary."""
    if name not in DRAFTERS:
        raise KeyError(f"unknown drafter {name!r}; registered: {sorted(DRAFTERS)}")
    cfg = DRAFTER_CONFIGS[name]() if cfg is None else cfg
    if not isinstance(cfg, DRAFTER_CONFIGS[name]):
        expected = DRAFTER_CONFIGS[name].__name__
        raise TypeError(f"drafter {name!r} takes a {expected}, got {type(cfg).__name__}")
    return DRAFTERS[name](cfg, target_config, embed_weight, lm_head_weight, d2t)


__all__ = [
    "DRAFTERS",
    "DRAFTER_CONFIGS",
    "DraftCache",
    "DrafterOutput",
    "Eagle3Config",
    "Eagle3Drafter",
    "SpecBlockConfig",
    "SpecBlockDrafter",
    "block_offsets",
    "build_drafter",
    "build_vocab_map",
    "count_tokens",
    "shift_left",
]
