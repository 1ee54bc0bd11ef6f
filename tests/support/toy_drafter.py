"""A third drafter, added the way a newcomer adds one: this module and configs/drafter/toy.yaml beside
it, nothing else (`import toy_drafter` registers it with both stages; tests/test_toy_drafter.py trains,
exports and decodes it).

The toy is Medusa-shaped: K heads read the target's features at position t and the token after it,
slot k predicting token t+2+k, with no attention (its cache holds nothing). A later block starts from
slot K-1's hidden state with the token drafted there. It trains with the plain distillation strategy
and grows EAGLE-2's dynamic tree (both read only what every drafter offers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from specblock.evaluate.decoding.drafters import DraftingSpec, eagle_tree, register_drafting
from specblock.evaluate.decoding.trees import TreeConfig
from specblock.train.distill import DistillStrategy
from specblock.train.drafters import TrainSpec, register_drafter
from specblock.train.modeling.common import (
    DraftCache,
    DrafterConfig,
    DrafterOutput,
    DraftStep,
    RMSNorm,
    draft_lm_head,
    frozen_embedding,
)
from specblock.train.modeling.vocab import resolve_vocab_map, t2d_from_d2t


@dataclass
class ToyConfig(DrafterConfig):
    """block_size: K heads (the tokens one position drafts)."""

    name: str = "toy"
    block_size: int = 2


class ToyDrafter(nn.Module):
    """hidden[k] = tanh(fc(features_t) + embed(token)) + slot_k; logits[k] = lm_head(norm(hidden[k]))."""

    def __init__(self, cfg: ToyConfig, target_config, embed_weight: Tensor, lm_head_weight: Tensor, d2t=None):
        super().__init__()
        H, V = target_config.hidden_size, target_config.vocab_size
        d2t = resolve_vocab_map(d2t, cfg.draft_vocab_size, V)
        self.cfg, self.block_size, self.hidden_size = cfg, cfg.block_size, H
        self.feature_size = cfg.num_feature_layers * H
        self.embed_tokens = frozen_embedding(embed_weight)
        self.fc = nn.Linear(self.feature_size, H, bias=False)
        self.slots = nn.Parameter(0.02 * torch.randn(cfg.block_size, H))
        self.norm = RMSNorm(H, eps=1e-6)
        self.lm_head = draft_lm_head(lm_head_weight, d2t)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d_from_d2t(d2t, V))

    def _heads(self, cond: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """cond [..., H], tokens [...] -> logits [..., K, Vd], hidden [..., K, H]."""
        hidden = torch.tanh(cond + self.embed_tokens(tokens).to(cond.dtype))[..., None, :] + self.slots
        return self.lm_head(self.norm(hidden)), hidden

    def forward(
        self, features: Tensor, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> DrafterOutput:
        """features [B,T,F*H], input_ids [B,T] aligned -> logits [B,T,K,Vd], hidden [B,T,K,H]."""
        logits, hidden = self._heads(self.fc(features), input_ids)
        return DrafterOutput(logits, hidden)

    def extend(
        self, condition: Tensor, tokens: Tensor, past: DraftCache | None = None, *, position=0
    ) -> DraftStep:
        """condition [B,N,F*H], tokens [B,N] -> [B,N,K,...]; nothing to cache, nothing read from `past`."""
        logits, hidden = self._heads(self.fc(condition), tokens)
        return DraftStep(logits, hidden, None, DraftCache([], []))

    def draft(self, condition, token, past=None, *, position=0, offset=0, inherited=False) -> DraftStep:
        """condition [B,F*H] (or [B,H] inherited: a slot's hidden state), token [B] -> [B,K,...]."""
        logits, hidden = self._heads(condition if inherited else self.fc(condition), token)
        return DraftStep(logits, hidden, None, DraftCache([], []))


register_drafter(TrainSpec("toy", ToyConfig, ToyDrafter, DistillStrategy))
register_drafting(DraftingSpec("toy", eagle_tree, TreeConfig(budget=8, steps=2, beam=2, topk=2)))
