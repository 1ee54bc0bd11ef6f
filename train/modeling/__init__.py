"""Drafters as pure nn.Modules (torch + transformers only).

Each drafter is a module and its config dataclass (a `DrafterConfig` subclass); what every drafter
module offers is in common.py's docstring. Every drafter's forward(features [B,T,F*H], input_ids [B,T]
(aligned: the target's token t+1), attention_mask [B,T]) returns a DrafterOutput whose slot k at
position t predicts token t+2+k; `drafter.block_size` is K. The registry that builds them by name, with
their training strategy, is train/drafters.py.
"""

from __future__ import annotations

from .common import DraftCache, DrafterConfig, DrafterOutput, DraftStep, shift_left, start_from_target_layers
from .eagle3 import Eagle3Config, Eagle3Drafter
from .specblock import SpecBlockConfig, SpecBlockDrafter, block_offsets
from .vocab import build_vocab_map, count_tokens

__all__ = [
    "DraftCache",
    "DraftStep",
    "DrafterConfig",
    "DrafterOutput",
    "Eagle3Config",
    "Eagle3Drafter",
    "SpecBlockConfig",
    "SpecBlockDrafter",
    "block_offsets",
    "build_vocab_map",
    "count_tokens",
    "shift_left",
    "start_from_target_layers",
]
